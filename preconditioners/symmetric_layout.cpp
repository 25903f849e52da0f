// The packed layout of symmetric_matrices.h: pack, unpack and mirror (CPU loops, AVX2 where the
// CPU has it, CUDA kernels), the factor update on packed storage, the symmetric part. The stack
// class SymmetricMatrices is in symmetric_matrices.cpp.
#include "preconditioners/symmetric_matrices.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "preconditioners/symmetric_loops.h"
#include "shampoo/config.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if SHAMPOO_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "preconditioners/cuda/symmetric_kernels.h"
#endif

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

namespace shampoo::detail {
namespace {

/// Offset of row i's first stored entry (i, 0) in a packed matrix (row i holds i + 1 entries).
constexpr int64_t row_offset(int64_t i) { return i * (i + 1) / 2; }

/// Rows and columns per tile of the CPU copies onto upper triangles. An entry-by-entry walk down
/// a column touched a new cache line per entry, and with d a power of two those lines share a few
/// L1 sets. A tile is read as runs of the source rows and written as runs of the destination
/// rows instead: through 8×8 register blocks (4-byte entries with AVX2), else through a local
/// kTile×kTile buffer (bench_micro UnpackSymmetric; figures in benchmarks/RESULTS.md).
constexpr int64_t kTile = kSymmetricBand;

/// The upper triangle of rows [i0, i1) of one d×d matrix (i1 − i0 ≤ kTile): (i, j) ← lower(j, i)
/// for j > i, where `lower(j)` points at row j's entries (j, 0), (j, 1), … (a packed row or a
/// dense one).
template <typename Element, typename LowerRow>
void fill_upper_rows(Element* dense, int64_t d, int64_t i0, int64_t i1, LowerRow lower) {
  Element tile[kTile][kTile];
  const int64_t rows = i1 - i0;
  for (int64_t j0 = i0; j0 < d; j0 += kTile) {
    const int64_t j1 = std::min(d, j0 + kTile);
    for (int64_t j = j0; j < j1; ++j) {
      // Row j's columns [i0, min(i1, j)): the entries (i, j) above the diagonal.
      const int64_t count = std::min(i1, j) - i0;
      if (count > 0) std::memcpy(tile[j - j0], lower(j) + i0, sizeof(Element) * count);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      Element* out = dense + i * d;
      for (int64_t j = std::max(j0, i + 1); j < j1; ++j) out[j] = tile[j - j0][r];
    }
  }
}

#if defined(__x86_64__)
/// fill_upper_rows for 4-byte entries with AVX2: 8×8 blocks strictly above the diagonal moved
/// through registers (eight 32-byte loads from eight source rows, the unpack/shuffle/permute
/// transpose, eight 32-byte stores), the blocks that touch the diagonal and the ragged edges
/// entry by entry. Shuffles move bits, so the copy is exact. Source row j starts at
/// `source + (packed ? j(j+1)/2 : j·d)`.
__attribute__((target("avx2"))) void fill_upper_rows_avx2(uint32_t* dense, const uint32_t* source,
                                                          bool packed, int64_t d, int64_t i0,
                                                          int64_t i1) {
  const auto row = [&](int64_t j) { return source + (packed ? row_offset(j) : j * d); };
  for (int64_t ib = i0; ib < i1; ib += 8) {
    const int64_t ie = std::min(i1, ib + 8);
    // The block on the diagonal: row i's columns i + 1 … ib + 7.
    for (int64_t j = ib + 1; j < std::min(d, ib + 8); ++j) {
      const uint32_t* from = row(j);
      for (int64_t i = ib; i < std::min(ie, j); ++i) dense[i * d + j] = from[i];
    }
    int64_t jb = ib + 8;
    if (ie - ib == 8) {
      for (; jb + 8 <= d; jb += 8) {
        __m256 r[8];
        for (int k = 0; k < 8; ++k) {
          r[k] = _mm256_loadu_ps(reinterpret_cast<const float*>(row(jb + k) + ib));
        }
        __m256 t[8], u[8];
        for (int k = 0; k < 4; ++k) {
          t[2 * k] = _mm256_unpacklo_ps(r[2 * k], r[2 * k + 1]);
          t[2 * k + 1] = _mm256_unpackhi_ps(r[2 * k], r[2 * k + 1]);
        }
        for (int h = 0; h < 2; ++h) {
          const int b = 4 * h;
          u[b + 0] = _mm256_shuffle_ps(t[b + 0], t[b + 2], 0x44);
          u[b + 1] = _mm256_shuffle_ps(t[b + 0], t[b + 2], 0xEE);
          u[b + 2] = _mm256_shuffle_ps(t[b + 1], t[b + 3], 0x44);
          u[b + 3] = _mm256_shuffle_ps(t[b + 1], t[b + 3], 0xEE);
        }
        for (int k = 0; k < 4; ++k) {
          _mm256_storeu_ps(reinterpret_cast<float*>(dense + (ib + k) * d + jb),
                           _mm256_permute2f128_ps(u[k], u[k + 4], 0x20));
          _mm256_storeu_ps(reinterpret_cast<float*>(dense + (ib + k + 4) * d + jb),
                           _mm256_permute2f128_ps(u[k], u[k + 4], 0x31));
        }
      }
    }
    // What is left of the band's columns: a short band, or the last columns of a d not a multiple
    // of 8.
    for (int64_t j = jb; j < d; ++j) {
      const uint32_t* from = row(j);
      for (int64_t i = ib; i < ie; ++i) dense[i * d + j] = from[i];
    }
  }
}

bool runs_avx2() {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2;
}
#endif

/// fill_upper_rows from packed rows (`packed`) or from the dense matrix's own lower triangle.
template <typename Element>
void fill_upper_band(Element* dense, const Element* source, bool packed, int64_t d, int64_t i0,
                     int64_t i1) {
#if defined(__x86_64__)
  if constexpr (sizeof(Element) == 4) {
    if (runs_avx2()) {
      fill_upper_rows_avx2(reinterpret_cast<uint32_t*>(dense),
                           reinterpret_cast<const uint32_t*>(source), packed, d, i0, i1);
      return;
    }
  }
#endif
  fill_upper_rows(dense, d, i0, i1,
                  [&](int64_t j) { return source + (packed ? row_offset(j) : j * d); });
}

/// Copies of `count` matrices on the CPU: one element is `Element` (pack and unpack move bytes,
/// so only the element size matters). `packed` → `dense` when `unpack`, else the reverse. Work
/// items are bands of kTile rows.
template <typename Element>
void copy_triangles(Element* dense, Element* packed, int64_t count, int64_t d, bool unpack) {
  const int64_t p = packed_size(d);
  const int64_t bands = (d + kTile - 1) / kTile;
  at::parallel_for(0, count * bands, 2, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t m = task / bands;
      const int64_t i0 = (task % bands) * kTile;
      const int64_t i1 = std::min(d, i0 + kTile);
      Element* dense_matrix = dense + m * d * d;
      Element* packed_matrix = packed + m * p;
      for (int64_t i = i0; i < i1; ++i) {
        Element* dense_row = dense_matrix + i * d;
        Element* packed_row = packed_matrix + row_offset(i);
        if (unpack) {
          std::memcpy(dense_row, packed_row, sizeof(Element) * (i + 1));
        } else {
          std::memcpy(packed_row, dense_row, sizeof(Element) * (i + 1));
        }
      }
      // Above the diagonal: (i, j) = (j, i), stored in row j at column i.
      if (unpack) fill_upper_band(dense_matrix, packed_matrix, /*packed=*/true, d, i0, i1);
    }
  });
}

