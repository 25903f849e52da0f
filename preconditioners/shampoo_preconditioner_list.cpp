#include "preconditioners/shampoo_preconditioner_list.h"

#include <algorithm>
#include <vector>

#include "preconditioners/kronecker_contractions.h"
#include "preconditioners/matrix_functions.h"
#include "preconditioners/symmetric_matrices.h"

namespace shampoo::detail {

ShampooPreconditionerList::ShampooPreconditionerList(std::vector<StackSpec> stacks,
                                                     const RootInvShampooConfig& config,
                                                     MatrixPreconditionerSettings settings)
    : KroneckerFactorList(std::move(stacks), std::move(settings)), config_(config) {
  // Inverse roots start as the identity (docs/math.md). The step reads them cast to the blocks'
  // dtype, so they are kept in it when the factors are wider (float64 factors, float32
  // parameters); KL-Shampoo's factor update reads them in the factor dtype.
  const auto kept = factors_.settings().statistics == FactorStatistics::kKL
                        ? KeptDtype::kFactor
                        : KeptDtype::kNarrowerOfFactorAndCompute;
  roots_ = add_dim_state("root_", DimState::kSymmetric, Start::kIdentity,
                         &MemorySummary::inverse_roots, kept);
}

at::Tensor ShampooPreconditionerList::kl_operand(int64_t stack, const Rows& rows, int64_t dim,
                                                 const RowScalars& /*scalars*/) const {
  return roots(stack, dim).dense(rows);
}

KroneckerFactorList::DimResult ShampooPreconditionerList::compute_dim(int64_t stack,
                                                                      const Rows& rows, int64_t k,
                                                                      const RowScalars& scalars) {
  const auto& spec = factors_.spec(stack);
  const auto corrected = factors_.corrected_factors(stack, rows, k, scalars);
  const std::vector<double> exponents(rows.size(), spec.dim_exponents[k]);
  const auto* pseudo_inverse = std::get_if<PseudoInverseConfig>(&config_.rank_deficient_stability);
  auto result = stacked_inverse_root(
      corrected, regularization(corrected, scalars.epsilon, scalars.relative_epsilon), exponents,
      config_.retry_double_precision, config_.solver == RootSolver::kEigh ? nullptr : &config_,
      pseudo_inverse);
  factors_.record_double_retries(result.retried_in_double);
  factors_.record_solver_fallbacks(result.solver_fallbacks);
  // A non-finite root (e.g. ε^(−e) overflowing the factor dtype for a large exponent) counts as
  // a failed computation, as a failed decomposition does: the previous root is kept and the
  // failure policy decides.
  const auto finite = stacked_all_finite(result.values);
  for (int64_t i = 0; i < rows.size(); ++i) {
    if (!finite[i]) result.failed[i] = true;
  }
  // Kept symmetric (a symmetric matrix, stored packed by default): the symmetric part
  // (X + Xᵀ)/2, the nearest symmetric matrix, rather than one triangle. The solvers' results are
  // symmetric only up to their errors (an ulp for eigh's Q·diag·Qᵀ, the iteration error for the
  // Newton iterations), and averaging the triangles halves the asymmetric part of that error:
  // in training_test the Newton iterations then end within 0.2% of eigh's loss, where the lower
  // triangle alone ended 3–5% away.
  result.values = symmetric_part(result.values);
  return {{result.values}, std::move(result.failed)};
}

void ShampooPreconditionerList::precondition(int64_t stack, const Rows& rows,
                                             const at::Tensor& filtered,
                                             const RowScalars& /*scalars*/, at::Tensor& out) const {
  const auto dtype = filtered.scalar_type();
  const auto& dims = factors_.preconditioned_dims(stack);
  if (rows.size() == 0) return;
  if (filtered.is_cuda()) {
    // Batched, in chunks of at most amortize_chunk_bytes() of blocks: each dim's product is a new
    // tensor, so a whole stack at once would hold two stack-sized temporaries.
    const int64_t block_bytes = filtered[0].numel() * static_cast<int64_t>(filtered.element_size());
    const int64_t per_chunk =
        std::max<int64_t>(1, amortize_chunk_bytes() / std::max<int64_t>(1, block_bytes));
    for (int64_t start = 0; start < rows.size(); start += per_chunk) {
      const int64_t count = std::min(per_chunk, rows.size() - start);
      Rows part;
      part.rows.assign(rows.rows.begin() + start, rows.rows.begin() + start + count);
      part.all = rows.all && count == rows.size();
      auto result = filtered.narrow(0, start, count);
      for (const int64_t k : dims) {
        result = stacked_multiply_along_dim(result, roots(stack, k).dense(part).to(dtype), k);
      }
      auto target = out.narrow(0, start, count);
      if (!result.is_same(target)) target.copy_(result);
    }
    return;
  }
  // One block at a time: the temporaries are block-sized, never a whole stack, and allocated once
  // per call rather than per block: per dim a matrix the packed root is unpacked into and a block
  // for the product before the last. The last product is written straight into the block's slot
  // of `out`.
  std::vector<at::Tensor> root_scratch(dims.size()), product_scratch(dims.size());
  for (int64_t i = 0; i < rows.size(); ++i) {
    auto block = filtered[i];
    auto slot = out[i];
    if (dims.empty()) {
      if (!block.is_same(slot)) slot.copy_(block);
      continue;
    }
    for (size_t j = 0; j < dims.size(); ++j) {
      const int64_t k = dims[j];
      const auto root = roots(stack, k).dense_row(rows.rows[i], root_scratch[j]).to(dtype);
      if (j + 1 < dims.size()) {
        if (!product_scratch[j].defined())
          product_scratch[j] = at::empty(block.sizes(), block.options());
        block_multiply_along_dim_out(product_scratch[j], block, root, k);
        block = product_scratch[j];
      } else {
        block_multiply_along_dim_out(slot, block, root, k);
      }
    }
  }
}

}  // namespace shampoo::detail
