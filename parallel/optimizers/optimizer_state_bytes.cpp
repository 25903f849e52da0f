#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "parallel/optimizers/optimizer_factory.h"

namespace shampoo {
namespace {

int64_t bytes(const at::Tensor& t) { return t.defined() ? static_cast<int64_t>(t.nbytes()) : 0; }

}  // namespace

int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer) {
  const bool known = dynamic_cast<const torch::optim::SGD*>(&optimizer) != nullptr ||
                     dynamic_cast<const torch::optim::Adam*>(&optimizer) != nullptr ||
                     dynamic_cast<const torch::optim::AdamW*>(&optimizer) != nullptr ||
                     dynamic_cast<const torch::optim::Adagrad*>(&optimizer) != nullptr ||
                     dynamic_cast<const torch::optim::RMSprop*>(&optimizer) != nullptr;
  if (!known) return -1;
  int64_t total = 0;
  for (const auto& [key, state] : optimizer.state()) {
    if (const auto* s = dynamic_cast<const torch::optim::AdamParamState*>(state.get())) {
      total += bytes(s->exp_avg()) + bytes(s->exp_avg_sq()) + bytes(s->max_exp_avg_sq());
    } else if (const auto* s = dynamic_cast<const torch::optim::AdamWParamState*>(state.get())) {
      total += bytes(s->exp_avg()) + bytes(s->exp_avg_sq()) + bytes(s->max_exp_avg_sq());
    } else if (const auto* s = dynamic_cast<const torch::optim::SGDParamState*>(state.get())) {
      total += bytes(s->momentum_buffer());
    } else if (const auto* s = dynamic_cast<const torch::optim::AdagradParamState*>(state.get())) {
      total += bytes(s->sum());
    } else if (const auto* s = dynamic_cast<const torch::optim::RMSpropParamState*>(state.get())) {
      total += bytes(s->square_avg()) + bytes(s->momentum_buffer()) + bytes(s->grad_avg());
    }
  }
  return total;
}

}  // namespace shampoo
