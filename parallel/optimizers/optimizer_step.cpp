#include "parallel/optimizers/optimizer_step.h"

#include "parallel/optimizers/libtorch_optimizers.h"
#include "parallel/optimizers/partial_step.h"
#include "parallel/optimizers/phased_backward_step.h"
#include "parallel/optimizers/undo_record.h"

namespace shampoo::detail {

void step_optimizer(torch::optim::Optimizer& optimizer, const Capabilities& capabilities,
                    const std::vector<at::Tensor>& params, StepScope scope, UndoRecord* undo) {
  if (params.empty()) return;
  if (auto* phased = capabilities.phased; phased != nullptr && scope == StepScope::kInPass) {
    if (!phased->backward_step_open()) {
      phased->begin_backward_step();
      if (undo != nullptr) undo->add_phased(*phased);
    }
    phased->step_parameters(params);
    return;
  }
  // LibTorch's states are copied; another optimizer's make the record incomplete.
  if (undo != nullptr) undo->save_states(optimizer, params);
  // `params` only: the optimizer's other parameters may be getting their gradients meanwhile.
  if (auto* partial = capabilities.partial) {
    partial->step_only(params);  // its own (DistributedShampoo: one step of those blocks)
  } else {
    step_hiding_others(optimizer, params);
  }
}

void end_pass_on_every_rank(const Capabilities& capabilities, bool undo) {
  auto* phased = capabilities.phased;
  if (phased == nullptr) return;
  if (!phased->backward_step_open()) phased->begin_backward_step();
  if (undo) {
    phased->abort_backward_step();
  } else {
    phased->finish_backward_step();
  }
}

void finish_open_step(const Capabilities& capabilities) {
  auto* phased = capabilities.phased;
  if (phased != nullptr && phased->backward_step_open()) phased->finish_backward_step();
}

void abort_open_step(const Capabilities& capabilities) {
  auto* phased = capabilities.phased;
  if (phased != nullptr && phased->backward_step_open()) phased->abort_backward_step();
}

}  // namespace shampoo::detail