template <typename Element>
void mirror_cpu(Element* dense, int64_t count, int64_t d) {
  const int64_t bands = (d + kTile - 1) / kTile;
  at::parallel_for(0, count * bands, 2, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      Element* matrix = dense + (task / bands) * d * d;
      const int64_t i0 = (task % bands) * kTile;
      // Reads only entries below the diagonal, which no band writes.
      fill_upper_band(matrix, matrix, /*packed=*/false, d, i0, std::min(d, i0 + kTile));
    }
  });
}

/// Dispatches on the element size (1, 2, 4 or 8 bytes) as an unsigned integer type.
template <typename F>
void by_element_size(const at::Tensor& t, F&& f) {
  switch (t.element_size()) {
    case 1:
      f(uint8_t{});
      return;
    case 2:
      f(uint16_t{});
      return;
    case 4:
      f(uint32_t{});
      return;
    case 8:
      f(uint64_t{});
      return;
    default:
      TORCH_CHECK(false, "symmetric matrices: unsupported dtype ", t.scalar_type());
  }
}

#if SHAMPOO_WITH_CUDA
/// The CUDA pack and unpack kernels copy elements of 1, 2, 4 or 8 bytes; others (complex128)
/// go through index_select.
bool copied_by_kernels(const at::Tensor& t) {
  const auto size = t.element_size();
  return size == 1 || size == 2 || size == 4 || size == 8;
}
#endif

