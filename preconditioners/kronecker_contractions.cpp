#include "preconditioners/kronecker_contractions.h"

#include <c10/util/Exception.h>

namespace shampoo::detail {
namespace {

/// View of the stack as [n, d_dim, rest] with block dim `dim` second (a copy only for a middle
/// dim of a block with three or more dims).
at::Tensor as_dim_major(const at::Tensor& blocks, int64_t dim) {
  const int64_t n = blocks.size(0);
  const int64_t d = blocks.size(dim + 1);
  return blocks.movedim(dim + 1, 1).reshape({n, d, -1});
}

}  // namespace

at::Tensor stacked_outer_product(const at::Tensor& blocks, int64_t dim) {
  const int64_t order = blocks.dim() - 1;
  TORCH_INTERNAL_ASSERT(dim >= 0 && dim < order, "dim ", dim, " out of range for order ", order);
  const int64_t n = blocks.size(0);
  if (order >= 2 && dim == order - 1) {
    // Last dim: [n, rest, d] -> Xᵀ·X without moving data.
    const auto x = blocks.reshape({n, -1, blocks.size(-1)});
    return at::bmm(x.transpose(1, 2), x);
  }
  const auto x = as_dim_major(blocks, dim);
  return at::bmm(x, x.transpose(1, 2));
}

at::Tensor stacked_multiply_along_dim(const at::Tensor& blocks, const at::Tensor& matrices,
                                      int64_t dim, bool transpose) {
  const int64_t order = blocks.dim() - 1;
  TORCH_INTERNAL_ASSERT(dim >= 0 && dim < order, "dim ", dim, " out of range for order ", order);
  const int64_t n = blocks.size(0);
  const auto m = transpose ? matrices.transpose(1, 2) : matrices;
  if (dim == 0) {
    // [n, d0, rest]: M·B.
    const auto x = blocks.reshape({n, blocks.size(1), -1});
    return at::bmm(m, x).view(blocks.sizes());
  }
  if (dim == order - 1) {
    // [n, rest, d]: B·Mᵀ.
    const auto x = blocks.reshape({n, -1, blocks.size(-1)});
    return at::bmm(x, m.transpose(1, 2)).view(blocks.sizes());
  }
  // Middle dim of a block with three or more dims: move it first, multiply, move it back.
  auto moved_sizes = blocks.movedim(dim + 1, 1).sizes().vec();
  const auto x = as_dim_major(blocks, dim);
  return at::bmm(m, x).view(moved_sizes).movedim(1, dim + 1).contiguous();
}

}  // namespace shampoo::detail
