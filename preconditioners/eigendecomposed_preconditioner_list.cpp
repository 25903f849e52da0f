#include "preconditioners/eigendecomposed_preconditioner_list.h"

#include "preconditioners/kronecker_contractions.h"
#include "preconditioners/matrix_functions.h"

namespace shampoo::detail {

EigendecomposedPreconditionerList::EigendecomposedPreconditionerList(
    std::vector<StackSpec> stacks, MatrixPreconditionerSettings settings,
    EigendecompositionUpdate method)
    : factors_(std::move(stacks), std::move(settings)), method_(method) {
  eigenvalues_.resize(factors_.num_stacks());
  eigenvectors_.resize(factors_.num_stacks());
  for (int64_t s = 0; s < factors_.num_stacks(); ++s) {
    const auto& spec = factors_.spec(s);
    eigenvalues_[s].resize(spec.block_shape.size());
    eigenvectors_[s].resize(spec.block_shape.size());
    const auto options = spec.options.dtype(factors_.settings().factor_dtype);
    for (const int64_t k : factors_.preconditioned_dims(s)) {
      const int64_t d = spec.block_shape[k];
      // As the reference: eigenvalues 1, eigenvectors I (docs/math.md).
      eigenvalues_[s][k] = at::ones({spec.size(), d}, options);
      eigenvectors_[s][k] = at::eye(d, options).expand({spec.size(), d, d}).contiguous();
    }
  }
}

void EigendecomposedPreconditionerList::update(int64_t stack, const Rows& rows,
                                               const at::Tensor& gradients,
                                               const RowScalars& scalars,
                                               const std::vector<bool>& amortize) {
  if (factors_.settings().statistics == FactorStatistics::kKL) {
    // KL-Shampoo: the other dims' roots X_j, formed from the decompositions kept before this
    // step with the step's ε, as precondition() forms them.
    std::vector<at::Tensor> roots(factors_.spec(stack).block_shape.size());
    for (const int64_t k : factors_.preconditioned_dims(stack)) {
      roots[k] = inverse_roots(stack, rows, k, scalars);
    }
    factors_.update(stack, rows, gradients, scalars, &roots);
  } else {
    factors_.update(stack, rows, gradients, scalars);
  }
  const auto [due, due_scalars] = select_rows(rows, scalars, amortize);
  compute_decompositions(stack, due, due_scalars);
}

StackedEigendecomposition EigendecomposedPreconditionerList::decompose_dim(
    int64_t stack, const Rows& rows, int64_t dim, const RowScalars& scalars) const {
  auto corrected = factors_.corrected_factors(stack, rows, dim, scalars);
  // ε enters before the decomposition (the reference's perturb_before_computation, its default),
  // for eigh and QR alike; with the pseudo-inverse ε is 0.
  const auto eps = row_scalars(scalars.epsilon, corrected.options(), 3);
  corrected.add_(at::eye(corrected.size(1), corrected.options()) * eps);
  if (method_ == EigendecompositionUpdate::kQR) {
    return stacked_eigendecomposition_qr(corrected, gather_rows(eigenvectors_[stack][dim], rows));
  }
  return stacked_eigendecomposition(corrected, factors_.settings().retry_double_precision);
}

void EigendecomposedPreconditionerList::compute_decompositions(int64_t stack, const Rows& rows,
                                                               const RowScalars& scalars) {
  if (rows.size() == 0) return;
  std::vector<bool> member_failed(rows.size(), false);
  for (const int64_t k : factors_.preconditioned_dims(stack)) {
    const auto result = decompose_dim(stack, rows, k, scalars);
    factors_.record_double_retries(result.retried_in_double);
    for (int64_t i = 0; i < rows.size(); ++i) {
      const int64_t row = rows.rows[i];
      if (result.failed[i] || factors_.injected_failure(stack, row, k)) {
        member_failed[i] = true;
        continue;  // keep the previous decomposition
      }
      eigenvalues_[stack][k][row].copy_(result.eigenvalues[i]);
      eigenvectors_[stack][k][row].copy_(result.eigenvectors[i]);
    }
  }
  for (int64_t i = 0; i < rows.size(); ++i) {
    factors_.record_outcome(stack, rows.rows[i], member_failed[i], scalars.step[i]);
  }
}

at::Tensor EigendecomposedPreconditionerList::inverse_roots(int64_t stack, const Rows& rows,
                                                            int64_t dim,
                                                            const RowScalars& scalars) const {
  const auto& spec = factors_.spec(stack);
  const std::vector<double> exponents(rows.size(), spec.dim_exponents[dim]);
  const auto& pseudo_inverse = factors_.settings().pseudo_inverse;
  return stacked_inverse_root_from_eigendecomposition(
      gather_rows(eigenvalues_[stack][dim], rows), gather_rows(eigenvectors_[stack][dim], rows),
      scalars.epsilon, exponents, pseudo_inverse ? &*pseudo_inverse : nullptr);
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

std::map<std::string, at::Tensor> EigendecomposedPreconditionerList::export_member(
    int64_t stack, int64_t row) const {
  std::map<std::string, at::Tensor> out;
  factors_.export_member(stack, row, out);
  for (const int64_t k : factors_.preconditioned_dims(stack)) {
    out["eigenvalues_" + std::to_string(k)] = eigenvalues_[stack][k][row].clone();
    out["eigenvectors_" + std::to_string(k)] = eigenvectors_[stack][k][row].clone();
  }
  return out;
}

void EigendecomposedPreconditionerList::import_member(
    int64_t stack, int64_t row, const std::map<std::string, at::Tensor>& state) {
  factors_.import_member(stack, row, state);
  const auto& spec = factors_.spec(stack);
  for (const int64_t k : factors_.preconditioned_dims(stack)) {
    const int64_t d = spec.block_shape[k];
    const auto suffix = std::to_string(k);
    eigenvalues_[stack][k][row].copy_(checked_state(
        state, "eigenvalues_" + suffix, {d}, eigenvalues_[stack][k].options(), spec.names[row]));
    eigenvectors_[stack][k][row].copy_(checked_state(state, "eigenvectors_" + suffix, {d, d},
                                                     eigenvectors_[stack][k].options(),
                                                     spec.names[row]));
  }
}

int64_t EigendecomposedPreconditionerList::state_bytes() const {
  int64_t bytes = factors_.state_bytes();
  for (size_t s = 0; s < eigenvectors_.size(); ++s) {
    for (size_t k = 0; k < eigenvectors_[s].size(); ++k) {
      for (const auto* t : {&eigenvalues_[s][k], &eigenvectors_[s][k]}) {
        if (t->defined()) bytes += t->numel() * static_cast<int64_t>(t->element_size());
      }
    }
  }
  return bytes;
}

}  // namespace shampoo::detail
