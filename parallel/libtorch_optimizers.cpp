#include "parallel/libtorch_optimizers.h"

#include <c10/util/Exception.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <sstream>
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

void step_only(torch::optim::Optimizer& optimizer, const std::vector<at::Tensor>& ready) {
  std::unordered_set<const void*> stepping;
  for (const auto& p : ready) stepping.insert(p.unsafeGetTensorImpl());
  std::vector<std::pair<at::Tensor, at::Tensor>> hidden;
  for (auto& group : optimizer.param_groups()) {
    for (auto& q : group.params()) {
      if (stepping.count(q.unsafeGetTensorImpl()) == 0 && q.grad().defined()) {
        hidden.emplace_back(q, q.grad());
        q.mutable_grad().reset();
      }
    }
  }
  try {
    optimizer.step();
  } catch (...) {
    for (auto& [q, g] : hidden) q.mutable_grad() = g;
    throw;
  }
  for (auto& [q, g] : hidden) q.mutable_grad() = g;
}

std::unique_ptr<torch::optim::OptimizerParamState> copy_param_state(
    const torch::optim::Optimizer& optimizer, const torch::optim::OptimizerParamState& state) {
  // Through the bytes of an archive: the only way to reach every tensor of a state whose type
  // is known by name only.
  torch::serialize::OutputArchive out;
  state.serialize(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  std::istringstream in_bytes(bytes.str());
  torch::serialize::InputArchive in;
  in.load_from(in_bytes);
  auto copy = make_param_state(optimizer);
  copy->serialize(in);
  return copy;
}

}  // namespace shampoo::detail
