#include "preconditioners/kronecker_contractions.h"

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

at::Tensor aligned_matrix_operand(const at::Tensor& t) {
  // CPU BLAS and LAPACK take alignment-dependent code paths: the same matrix at another address
  // can round differently. Operands start on a 64-byte boundary, as fresh allocations do, so a
  // block's result depends on its values only, not on its position in a stack.
  const auto address = reinterpret_cast<uintptr_t>(t.data_ptr());
  if (t.is_contiguous() && address % 64 == 0) return t;
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

/// Rows of a panel of symmetric_gram (a multiple of 16 floats: panels stay 64-byte aligned); the
/// last panel takes the remainder too (up to twice as many rows): a panel of a few rows would be a
/// matrix-vector product, which MKL sums in another order.
constexpr int64_t kGramPanel = 128;

/// The lower triangle, diagonal included, of an n×n matrix as a mask.
at::Tensor lower_mask(int64_t n, const at::Device& device) {
  return at::ones({n, n}, at::TensorOptions().dtype(at::kBool).device(device)).tril();
}

/// x·xᵀ for x [d, c] (x may be a transposed view), computed as BLAS's syrk does: one triangle.
/// Panel i (rows r of kGramPanel) is x[r]·x[0:r_end]ᵀ, the block row of the lower triangle up to
/// and including the diagonal block, written in place; its part left of the diagonal block is then
/// mirrored above it, and so is the diagonal block's lower triangle: the result is symmetric.
/// Each panel is one GEMM with the same contraction (length c) as the full product. Where BLAS
/// sums a panel as it sums the full product (MKL on the CI machine, AMD Zen 5), the lower triangle
/// is bit for bit the full product's; MKL does not promise it, and on the GPU machine's host CPU
/// it differed in 2 of kronecker_contractions_test's cases (2026-11-26). The stored factors keep
/// only the lower triangle either way. (k+1)/(2k) of the full product's multiplications with k
/// panels (62.5% at d = 512, 56% at d = 1024; 37-41% less time on one thread, issue 28).
/// Below two panels, one product (its triangles as that GEMM rounds them).
at::Tensor symmetric_gram(const at::Tensor& x) {
  const int64_t d = x.size(0);
  if (d < 2 * kGramPanel) return at::mm(x, x.t());
  auto out = at::empty({d, d}, x.options());
  for (int64_t start = 0; start < d; start += kGramPanel) {
    const int64_t rows = d - start < 2 * kGramPanel ? d - start : kGramPanel;
    auto panel = out.narrow(0, start, rows).narrow(1, 0, start + rows);
    at::mm_out(panel, x.narrow(0, start, rows), x.narrow(0, 0, start + rows).t());
    if (start > 0) {
      out.narrow(0, 0, start).narrow(1, start, rows).copy_(panel.narrow(1, 0, start).t());
    }
    // The diagonal block's upper triangle from its lower one: a GEMM need not round (i, j) and
    // (j, i) alike (MKL on the device machine's host CPU did not), and the result is symmetric.
    auto diagonal = panel.narrow(1, start, rows);
    diagonal.copy_(at::where(lower_mask(rows, x.device()), diagonal, diagonal.t()));
    if (rows != kGramPanel) break;  // the last panel
  }
  return out;
}

}  // namespace

at::Tensor block_outer_product(const at::Tensor& block_in, int64_t dim) {
  const int64_t order = block_in.dim();
  const int64_t d = block_in.size(dim);
  const auto block = aligned_matrix_operand(block_in);
  if (order >= 2 && dim == order - 1) {
    // Last dim: [rest, d] -> Xᵀ·X without moving data.
    const auto x = block.reshape({-1, d});
    return symmetric_gram(x.t());
  }
  const auto x = aligned_matrix_operand(dim_major(block, dim));
  return symmetric_gram(x);
}

at::Tensor block_multiply_along_dim(const at::Tensor& block_in, const at::Tensor& matrix_in,
                                    int64_t dim, bool transpose) {
  const int64_t order = block_in.dim();
  const int64_t d = block_in.size(dim);
  const auto block = aligned_matrix_operand(block_in);
  const auto matrix = aligned_matrix_operand(matrix_in);
  const auto m = transpose ? matrix.t() : matrix;
  if (dim == 0) return at::mm(m, block.reshape({d, -1})).view(block.sizes());
  if (dim == order - 1) return at::mm(block.reshape({-1, d}), m.t()).view(block.sizes());
  // Middle dim of a block with three or more dims: move it first, multiply, move it back.
  const auto moved_sizes = block.movedim(dim, 0).sizes().vec();
  const auto x = aligned_matrix_operand(dim_major(block, dim));
  return at::mm(m, x).view(moved_sizes).movedim(0, dim).contiguous();
}

at::Tensor stacked_outer_product(const at::Tensor& blocks, int64_t dim) {
  const int64_t order = blocks.dim() - 1;
  TORCH_INTERNAL_ASSERT(dim >= 0 && dim < order, "dim ", dim, " out of range for order ", order);
  if (blocks.is_cuda()) return batched_outer_product(blocks, dim);
  const int64_t n = blocks.size(0);
  const int64_t d = blocks.size(dim + 1);
  auto out = at::empty({n, d, d}, blocks.options());
  for (int64_t i = 0; i < n; ++i) out[i].copy_(block_outer_product(blocks[i], dim));
  return out;
}

at::Tensor stacked_outer_product_lower(const at::Tensor& blocks, int64_t dim) {
  const int64_t order = blocks.dim() - 1;
  TORCH_INTERNAL_ASSERT(dim >= 0 && dim < order, "dim ", dim, " out of range for order ", order);
  const int64_t n = blocks.size(0);
  const int64_t d = blocks.size(dim + 1);
  if (!blocks.is_cuda() || d < kLowerOuterMinDim || !lower_outer_products.load()) {
    return stacked_outer_product(blocks, dim);
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
    out[i].copy_(block_multiply_along_dim(blocks[i], matrices[i], dim, transpose));
  }
  return out;
}

}  // namespace shampoo::detail
