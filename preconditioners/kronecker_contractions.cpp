#include "preconditioners/kronecker_contractions.h"

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace shampoo::detail {
namespace {

/// Matrix [d_dim, rest] of one block with block dim `dim` first (a copy only for a middle dim).
at::Tensor dim_major(const at::Tensor& block, int64_t dim) {
  const int64_t d = block.size(dim);
  return block.movedim(dim, 0).reshape({d, -1});
}

}  // namespace

bool aligned_output(const at::Tensor& t) {
  return t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % 64 == 0;
}

at::Tensor aligned_matrix_operand(const at::Tensor& t) {
  // CPU BLAS and LAPACK take alignment-dependent code paths: the same matrix at another address
  // can round differently. Operands start on a 64-byte boundary, as fresh allocations do, so a
  // block's result depends on its values only, not on its position in a stack.
  if (aligned_output(t)) return t;
  return t.clone(at::MemoryFormat::Contiguous);
}

namespace {

/// CUDA: one batched product for the whole stack (GPU runs are compared within tolerance, not
/// bit for bit, so the batch may round as cuBLAS likes).
at::Tensor batched_outer_product(const at::Tensor& blocks, int64_t dim) {
  const int64_t order = blocks.dim() - 1;
  const int64_t n = blocks.size(0);
  const int64_t d = blocks.size(dim + 1);
  if (order >= 2 && dim == order - 1) {
    const auto x = blocks.reshape({n, -1, d});
    return at::bmm(x.transpose(1, 2), x);
  }
  const auto x = blocks.movedim(dim + 1, 1).reshape({n, d, -1});
  return at::bmm(x, x.transpose(1, 2));
}

/// Block dims from which the lower-only product pays: each of its two products still fills an
/// H100 with 128×128 tiles for a stack of a few blocks.
constexpr int64_t kLowerOuterMinDim = 256;

std::atomic<bool> lower_outer_products{true};

/// CUDA: the lower blocks of x·xᵀ for x [n, d, c] (x may be a transposed view): columns [0, h) of
/// every row, then rows and columns [h, d), each one batched product written in place.
at::Tensor batched_lower_gram(const at::Tensor& x) {
  const int64_t n = x.size(0);
  const int64_t d = x.size(1);
  const int64_t h = d / 2 / 64 * 64;  // a multiple of 64: the products' operands stay aligned
  auto out = at::empty({n, d, d}, x.options());
  auto left = out.narrow(2, 0, h);
  at::bmm_out(left, x, x.narrow(1, 0, h).transpose(1, 2));
  const auto bottom = x.narrow(1, h, d - h);
  auto corner = out.narrow(1, h, d - h).narrow(2, h, d - h);
  at::bmm_out(corner, bottom, bottom.transpose(1, 2));
  return out;
}

at::Tensor batched_multiply_along_dim(const at::Tensor& blocks, const at::Tensor& matrices,
                                      int64_t dim, bool transpose) {
  const int64_t order = blocks.dim() - 1;
  const int64_t n = blocks.size(0);
  const int64_t d = blocks.size(dim + 1);
  const auto m = transpose ? matrices.transpose(1, 2) : matrices;
  if (dim == 0) return at::bmm(m, blocks.reshape({n, d, -1})).view(blocks.sizes());
  if (dim == order - 1) {
    return at::bmm(blocks.reshape({n, -1, d}), m.transpose(1, 2)).view(blocks.sizes());
  }
  const auto moved_sizes = blocks.movedim(dim + 1, 1).sizes().vec();
  const auto x = blocks.movedim(dim + 1, 1).reshape({n, d, -1});
  return at::bmm(m, x).view(moved_sizes).movedim(1, dim + 1).contiguous();
}

}  // namespace

namespace {

/// Rows of a panel of lower_gram_into (a multiple of 16 floats: panels stay 64-byte aligned); the
/// last panel takes the remainder too (up to twice as many rows): a panel of a few rows would be a
/// matrix-vector product, which MKL sums in another order.
constexpr int64_t kGramPanel = 128;

/// The lower triangle, diagonal included, of an n×n matrix as a mask.
at::Tensor lower_mask(int64_t n, const at::Device& device) {
  return at::ones({n, n}, at::TensorOptions().dtype(at::kBool).device(device)).tril();
}

/// Calls fn(start, rows) for each panel of rows of a d×d lower_gram_into product (d ≥ two panels):
/// kGramPanel rows each, the last one taking the remainder too.
template <typename Fn>
void for_each_gram_panel(int64_t d, Fn&& fn) {
  for (int64_t start = 0; start < d; start += kGramPanel) {
    const int64_t rows = d - start < 2 * kGramPanel ? d - start : kGramPanel;
    fn(start, rows);
    if (rows != kGramPanel) break;  // the last panel
  }
}

/// x·xᵀ for x [d, c] (x may be a transposed view) into `out` [d, d] (an aligned output), computed
/// as BLAS's syrk does: one triangle. Panel i (rows r of kGramPanel) is x[r]·x[0:r_end]ᵀ, the block
/// row of the lower triangle up to and including the diagonal block, written in place. The part of
/// the upper triangle outside the diagonal blocks is left unwritten (mirror_gram_panels fills it).
/// Each panel is one GEMM with the same contraction (length c) as the full product. Where BLAS
/// sums a panel as it sums the full product (MKL on the CI machine, AMD Zen 5), the lower triangle
/// is bit for bit the full product's; MKL does not promise it, and on the GPU machine's host CPU
/// it differed in 2 of kronecker_contractions_test's cases (2026-11-26). The stored factors keep
/// only the lower triangle either way. (k+1)/(2k) of the full product's multiplications with k
/// panels (62.5% at d = 512, 56% at d = 1024; 37-41% less time on one thread, issue 28).
/// Below two panels, one product (its triangles as that GEMM rounds them).
void lower_gram_into(at::Tensor& out, const at::Tensor& x) {
  const int64_t d = x.size(0);
  if (d < 2 * kGramPanel) {
    at::mm_out(out, x, x.t());
    return;
  }
  for_each_gram_panel(d, [&](int64_t start, int64_t rows) {
    auto panel = out.narrow(0, start, rows).narrow(1, 0, start + rows);
    at::mm_out(panel, x.narrow(0, start, rows), x.narrow(0, 0, start + rows).t());
  });
}

/// Makes lower_gram_into's result symmetric: each panel's part left of its diagonal block is
/// mirrored above it, and so is each diagonal block's lower triangle (a GEMM need not round (i, j)
/// and (j, i) alike: MKL on the device machine's host CPU did not). A single product is left as
/// it is.
void mirror_gram_panels(at::Tensor& out) {
  const int64_t d = out.size(0);
  if (d < 2 * kGramPanel) return;
  for_each_gram_panel(d, [&](int64_t start, int64_t rows) {
    auto panel = out.narrow(0, start, rows).narrow(1, 0, start + rows);
    if (start > 0) {
      out.narrow(0, 0, start).narrow(1, start, rows).copy_(panel.narrow(1, 0, start).t());
    }
    auto diagonal = panel.narrow(1, start, rows);
    diagonal.copy_(at::where(lower_mask(rows, out.device()), diagonal, diagonal.t()));
  });
}

/// One block's contraction with itself along `dim` into `out` [d, d] (an aligned output): its
/// lower triangle, and the upper one too unless `lower_only`.
void block_gram_into(at::Tensor& out, const at::Tensor& block_in, int64_t dim, bool lower_only) {
  const int64_t order = block_in.dim();
  const int64_t d = block_in.size(dim);
  const auto block = aligned_matrix_operand(block_in);
  // Last dim: [rest, d] -> Xᵀ·X without moving data.
  const auto x = order >= 2 && dim == order - 1 ? block.reshape({-1, d}).t()
                                                : aligned_matrix_operand(dim_major(block, dim));
  lower_gram_into(out, x);
  if (!lower_only) mirror_gram_panels(out);
}

/// CPU: every block of the stack on its own, written straight into its slot of the result where
/// that slot is an aligned output (else through a fresh matrix).
at::Tensor stacked_gram(const at::Tensor& blocks, int64_t dim, bool lower_only) {
  const int64_t n = blocks.size(0);
  const int64_t d = blocks.size(dim + 1);
  auto out = at::empty({n, d, d}, blocks.options());
  for (int64_t i = 0; i < n; ++i) {
    auto slot = out[i];
    if (aligned_output(slot)) {
      block_gram_into(slot, blocks[i], dim, lower_only);
      continue;
    }
    auto fresh = at::empty({d, d}, blocks.options());
    block_gram_into(fresh, blocks[i], dim, lower_only);
    slot.copy_(fresh);
  }
  return out;
}

/// One block multiplied along its first or last dim into `out` (an aligned output, the block's
/// shape).
void block_multiply_into(at::Tensor& out, const at::Tensor& block_in, const at::Tensor& matrix_in,
                         int64_t dim, bool transpose) {
  const int64_t d = block_in.size(dim);
  const auto block = aligned_matrix_operand(block_in);
  const auto matrix = aligned_matrix_operand(matrix_in);
  const auto m = transpose ? matrix.t() : matrix;
  if (dim == 0) {
    auto target = out.view({d, -1});
    at::mm_out(target, m, block.reshape({d, -1}));
    return;
  }
  auto target = out.view({-1, d});
  at::mm_out(target, block.reshape({-1, d}), m.t());
}

}  // namespace

at::Tensor block_outer_product(const at::Tensor& block, int64_t dim) {
  const int64_t d = block.size(dim);
  auto out = at::empty({d, d}, block.options());
  block_gram_into(out, block, dim, /*lower_only=*/false);
  return out;
}

at::Tensor block_multiply_along_dim(const at::Tensor& block_in, const at::Tensor& matrix_in,
                                    int64_t dim, bool transpose) {
  const int64_t order = block_in.dim();
  if (dim == 0 || dim == order - 1) {
    auto out = at::empty(block_in.sizes(), block_in.options());
    block_multiply_into(out, block_in, matrix_in, dim, transpose);
    return out;
  }
  // Middle dim of a block with three or more dims: move it first, multiply, move it back.
  const auto block = aligned_matrix_operand(block_in);
  const auto matrix = aligned_matrix_operand(matrix_in);
  const auto m = transpose ? matrix.t() : matrix;
  const auto moved_sizes = block.movedim(dim, 0).sizes().vec();
  const auto x = aligned_matrix_operand(dim_major(block, dim));
  return at::mm(m, x).view(moved_sizes).movedim(0, dim).contiguous();
}

void block_multiply_along_dim_out(at::Tensor& out, const at::Tensor& block,
                                  const at::Tensor& matrix, int64_t dim, bool transpose) {
  TORCH_INTERNAL_ASSERT(out.sizes() == block.sizes(), "out ", out.sizes(), " for a block ",
                        block.sizes());
  const bool outer_dim = dim == 0 || dim == block.dim() - 1;
  if (outer_dim && aligned_output(out) && out.scalar_type() == block.scalar_type() &&
      at::get_overlap_status(out, block) == at::MemOverlapStatus::No &&
      at::get_overlap_status(out, matrix) == at::MemOverlapStatus::No) {
    block_multiply_into(out, block, matrix, dim, transpose);
    return;
  }
  out.copy_(block_multiply_along_dim(block, matrix, dim, transpose));
}

at::Tensor stacked_outer_product(const at::Tensor& blocks, int64_t dim) {
  const int64_t order = blocks.dim() - 1;
  TORCH_INTERNAL_ASSERT(dim >= 0 && dim < order, "dim ", dim, " out of range for order ", order);
  if (blocks.is_cuda()) return batched_outer_product(blocks, dim);
  return stacked_gram(blocks, dim, /*lower_only=*/false);
}

at::Tensor stacked_outer_product_lower(const at::Tensor& blocks, int64_t dim) {
  const int64_t order = blocks.dim() - 1;
  TORCH_INTERNAL_ASSERT(dim >= 0 && dim < order, "dim ", dim, " out of range for order ", order);
  const int64_t n = blocks.size(0);
  const int64_t d = blocks.size(dim + 1);
  if (!blocks.is_cuda()) return stacked_gram(blocks, dim, /*lower_only=*/true);
  if (d < kLowerOuterMinDim || !lower_outer_products.load()) {
    return batched_outer_product(blocks, dim);
  }
  if (order >= 2 && dim == order - 1) {
    return batched_lower_gram(blocks.reshape({n, -1, d}).transpose(1, 2));
  }
  return batched_lower_gram(blocks.movedim(dim + 1, 1).reshape({n, d, -1}));
}

void set_lower_outer_products_for_benchmarks(bool enabled) { lower_outer_products.store(enabled); }

at::Tensor stacked_multiply_along_dim(const at::Tensor& blocks, const at::Tensor& matrices,
                                      int64_t dim, bool transpose) {
  const int64_t order = blocks.dim() - 1;
  TORCH_INTERNAL_ASSERT(dim >= 0 && dim < order, "dim ", dim, " out of range for order ", order);
  if (blocks.is_cuda()) return batched_multiply_along_dim(blocks, matrices, dim, transpose);
  auto out = at::empty_like(blocks, at::MemoryFormat::Contiguous);
  for (int64_t i = 0; i < blocks.size(0); ++i) {
    auto slot = out[i];
    block_multiply_along_dim_out(slot, blocks[i], matrices[i], dim, transpose);
  }
  return out;
}

}  // namespace shampoo::detail
