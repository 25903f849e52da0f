#include "grafting/diagonal_preconditioner_list.h"

#include <c10/util/Exception.h>

#include <cmath>

#include "preconditioners/kronecker_factors.h"

namespace shampoo::detail {

DiagonalCoefficients diagonal_coefficients(DiagonalMethod method, const DiagonalHyperparams& h,
                                           int64_t step) {
  DiagonalCoefficients c;
  c.epsilon = h.epsilon;
  switch (method) {
    case DiagonalMethod::kAdaGrad:
      break;  // V += G²
    case DiagonalMethod::kRMSprop:
      c.beta2 = h.beta2;
      c.weight = 1.0 - h.beta2;
      break;
    case DiagonalMethod::kAdam:
      c.beta2 = h.beta2;
      c.weight = 1.0 - h.beta2;
      c.bias_correction2 = 1.0 - std::pow(h.beta2, static_cast<double>(step));
      break;
    case DiagonalMethod::kNone:
    case DiagonalMethod::kSGD:
      c.epsilon = 0.0;
      break;
  }
  return c;
}

void fill_chain_scalars(DiagonalMethod method, const DiagonalHyperparams& h, int64_t step,
                        kernels::ChainScalars& s) {
  const auto c = diagonal_coefficients(method, h, step);
  s.diagonal_kind = static_cast<int32_t>(method);
  s.diagonal_beta2 = c.beta2;
  s.diagonal_weight = c.weight;
  s.diagonal_bias_correction = c.bias_correction2;
  s.diagonal_epsilon = c.epsilon;
}

DiagonalPreconditionerList::DiagonalPreconditionerList(DiagonalMethod method,
                                                       std::vector<StackSpec> stacks)
    : method_(method), stacks_(std::move(stacks)) {
  state_.resize(stacks_.size());
  if (!has_state()) return;
  for (size_t s = 0; s < stacks_.size(); ++s) {
    std::vector<int64_t> shape{stacks_[s].size()};
    shape.insert(shape.end(), stacks_[s].block_shape.begin(), stacks_[s].block_shape.end());
    state_[s] = at::zeros(shape, stacks_[s].options);
  }
}

bool DiagonalPreconditionerList::has_state() const {
  return method_ == DiagonalMethod::kAdaGrad || method_ == DiagonalMethod::kRMSprop ||
         method_ == DiagonalMethod::kAdam;
}

void DiagonalPreconditionerList::update(int64_t stack, const Rows& rows,
                                        const at::Tensor& gradients, const RowScalars& scalars,
                                        const std::vector<bool>& /*amortize: nothing amortized*/) {
  if (!has_state() || rows.size() == 0) return;
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(row_hyperparams_.size()) == rows.size());
  std::vector<double> beta2(rows.size()), weight(rows.size());
  for (int64_t i = 0; i < rows.size(); ++i) {
    const auto c = diagonal_coefficients(method_, row_hyperparams_[i], scalars.step[i]);
    beta2[i] = c.beta2;
    weight[i] = c.weight;
  }
  const auto dims = gradients.dim();
  auto v = gather_rows(state_[stack], rows);
  v = v * row_scalars(beta2, v.options(), dims) +
      row_scalars(weight, v.options(), dims) * gradients * gradients;
  scatter_rows(state_[stack], rows, v);
}

void DiagonalPreconditionerList::precondition(int64_t stack, const Rows& rows,
                                              const at::Tensor& filtered, const RowScalars& scalars,
                                              at::Tensor& out) const {
  if (!has_state()) {
    if (!out.is_same(filtered)) out.copy_(filtered);
    return;
  }
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(row_hyperparams_.size()) == rows.size());
  std::vector<double> bc2(rows.size()), eps(rows.size());
  for (int64_t i = 0; i < rows.size(); ++i) {
    const auto c = diagonal_coefficients(method_, row_hyperparams_[i], scalars.step[i]);
    bc2[i] = c.bias_correction2;
    eps[i] = c.epsilon;
  }
  const auto dims = filtered.dim();
  const auto v = gather_rows(state_[stack], rows);
  out.copy_(filtered / ((v / row_scalars(bc2, v.options(), dims)).sqrt() +
                        row_scalars(eps, v.options(), dims)));
}

std::map<std::string, at::Tensor> DiagonalPreconditionerList::export_member(int64_t stack,
                                                                            int64_t row) const {
  std::map<std::string, at::Tensor> out;
  if (has_state()) out["diagonal"] = state_[stack][row].clone();
  return out;
}

void DiagonalPreconditionerList::import_member(int64_t stack, int64_t row,
                                               const std::map<std::string, at::Tensor>& in) {
  if (!has_state()) return;
  state_[stack][row].copy_(checked_state(in, "diagonal", stacks_[stack].block_shape,
                                         state_[stack].options(), stacks_[stack].names[row]));
}

int64_t DiagonalPreconditionerList::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& v : state_) {
    if (v.defined()) bytes += v.numel() * static_cast<int64_t>(v.element_size());
  }
  return bytes;
}

}  // namespace shampoo::detail