/// Accelerators: index tensors, cached per (d, device). `pack`: the linear indices i·d + j of the
/// lower triangle, row by row; else per dense position the packed index of (max, min).
const at::Tensor& index_map(int64_t d, const at::Device& device, bool pack) {
  static std::mutex mutex;
  static std::map<std::tuple<int64_t, std::string, bool>, at::Tensor> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  auto& entry = cache[{d, device.str(), pack}];
  if (!entry.defined()) {
    std::vector<int64_t> index;
    if (pack) {
      for (int64_t i = 0; i < d; ++i) {
        for (int64_t j = 0; j <= i; ++j) index.push_back(i * d + j);
      }
    } else {
      for (int64_t i = 0; i < d; ++i) {
        for (int64_t j = 0; j < d; ++j) {
          const auto [a, b] = i >= j ? std::pair{i, j} : std::pair{j, i};
          index.push_back(row_offset(a) + b);
        }
      }
    }
    entry = at::tensor(index, at::TensorOptions().dtype(at::kLong)).to(device);
  }
  return entry;
}

}  // namespace

at::Tensor pack_lower(const at::Tensor& dense) {
  TORCH_INTERNAL_ASSERT(dense.dim() >= 2 && dense.size(-1) == dense.size(-2));
  const int64_t d = dense.size(-1);
  auto batch = dense.sizes().vec();
  batch.pop_back();
  batch.back() = packed_size(d);
  if (!dense.device().is_cpu()) {
#if SHAMPOO_WITH_CUDA
    if (dense.is_cuda() && copied_by_kernels(dense)) {
      const c10::cuda::CUDAGuard guard(dense.device());
      const auto src = dense.contiguous();
      auto out = at::empty(batch, dense.options());
      const int64_t count = d == 0 ? 0 : src.numel() / (d * d);
      C10_CUDA_CHECK(kernels::cuda::launch_pack_lower(src.data_ptr(), out.data_ptr(), count, d,
                                                      static_cast<int>(src.element_size()),
                                                      c10::cuda::getCurrentCUDAStream()));
      return out;
    }
#endif
    return dense.reshape({-1, d * d})
        .index_select(1, index_map(d, dense.device(), true))
        .view(batch);
  }
  const auto src = dense.contiguous();
  auto out = at::empty(batch, dense.options());
  const int64_t count = d == 0 ? 0 : src.numel() / (d * d);
  by_element_size(src, [&](auto element) {
    using E = decltype(element);
    copy_triangles<E>(static_cast<E*>(src.data_ptr()), static_cast<E*>(out.data_ptr()), count, d,
                      /*unpack=*/false);
  });
  return out;
}

at::Tensor unpack_symmetric(const at::Tensor& packed, int64_t d) {
  TORCH_INTERNAL_ASSERT(packed.dim() >= 1 && packed.size(-1) == packed_size(d));
  auto shape = packed.sizes().vec();
  shape.back() = d;
  shape.push_back(d);
  if (!packed.device().is_cpu()) {
#if SHAMPOO_WITH_CUDA
    if (packed.is_cuda() && copied_by_kernels(packed)) {
      const c10::cuda::CUDAGuard guard(packed.device());
      const auto src = packed.contiguous();
      auto out = at::empty(shape, packed.options());
      const int64_t count = d == 0 ? 0 : src.numel() / packed_size(d);
      C10_CUDA_CHECK(kernels::cuda::launch_unpack_symmetric(src.data_ptr(), out.data_ptr(), count,
                                                            d, static_cast<int>(src.element_size()),
                                                            c10::cuda::getCurrentCUDAStream()));
      return out;
    }
#endif
    return packed.reshape({-1, packed_size(d)})
        .index_select(1, index_map(d, packed.device(), false))
        .view(shape);
  }
  auto out = at::empty(shape, packed.options());
  unpack_symmetric_into(out, packed);
  return out;
}

void unpack_symmetric_into(at::Tensor& out, const at::Tensor& packed) {
  TORCH_INTERNAL_ASSERT(out.dim() >= 2 && out.size(-1) == out.size(-2));
  const int64_t d = out.size(-1);
  TORCH_INTERNAL_ASSERT(packed.dim() >= 1 && packed.size(-1) == packed_size(d) &&
                            packed.numel() / std::max<int64_t>(1, packed_size(d)) ==
                                out.numel() / std::max<int64_t>(1, d * d),
                        "unpack_symmetric_into: ", packed.sizes(), " into ", out.sizes());
  if (!out.device().is_cpu() || !out.is_contiguous() || out.scalar_type() != packed.scalar_type() ||
      out.device() != packed.device()) {
    out.copy_(unpack_symmetric(packed, d).view(out.sizes()));
    return;
  }
  const auto src = packed.contiguous();
  const int64_t count = d == 0 ? 0 : src.numel() / packed_size(d);
  by_element_size(src, [&](auto element) {
    using E = decltype(element);
    copy_triangles<E>(static_cast<E*>(out.data_ptr()), static_cast<E*>(src.data_ptr()), count, d,
                      /*unpack=*/true);
  });
}

