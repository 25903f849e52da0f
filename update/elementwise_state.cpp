#include "update/elementwise_state.h"

#include <algorithm>

namespace shampoo::detail {
namespace {

at::Tensor zeros_for(const StackSpec& spec) {
  std::vector<int64_t> shape{spec.size()};
  shape.insert(shape.end(), spec.block_shape.begin(), spec.block_shape.end());
  return at::zeros(shape, spec.options);
}

int64_t tensor_bytes(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

}  // namespace

ElementwiseState::ElementwiseState(GraftingKind grafting, const std::vector<StackSpec>& stacks)
    : stacks_(stacks),
      filter_(stacks.size()),
      diagonal_(stacks.size()),
      momentum_(stacks.size()),
      average_(stacks.size()) {
  for (const auto& spec : stacks_) average_set_.emplace_back(spec.size(), false);
  if (!grafting_method(grafting).has_state) return;
  for (size_t s = 0; s < stacks_.size(); ++s) diagonal_[s] = zeros_for(stacks_[s]);
}

at::Tensor& ElementwiseState::lazy(std::vector<at::Tensor>& states, int64_t stack) {
  auto& state = states[stack];
  if (!state.defined()) state = zeros_for(stacks_[stack]);
  return state;
}

void ElementwiseState::bind(int64_t stack, int64_t row, bool filter, bool momentum,
                            ChainBlockTensors& c) {
  if (filter) c.filter_state = lazy(filter_, stack)[row];
  if (diagonal_[stack].defined()) c.diagonal_state = diagonal_[stack][row];
  if (momentum) c.momentum_state = lazy(momentum_, stack)[row];
}

void ElementwiseState::bind_average(int64_t stack, int64_t row, const at::Tensor& param_block,
                                    ChainBlockTensors& c) {
  auto z = lazy(average_, stack)[row];
  if (!average_set_[stack][row]) {
    z.copy_(param_block);
    average_set_[stack][row] = true;
  }
  c.average_state = z;
}

at::Tensor ElementwiseState::average(int64_t stack, int64_t row) const {
  return average_set_[stack][row] ? average_[stack][row] : at::Tensor();
}

ElementwiseState::Allocated ElementwiseState::allocated() const {
  Allocated a;
  for (size_t s = 0; s < stacks_.size(); ++s) {
    a.filter.push_back(filter_[s].defined());
    a.momentum.push_back(momentum_[s].defined());
  }
  a.average = average_set_;
  return a;
}

void ElementwiseState::release_since(const Allocated& before) {
  for (size_t s = 0; s < stacks_.size(); ++s) {
    if (!before.filter[s]) filter_[s] = at::Tensor();
    if (!before.momentum[s]) momentum_[s] = at::Tensor();
    average_set_[s] = before.average[s];
    const auto& set = average_set_[s];
    if (std::find(set.begin(), set.end(), true) == set.end()) average_[s] = at::Tensor();
  }
}

void ElementwiseState::export_member(int64_t stack, int64_t row,
                                     std::map<std::string, at::Tensor>& out) const {
  if (diagonal_[stack].defined()) out["diagonal"] = diagonal_[stack][row].clone();
  if (filter_[stack].defined()) out["filter"] = filter_[stack][row].clone();
  if (momentum_[stack].defined()) out["momentum"] = momentum_[stack][row].clone();
  if (average_set_[stack][row]) out["average"] = average_[stack][row].clone();
}

void ElementwiseState::import_member(int64_t stack, int64_t row,
                                     const std::map<std::string, at::Tensor>& in) {
  const auto& spec = stacks_[stack];
  if (diagonal_[stack].defined()) {
    diagonal_[stack][row].copy_(checked_state(in, "diagonal", spec.block_shape,
                                              diagonal_[stack].options(), spec.names[row]));
  }
  for (auto [key, states] : {std::pair{"filter", &filter_}, std::pair{"momentum", &momentum_}}) {
    if (in.count(key) == 0) continue;
    auto& t = lazy(*states, stack);
    t[row].copy_(checked_state(in, key, spec.block_shape, t.options(), spec.names[row]));
  }
  if (in.count("average") != 0) {
    auto& t = lazy(average_, stack);
    t[row].copy_(checked_state(in, "average", spec.block_shape, t.options(), spec.names[row]));
    average_set_[stack][row] = true;
  }
}

void ElementwiseState::add_memory(MemorySummary& out) const {
  const auto sum = [](const std::vector<at::Tensor>& states) {
    int64_t bytes = 0;
    for (const auto& t : states) bytes += tensor_bytes(t);
    return bytes;
  };
  out.grafting += sum(diagonal_);
  out.filtered_gradient += sum(filter_);
  out.momentum += sum(momentum_);
  out.averaging += sum(average_);
}

int64_t ElementwiseState::state_bytes() const {
  MemorySummary memory;
  add_memory(memory);
  return memory.state_total();
}

}  // namespace shampoo::detail
