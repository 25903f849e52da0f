#include "preconditioners/eigendecomposed_preconditioner_list.h"

#include "preconditioners/kronecker_contractions.h"
#include "preconditioners/matrix_functions.h"

namespace shampoo::detail {

EigendecomposedPreconditionerList::EigendecomposedPreconditionerList(
    std::vector<StackSpec> stacks, const EigendecomposedShampooConfig& config,
    MatrixPreconditionerSettings settings)
    : KroneckerFactorList(std::move(stacks), std::move(settings)), config_(config) {
  // As the reference: eigenvalues 1, eigenvectors I (docs/math.md).
  eigenvalues_ = add_dim_state("eigenvalues_", DimState::kVector, Start::kOnes,
                               &MemorySummary::eigenvectors);
  eigenvectors_ = add_dim_state("eigenvectors_", DimState::kMatrix, Start::kIdentity,
                                &MemorySummary::eigenvectors);
}

KroneckerFactorList::DimResult EigendecomposedPreconditionerList::compute_dim(
    int64_t stack, const Rows& rows, int64_t dim, const RowScalars& scalars) {
  auto corrected = factors_.corrected_factors(stack, rows, dim, scalars);
  // ε enters before the decomposition (the reference's perturb_before_computation, its default),
  // for eigh and QR alike; with the pseudo-inverse ε is 0.
  const auto eps = row_scalars(scalars.epsilon, corrected.options(), 3);
  corrected.add_(at::eye(corrected.size(1), corrected.options()) * eps);
  auto result = config_.eigenbasis_method == EigenbasisMethod::kQR
                    ? stacked_eigendecomposition_qr(
                          corrected, gather_rows(dim_state(eigenvectors_, stack, dim), rows))
                    : stacked_eigendecomposition(corrected, config_.retry_double_precision);
  factors_.record_double_retries(result.retried_in_double);
  return {{result.eigenvalues, result.eigenvectors}, std::move(result.failed)};
}

at::Tensor EigendecomposedPreconditionerList::inverse_roots(int64_t stack, const Rows& rows,
                                                            int64_t dim,
                                                            const RowScalars& scalars) const {
  const auto& spec = factors_.spec(stack);
  const std::vector<double> exponents(rows.size(), spec.dim_exponents[dim]);
  return stacked_inverse_root_from_eigendecomposition(
      gather_rows(eigenvalues(stack, dim), rows), gather_rows(eigenvectors(stack, dim), rows),
      scalars.epsilon, exponents,
      std::get_if<PseudoInverseConfig>(&config_.rank_deficient_stability));
}

void EigendecomposedPreconditionerList::precondition(int64_t stack, const Rows& rows,
                                                     const at::Tensor& filtered,
                                                     const RowScalars& scalars,
                                                     at::Tensor& out) const {
  if (rows.size() == 0) return;
  auto result = filtered;
  for (const int64_t k : factors_.preconditioned_dims(stack)) {
    const auto roots = inverse_roots(stack, rows, k, scalars);
    result = stacked_multiply_along_dim(result, roots.to(filtered.scalar_type()), k);
  }
  if (!result.is_same(out)) out.copy_(result);
}

}  // namespace shampoo::detail
