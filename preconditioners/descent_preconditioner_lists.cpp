#include "preconditioners/descent_preconditioner_lists.h"

#include <c10/util/Exception.h>

#include <numeric>

#include "preconditioners/matrix_functions.h"

namespace shampoo::detail {

SpectralDescentPreconditionerList::SpectralDescentPreconditionerList(
    std::vector<StackSpec> stacks, const SpectralDescentConfig& config,
    const MatrixPreconditionerSettings& /*settings*/)
    : StatelessPreconditionerList(std::move(stacks)), config_(config) {
  for (int64_t s = 0; s < num_stacks(); ++s) {
    TORCH_INTERNAL_ASSERT(spec(s).block_shape.size() == 2,
                          "spectral descent: blocks must be 2-D, got a stack of blocks of shape ",
                          at::IntArrayRef(spec(s).block_shape));
  }
}

void SpectralDescentPreconditionerList::precondition(int64_t stack, const Rows& rows,
                                                     const at::Tensor& filtered,
                                                     const RowScalars& /*scalars*/,
                                                     at::Tensor& out) const {
  if (rows.size() == 0) return;
  if (config_.method == OrthogonalizationMethod::kSVD) {
    // The SVD fails on a non-finite matrix with an error that names a batch index only: name the
    // block instead (Newton–Schulz leaves the non-finite values in that block's direction).
    const auto finite = stacked_all_finite(filtered);
    for (int64_t i = 0; i < rows.size(); ++i) {
      TORCH_CHECK(finite[i], "spectral descent (SVD): ", spec(stack).names[rows.rows[i]],
                  " has non-finite values (NaN or inf); its direction is undefined");
    }
  }
  out.copy_(stacked_orthogonalize(filtered, config_));
}

void SignDescentPreconditionerList::precondition(int64_t /*stack*/, const Rows& rows,
                                                 const at::Tensor& filtered,
                                                 const RowScalars& /*scalars*/,
                                                 at::Tensor& out) const {
  if (rows.size() == 0) return;
  if (scale_ == SignDescentScale::kOne) {
    at::sign_out(out, filtered);
    return;
  }
  // Σ|Ḡ| per block, before `out` (which may be `filtered`) is written.
  std::vector<int64_t> block_dims(filtered.dim() - 1);
  std::iota(block_dims.begin(), block_dims.end(), 1);
  const auto l1 = filtered.abs().sum(block_dims, /*keepdim=*/true);
  at::sign_out(out, filtered);
  out.mul_(l1);
}

}  // namespace shampoo::detail
