#include "preconditioners/shampoo_preconditioner_list.h"

#include <algorithm>

#include "preconditioners/kronecker_contractions.h"
#include "preconditioners/matrix_functions.h"

namespace shampoo::detail {

ShampooPreconditionerList::ShampooPreconditionerList(std::vector<StackSpec> stacks,
                                                     const RootInvShampooConfig& config,
                                                     MatrixPreconditionerSettings settings)
    : KroneckerFactorList(std::move(stacks), std::move(settings)), config_(config) {
  // Inverse roots start as the identity (docs/math.md).
  roots_ = add_dim_state("root_", /*matrix=*/true, Start::kIdentity);
}

at::Tensor ShampooPreconditionerList::kl_operand(int64_t stack, const Rows& rows, int64_t dim,
                                                 const RowScalars& /*scalars*/) const {
  return gather_rows(dim_state(roots_, stack, dim), rows);
}

void ShampooPreconditionerList::amortize(int64_t stack, const Rows& rows,
                                         const RowScalars& scalars) {
  // In chunks of at most kRootChunkBytes per factor: the bias-corrected copies and the solvers'
  // working sets are then bounded by the chunk, not by the stack (a stack of 28 1024×1024
  // factors would otherwise hold several 112 MB copies at once). Every matrix is computed on its
  // own, so the chunking does not change a result.
  const auto& spec = factors_.spec(stack);
  int64_t largest = 1;
  for (const int64_t k : factors_.preconditioned_dims(stack)) {
    largest = std::max(largest, spec.block_shape[k] * spec.block_shape[k]);
  }
  const int64_t element = static_cast<int64_t>(c10::elementSize(factors_.settings().factor_dtype));
  const int64_t per_chunk = std::max<int64_t>(1, kRootChunkBytes / (largest * element));
  for (int64_t start = 0; start < rows.size(); start += per_chunk) {
    std::vector<bool> selected(rows.size(), false);
    std::fill(selected.begin() + start, selected.begin() + std::min(rows.size(), start + per_chunk),
              true);
    const auto [chunk, chunk_scalars] = select_rows(rows, scalars, selected);
    amortize_rows(stack, chunk, chunk_scalars);
  }
}

KroneckerFactorList::DimResult ShampooPreconditionerList::compute_dim(int64_t stack,
                                                                      const Rows& rows, int64_t k,
                                                                      const RowScalars& scalars) {
  const auto& spec = factors_.spec(stack);
  const auto corrected = factors_.corrected_factors(stack, rows, k, scalars);
  const std::vector<double> exponents(rows.size(), spec.dim_exponents[k]);
  const auto* pseudo_inverse = std::get_if<PseudoInverseConfig>(&config_.rank_deficient_stability);
  auto result = stacked_inverse_root(
      corrected, scalars.epsilon, exponents, config_.retry_double_precision,
      config_.solver == RootSolver::kEigh ? nullptr : &config_, pseudo_inverse);
  factors_.record_double_retries(result.retried_in_double);
  factors_.record_solver_fallbacks(result.solver_fallbacks);
  // A non-finite root (e.g. ε^(−e) overflowing the factor dtype for a large exponent) counts as
  // a failed computation, as a failed decomposition does: the previous root is kept and the
  // failure policy decides.
  const auto finite = stacked_all_finite(result.values);
  for (int64_t i = 0; i < rows.size(); ++i) {
    if (!finite[i]) result.failed[i] = true;
  }
  return {{result.values}, std::move(result.failed)};
}

void ShampooPreconditionerList::precondition(int64_t stack, const Rows& rows,
                                             const at::Tensor& filtered,
                                             const RowScalars& /*scalars*/, at::Tensor& out) const {
  const auto dtype = filtered.scalar_type();
  const auto& dims = factors_.preconditioned_dims(stack);
  if (rows.size() == 0) return;
  if (filtered.is_cuda()) {
    // Batched, in chunks of at most kRootChunkBytes of blocks: each dim's product is a new
    // tensor, so a whole stack at once would hold two stack-sized temporaries.
    const int64_t block_bytes = filtered[0].numel() * static_cast<int64_t>(filtered.element_size());
    const int64_t per_chunk =
        std::max<int64_t>(1, kRootChunkBytes / std::max<int64_t>(1, block_bytes));
    for (int64_t start = 0; start < rows.size(); start += per_chunk) {
      const int64_t count = std::min(per_chunk, rows.size() - start);
      Rows part;
      part.rows.assign(rows.rows.begin() + start, rows.rows.begin() + start + count);
      part.all = rows.all && count == rows.size();
      auto result = filtered.narrow(0, start, count);
      for (const int64_t k : dims) {
        const auto& all_roots = dim_state(roots_, stack, k);
        const auto roots = part.all   ? all_roots
                           : rows.all ? all_roots.narrow(0, start, count)
                                      : gather_rows(all_roots, part);
        result = stacked_multiply_along_dim(result, roots.to(dtype), k);
      }
      auto target = out.narrow(0, start, count);
      if (!result.is_same(target)) target.copy_(result);
    }
    return;
  }
  // One block at a time: the temporaries are block-sized, never a whole stack.
  for (int64_t i = 0; i < rows.size(); ++i) {
    auto block = filtered[i];
    for (const int64_t k : dims) {
      block =
          block_multiply_along_dim(block, dim_state(roots_, stack, k)[rows.rows[i]].to(dtype), k);
    }
    if (!block.is_same(out[i])) out[i].copy_(block);
  }
}

}  // namespace shampoo::detail
