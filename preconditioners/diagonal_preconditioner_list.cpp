#include "preconditioners/diagonal_preconditioner_list.h"

namespace shampoo::detail {

DiagonalPreconditionerList::DiagonalPreconditionerList(
    std::vector<StackSpec> stacks, const DiagonalConfig& config,
    const MatrixPreconditionerSettings& /*settings*/)
    : stacks_(std::move(stacks)), config_(config), coefficients_(diagonal_coefficients(config, 1)) {
  second_moments_.resize(stacks_.size());
  if (!coefficients_.has_state) return;
  for (size_t s = 0; s < stacks_.size(); ++s) {
    std::vector<int64_t> shape{stacks_[s].size()};
    shape.insert(shape.end(), stacks_[s].block_shape.begin(), stacks_[s].block_shape.end());
    second_moments_[s] = at::zeros(shape, stacks_[s].options);
  }
}

ElementwiseDirection DiagonalPreconditionerList::elementwise_direction(int64_t stack, int64_t row,
                                                                       int64_t step) {
  ElementwiseDirection out;
  out.kind = ElementwiseDirection::Kind::kDiagonal;
  out.coefficients = diagonal_coefficients(config_, step);
  if (coefficients_.has_state) out.state = second_moments_[stack][row];
  return out;
}

void DiagonalPreconditionerList::update(int64_t stack, const Rows& rows,
                                        const at::Tensor& gradients, const RowScalars& /*scalars*/,
                                        const std::vector<bool>& /*amortize*/) {
  if (!coefficients_.has_state || rows.size() == 0) return;
  auto v = gather_rows(second_moments_[stack], rows);
  // The reference's order: scale by β2 (skipped when 1), then add w·G′².
  if (coefficients_.beta2 != 1.0) v.mul_(coefficients_.beta2);
  v.addcmul_(gradients, gradients, coefficients_.weight);
  scatter_rows(second_moments_[stack], rows, v);
}

void DiagonalPreconditionerList::precondition(int64_t stack, const Rows& rows,
                                              const at::Tensor& filtered, const RowScalars& scalars,
                                              at::Tensor& out) const {
  if (rows.size() == 0) return;
  if (!coefficients_.has_state) {
    if (!out.is_same(filtered)) out.copy_(filtered);
    return;
  }
  const auto v = gather_rows(second_moments_[stack], rows);
  std::vector<double> bc2;
  bool corrected = false;
  for (const int64_t t : scalars.step) {
    bc2.push_back(diagonal_coefficients(config_, t).bias_correction2);
    corrected |= bc2.back() != 1.0;
  }
  const auto denominator =
      corrected ? (v / row_scalars(bc2, v.options(), v.dim())).sqrt_() : v.sqrt();
  // ε outside the square root, as torch's Adam.
  denominator.add_(coefficients_.epsilon);
  at::div_out(out, filtered, denominator);
}

std::map<std::string, at::Tensor> DiagonalPreconditionerList::export_member(int64_t stack,
                                                                            int64_t row) const {
  if (!coefficients_.has_state) return {};
  return {{"second_moment", second_moments_[stack][row].clone()}};
}

void DiagonalPreconditionerList::import_member(int64_t stack, int64_t row,
                                               const std::map<std::string, at::Tensor>& state) {
  if (!coefficients_.has_state) return;
  const auto& spec = stacks_[stack];
  second_moments_[stack][row].copy_(checked_state(
      state, "second_moment", spec.block_shape, second_moments_[stack].options(), spec.names[row]));
}

void DiagonalPreconditionerList::add_memory(MemorySummary& out) const {
  for (const auto& v : second_moments_) {
    if (v.defined()) out.preconditioner_other += v.numel() * static_cast<int64_t>(v.element_size());
  }
}

}  // namespace shampoo::detail
