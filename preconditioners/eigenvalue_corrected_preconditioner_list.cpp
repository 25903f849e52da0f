#include "preconditioners/eigenvalue_corrected_preconditioner_list.h"

#include "preconditioners/kronecker_contractions.h"
#include "preconditioners/matrix_functions.h"

namespace shampoo::detail {

EigenvalueCorrectedPreconditionerList::EigenvalueCorrectedPreconditionerList(
    std::vector<StackSpec> stacks, MatrixPreconditionerSettings settings, EigenbasisUpdate method)
    : factors_(std::move(stacks), std::move(settings)), method_(method) {
  bases_.resize(factors_.num_stacks());
  corrections_.resize(factors_.num_stacks());
  for (int64_t s = 0; s < factors_.num_stacks(); ++s) {
    const auto& spec = factors_.spec(s);
    bases_[s].resize(spec.block_shape.size());
    const auto options = spec.options.dtype(factors_.settings().factor_dtype);
    for (const int64_t k : factors_.preconditioned_dims(s)) {
      const int64_t d = spec.block_shape[k];
      bases_[s][k] = at::eye(d, options).expand({spec.size(), d, d}).contiguous();
    }
    std::vector<int64_t> shape{spec.size()};
    shape.insert(shape.end(), spec.block_shape.begin(), spec.block_shape.end());
    corrections_[s] = at::zeros(shape, spec.options);
  }
}

at::Tensor EigenvalueCorrectedPreconditionerList::rotate(int64_t stack, const Rows& rows,
                                                         const at::Tensor& blocks,
                                                         bool back) const {
  auto out = blocks;
  for (const int64_t k : factors_.preconditioned_dims(stack)) {
    const auto q = gather_rows(bases_[stack][k], rows).to(blocks.scalar_type());
    // Into the basis: coordinates Qᵀ·x along dim k; back: Q·x.
    out = stacked_multiply_along_dim(out, q, k, /*transpose=*/!back);
  }
  return out;
}

void EigenvalueCorrectedPreconditionerList::compute_bases(int64_t stack, const Rows& rows,
                                                          const RowScalars& scalars) {
  if (rows.size() == 0) return;
  const auto& spec = factors_.spec(stack);
  std::vector<bool> member_failed(rows.size(), false);
  for (const int64_t k : factors_.preconditioned_dims(stack)) {
    auto corrected = factors_.corrected_factors(stack, rows, k, scalars);
    StackedMatrixResult result;
    if (method_ == EigenbasisUpdate::kQR) {
      result = stacked_eigenbasis_qr(corrected, gather_rows(bases_[stack][k], rows));
    } else {
      // Perturbed before the decomposition, as the root-inverse path does.
      const auto eps = row_scalars(scalars.epsilon, corrected.options(), 3);
      corrected.add_(at::eye(spec.block_shape[k], corrected.options()) * eps);
      result = stacked_eigenbasis(corrected, factors_.settings().retry_double_precision);
    }
    factors_.record_double_retries(result.retried_in_double);
    for (int64_t i = 0; i < rows.size(); ++i) {
      const int64_t row = rows.rows[i];
      if (result.failed[i] || factors_.injected_failure(stack, row, k)) {
        member_failed[i] = true;
        continue;
      }
      bases_[stack][k][row].copy_(result.values[i]);
    }
  }
  for (int64_t i = 0; i < rows.size(); ++i) {
    factors_.record_outcome(stack, rows.rows[i], member_failed[i], scalars.step[i]);
  }
}

void EigenvalueCorrectedPreconditionerList::update(int64_t stack, const Rows& rows,
                                                   const at::Tensor& gradients,
                                                   const RowScalars& scalars,
                                                   const std::vector<bool>& amortize) {
  if (rows.size() == 0) return;
  // Order of the reference: factors, then bases at amortized steps, then the corrections of the
  // gradient rotated into the (new) bases.
  factors_.update(stack, rows, gradients, scalars);
  const auto [due, due_scalars] = select_rows(rows, scalars, amortize);
  compute_bases(stack, due, due_scalars);
  const auto rotated = rotate(stack, rows, gradients, /*back=*/false);
  const auto dims = rotated.dim();
  auto d = gather_rows(corrections_[stack], rows);
  d = d * row_scalars(scalars.beta2, d.options(), dims) +
      row_scalars(scalars.factor_weight, d.options(), dims) * rotated * rotated;
  scatter_rows(corrections_[stack], rows, d);
}

void EigenvalueCorrectedPreconditionerList::precondition(int64_t stack, const Rows& rows,
                                                         const at::Tensor& filtered,
                                                         const RowScalars& scalars,
                                                         at::Tensor& out) const {
  const auto rotated = rotate(stack, rows, filtered, /*back=*/false);
  const auto dims = rotated.dim();
  const auto d = gather_rows(corrections_[stack], rows);
  // ε outside the square root, as torch's Adam.
  const auto denominator = (d / row_scalars(scalars.bias_correction2, d.options(), dims)).sqrt() +
                           row_scalars(scalars.epsilon, d.options(), dims);
  out.copy_(rotate(stack, rows, rotated / denominator, /*back=*/true));
}

std::map<std::string, at::Tensor> EigenvalueCorrectedPreconditionerList::export_member(
    int64_t stack, int64_t row) const {
  std::map<std::string, at::Tensor> out;
  factors_.export_member(stack, row, out);
  for (const int64_t k : factors_.preconditioned_dims(stack)) {
    out["basis_" + std::to_string(k)] = bases_[stack][k][row].clone();
  }
  out["corrections"] = corrections_[stack][row].clone();
  return out;
}

void EigenvalueCorrectedPreconditionerList::import_member(
    int64_t stack, int64_t row, const std::map<std::string, at::Tensor>& state) {
  factors_.import_member(stack, row, state);
  const auto& spec = factors_.spec(stack);
  for (const int64_t k : factors_.preconditioned_dims(stack)) {
    const int64_t d = spec.block_shape[k];
    bases_[stack][k][row].copy_(checked_state(state, "basis_" + std::to_string(k), {d, d},
                                              bases_[stack][k].options(), spec.names[row]));
  }
  corrections_[stack][row].copy_(checked_state(state, "corrections", spec.block_shape,
                                               corrections_[stack].options(), spec.names[row]));
}

int64_t EigenvalueCorrectedPreconditionerList::state_bytes() const {
  int64_t bytes = factors_.state_bytes();
  for (size_t s = 0; s < bases_.size(); ++s) {
    for (const auto& q : bases_[s]) {
      if (q.defined()) bytes += q.numel() * static_cast<int64_t>(q.element_size());
    }
    bytes += corrections_[s].numel() * static_cast<int64_t>(corrections_[s].element_size());
  }
  return bytes;
}

}  // namespace shampoo::detail
