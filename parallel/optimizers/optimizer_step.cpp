#include "parallel/optimizers/optimizer_step.h"

#include "parallel/optimizers/libtorch_optimizers.h"
#include "parallel/optimizers/phased_step.h"
#include "parallel/optimizers/undo_record.h"

namespace shampoo::detail {

namespace {

/// A step of `params` alone: begin, their work, finish; undone on an error.
void step_alone(PhasedStep& phased, const std::vector<at::Tensor>& params) {
  phased.begin(/*in_pass=*/false);
  try {
    phased.step_parameters(params);
    phased.finish();
  } catch (...) {
    phased.abort();  // nothing left to undo where the optimizer already did
    throw;
  }
}

}  // namespace

void step_optimizer(torch::optim::Optimizer& optimizer, const Capabilities& capabilities,
                    const std::vector<at::Tensor>& params, StepScope scope, UndoRecord* undo) {
  if (params.empty()) return;
  auto* phased = capabilities.phased;
  if (phased != nullptr && scope == StepScope::kInPass) {
    if (!phased->step_open()) {
      phased->begin(/*in_pass=*/true);
      if (undo != nullptr) undo->add_phased(*phased);
    }
    phased->step_parameters(params);
    return;
  }
  // LibTorch's states are copied; another optimizer's make the record incomplete.
  if (undo != nullptr) undo->save_states(optimizer, params);
  // `params` only: the optimizer's other parameters may be getting their gradients meanwhile.
  if (phased != nullptr) {
    step_alone(*phased, params);  // DistributedShampoo: one step of those blocks
  } else {
    step_hiding_others(optimizer, params);
  }
}

void end_pass_on_every_rank(const Capabilities& capabilities, bool undo) {
  auto* phased = capabilities.phased;
  if (phased == nullptr) return;
  if (!phased->step_open()) phased->begin(/*in_pass=*/true);
  if (undo) {
    phased->abort();
  } else {
    phased->finish();
  }
}

void finish_open_step(const Capabilities& capabilities) {
  auto* phased = capabilities.phased;
  if (phased != nullptr && phased->step_open()) phased->finish();
}

void abort_open_step(const Capabilities& capabilities) {
  auto* phased = capabilities.phased;
  if (phased != nullptr && phased->step_open()) phased->abort();
}

}  // namespace shampoo::detail
