#include "preconditioners/eigenvalue_corrected_preconditioner_list.h"

#include "preconditioners/kronecker_contractions.h"
#include "preconditioners/matrix_functions.h"

namespace shampoo::detail {

EigenvalueCorrectedPreconditionerList::EigenvalueCorrectedPreconditionerList(
    std::vector<StackSpec> stacks, const EigenvalueCorrectedShampooConfig& config,
    MatrixPreconditionerSettings settings)
    : KroneckerFactorList(std::move(stacks), std::move(settings)), config_(config) {
  bases_ = add_dim_state("basis_", DimState::kMatrix, Start::kIdentity, &MemorySummary::eigenvectors);
  corrections_ = add_block_state("corrections", &MemorySummary::preconditioner_other);
}

at::Tensor EigenvalueCorrectedPreconditionerList::rotate(int64_t stack, const Rows& rows,
                                                         const at::Tensor& blocks,
                                                         bool back) const {
  auto out = blocks;
  for (const int64_t k : factors_.preconditioned_dims(stack)) {
    const auto q = gather_rows(basis(stack, k), rows).to(blocks.scalar_type());
    // Into the basis: coordinates Qᵀ·x along dim k; back: Q·x.
    out = stacked_multiply_along_dim(out, q, k, /*transpose=*/!back);
  }
  return out;
}

KroneckerFactorList::DimResult EigenvalueCorrectedPreconditionerList::compute_dim(
    int64_t stack, const Rows& rows, int64_t k, const RowScalars& scalars) {
  auto corrected = factors_.corrected_factors(stack, rows, k, scalars);
  StackedMatrixResult result;
  if (config_.eigenbasis_method == EigenbasisMethod::kQR) {
    result = stacked_eigenbasis_qr(corrected, gather_rows(basis(stack, k), rows));
  } else {
    // Perturbed before the decomposition, as the root-inverse path does.
    const auto eps = row_scalars(scalars.epsilon, corrected.options(), 3);
    corrected.add_(at::eye(factors_.spec(stack).block_shape[k], corrected.options()) * eps);
    result = stacked_eigenbasis(corrected, config_.retry_double_precision);
  }
  factors_.record_double_retries(result.retried_in_double);
  return {{result.values}, std::move(result.failed)};
}

// Order of the reference: factors, then bases at amortized steps (KroneckerFactorList::update),
// then the corrections of the gradient rotated into the (new) bases.
void EigenvalueCorrectedPreconditionerList::after_update(int64_t stack, const Rows& rows,
                                                         const at::Tensor& gradients,
                                                         const RowScalars& scalars) {
  const auto rotated = rotate(stack, rows, gradients, /*back=*/false);
  const auto dims = rotated.dim();
  auto& corrections = block_state(corrections_, stack);
  auto d = gather_rows(corrections, rows);
  d = d * row_scalars(scalars.beta2, d.options(), dims) +
      row_scalars(scalars.factor_weight, d.options(), dims) * rotated * rotated;
  scatter_rows(corrections, rows, d);
}

void EigenvalueCorrectedPreconditionerList::precondition(int64_t stack, const Rows& rows,
                                                         const at::Tensor& filtered,
                                                         const RowScalars& scalars,
                                                         at::Tensor& out) const {
  const auto rotated = rotate(stack, rows, filtered, /*back=*/false);
  const auto dims = rotated.dim();
  const auto d = gather_rows(corrections(stack), rows);
  // ε outside the square root, as torch's Adam.
  const auto denominator = (d / row_scalars(scalars.bias_correction2, d.options(), dims)).sqrt() +
                           row_scalars(scalars.epsilon, d.options(), dims);
  out.copy_(rotate(stack, rows, rotated / denominator, /*back=*/true));
}

}  // namespace shampoo::detail
