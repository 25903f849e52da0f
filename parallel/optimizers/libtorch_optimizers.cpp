#include "parallel/optimizers/libtorch_optimizers.h"

#include <c10/util/Exception.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <sstream>
#include <type_traits>
#include <unordered_set>
#include <utility>

namespace shampoo::detail {
namespace {

template <class Optimizer>
bool is(const torch::optim::Optimizer& optimizer) {
  return dynamic_cast<const Optimizer*>(&optimizer) != nullptr;
}

}  // namespace

std::string libtorch_optimizer_name(const torch::optim::Optimizer& optimizer) {
  // AdamW is not an Adam in LibTorch (both derive from Optimizer), so the order is free.
  if (is<torch::optim::Adam>(optimizer)) return "Adam";
  if (is<torch::optim::AdamW>(optimizer)) return "AdamW";
  if (is<torch::optim::SGD>(optimizer)) return "SGD";
  if (is<torch::optim::Adagrad>(optimizer)) return "Adagrad";
  if (is<torch::optim::RMSprop>(optimizer)) return "RMSprop";
  return "";
}

std::unique_ptr<torch::optim::OptimizerParamState> make_param_state(
    const torch::optim::Optimizer& optimizer) {
  if (is<torch::optim::Adam>(optimizer)) return std::make_unique<torch::optim::AdamParamState>();
  if (is<torch::optim::AdamW>(optimizer)) return std::make_unique<torch::optim::AdamWParamState>();
  if (is<torch::optim::SGD>(optimizer)) return std::make_unique<torch::optim::SGDParamState>();
  if (is<torch::optim::Adagrad>(optimizer)) {
    return std::make_unique<torch::optim::AdagradParamState>();
  }
  if (is<torch::optim::RMSprop>(optimizer)) {
    return std::make_unique<torch::optim::RMSpropParamState>();
  }
  TORCH_CHECK(false, "make_param_state: not one of LibTorch's SGD, Adam, AdamW, Adagrad, RMSprop");
}

torch::serialize::OutputArchive param_state_piece(const torch::optim::Optimizer& optimizer,
                                                  const at::Tensor& param) {
  torch::serialize::OutputArchive piece;
  const auto it = optimizer.state().find(param.unsafeGetTensorImpl());
  piece.write("has_state", c10::IValue(it != optimizer.state().end()));
  if (it != optimizer.state().end()) it->second->serialize(piece);
  return piece;
}

std::unique_ptr<torch::optim::OptimizerParamState> read_param_state_piece(
    const torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& piece,
    const std::string& what) {
  c10::IValue has_state;
  TORCH_CHECK(piece.try_read("has_state", has_state) && has_state.isBool(), what, " is damaged");
  if (!has_state.toBool()) return nullptr;
  auto state = make_param_state(optimizer);
  state->serialize(piece);
  return state;
}

void step_hiding_others(torch::optim::Optimizer& optimizer, const std::vector<at::Tensor>& ready) {
  std::unordered_set<const void*> stepping;
  for (const auto& p : ready) stepping.insert(p.unsafeGetTensorImpl());
  // The param groups hold `ready` only during the step: the optimizer never reads the other
  // parameters, whose gradients another thread may be writing (full sharding's worker steps a
  // unit while backward goes on with the others).
  std::vector<std::vector<at::Tensor>> all;
  for (auto& group : optimizer.param_groups()) {
    all.push_back(std::move(group.params()));
    group.params().clear();
    for (const auto& q : all.back()) {
      if (stepping.count(q.unsafeGetTensorImpl()) != 0) group.params().push_back(q);
    }
  }
  const auto put_back = [&] {
    auto& groups = optimizer.param_groups();
    for (size_t g = 0; g < all.size(); ++g) groups[g].params() = std::move(all[g]);
  };
  try {
    optimizer.step();
  } catch (...) {
    put_back();
    throw;
  }
  put_back();
}

namespace {

/// A defined tensor's copy (an undefined one stays undefined).
at::Tensor copy_of(const at::Tensor& t) { return t.defined() ? t.clone() : t; }

/// `state` as a `State` whose tensors are copies, or null when it is not one.
template <class State>
std::unique_ptr<torch::optim::OptimizerParamState> copy_as(
    const torch::optim::OptimizerParamState& state) {
  const auto* typed = dynamic_cast<const State*>(&state);
  if (typed == nullptr) return nullptr;
  auto copy = std::make_unique<State>(*typed);  // the scalars; tensors still shared
  if constexpr (std::is_same_v<State, torch::optim::AdamParamState> ||
                std::is_same_v<State, torch::optim::AdamWParamState>) {
    copy->exp_avg(copy_of(typed->exp_avg()))
        .exp_avg_sq(copy_of(typed->exp_avg_sq()))
        .max_exp_avg_sq(copy_of(typed->max_exp_avg_sq()));
  } else if constexpr (std::is_same_v<State, torch::optim::SGDParamState>) {
    copy->momentum_buffer(copy_of(typed->momentum_buffer()));
  } else if constexpr (std::is_same_v<State, torch::optim::AdagradParamState>) {
    copy->sum(copy_of(typed->sum()));
  } else {
    copy->square_avg(copy_of(typed->square_avg()))
        .momentum_buffer(copy_of(typed->momentum_buffer()))
        .grad_avg(copy_of(typed->grad_avg()));
  }
  return copy;
}

}  // namespace

std::unique_ptr<torch::optim::OptimizerParamState> copy_param_state(
    const torch::optim::Optimizer& optimizer, const torch::optim::OptimizerParamState& state) {
  // Field by field for the five known types (their tensors cloned; the state's own clone()
  // shares them).
  if (auto copy = copy_as<torch::optim::AdamParamState>(state)) return copy;
  if (auto copy = copy_as<torch::optim::AdamWParamState>(state)) return copy;
  if (auto copy = copy_as<torch::optim::SGDParamState>(state)) return copy;
  if (auto copy = copy_as<torch::optim::AdagradParamState>(state)) return copy;
  if (auto copy = copy_as<torch::optim::RMSpropParamState>(state)) return copy;
  TORCH_CHECK(false, "copy_param_state: a state of an optimizer of type ",
              libtorch_optimizer_name(optimizer).empty() ? "(not one of LibTorch's)"
                                                         : libtorch_optimizer_name(optimizer),
              " that is not one of LibTorch's SGD, Adam, AdamW, Adagrad or RMSprop states");
}

}  // namespace shampoo::detail