bool decay_add_packed_(at::Tensor& stored, const at::Tensor& outer, const at::Tensor& beta2,
                       const at::Tensor& weight) {
  const auto dtype = stored.scalar_type();
  const int64_t count = stored.dim() == 2 ? stored.size(0) : -1;
  const bool applies =
      (stored.is_cpu() || (SHAMPOO_WITH_CUDA && stored.is_cuda())) && stored.dim() == 2 &&
      stored.is_contiguous() && (dtype == at::kFloat || dtype == at::kDouble) && outer.dim() == 3 &&
      outer.size(0) == count && outer.size(1) == outer.size(2) &&
      stored.size(1) == packed_size(outer.size(1)) && outer.scalar_type() == dtype &&
      beta2.scalar_type() == dtype && weight.scalar_type() == dtype && beta2.numel() == count &&
      weight.numel() == count && beta2.is_contiguous() && weight.is_contiguous() &&
      outer.device() == stored.device() && beta2.device() == stored.device() &&
      weight.device() == stored.device();
  if (!applies) return false;
  const auto src = outer.contiguous();
  const int64_t d = outer.size(1);
  if (stored.is_cpu()) {
    AT_DISPATCH_FLOATING_TYPES(dtype, "decay_add_packed_", [&] {
      auto* to = stored.data_ptr<scalar_t>();
      const auto* from = src.data_ptr<scalar_t>();
      const auto* b = beta2.data_ptr<scalar_t>();
      const auto* w = weight.data_ptr<scalar_t>();
      at::parallel_for(0, count * d, 64, [&](int64_t begin, int64_t end) {
        decay_add_packed_rows<scalar_t>(to, from, b, w, d, begin, end);
      });
    });
    return true;
  }
#if SHAMPOO_WITH_CUDA
  const c10::cuda::CUDAGuard guard(stored.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  if (dtype == at::kFloat) {
    C10_CUDA_CHECK(kernels::cuda::launch_packed_decay_add<float>(
        stored.data_ptr<float>(), src.data_ptr<float>(), beta2.data_ptr<float>(),
        weight.data_ptr<float>(), count, d, stream));
  } else {
    C10_CUDA_CHECK(kernels::cuda::launch_packed_decay_add<double>(
        stored.data_ptr<double>(), src.data_ptr<double>(), beta2.data_ptr<double>(),
        weight.data_ptr<double>(), count, d, stream));
  }
#endif
  return true;
}

void mirror_lower_(at::Tensor& dense) {
  TORCH_INTERNAL_ASSERT(dense.dim() >= 2 && dense.size(-1) == dense.size(-2));
  const int64_t d = dense.size(-1);
  if (!dense.device().is_cpu() || !dense.is_contiguous()) {
    dense.copy_(unpack_symmetric(pack_lower(dense), d));
    return;
  }
  const int64_t count = d == 0 ? 0 : dense.numel() / (d * d);
  by_element_size(dense, [&](auto element) {
    using E = decltype(element);
    mirror_cpu<E>(static_cast<E*>(dense.data_ptr()), count, d);
  });
}

at::Tensor symmetric_part(at::Tensor dense) {
  TORCH_INTERNAL_ASSERT(dense.dim() >= 2 && dense.size(-1) == dense.size(-2));
  const auto dtype = dense.scalar_type();
  if (!dense.device().is_cpu() || !dense.is_contiguous() ||
      (dtype != at::kFloat && dtype != at::kDouble)) {
    return (dense + dense.transpose(-2, -1)) * 0.5;
  }
  const int64_t d = dense.size(-1);
  const int64_t count = d == 0 ? 0 : dense.numel() / (d * d);
  const int64_t bands = (d + kTile - 1) / kTile;
  AT_DISPATCH_FLOATING_TYPES(dtype, "symmetric_part", [&] {
    auto* data = dense.data_ptr<scalar_t>();
    at::parallel_for(0, count * bands, 2, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t i0 = (task % bands) * kTile;
        symmetric_part_band<scalar_t>(data + (task / bands) * d * d, d, i0,
                                      std::min(d, i0 + kTile));
      }
    });
  });
  return dense;
}

}  // namespace shampoo::detail
