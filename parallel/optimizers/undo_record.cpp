#include "parallel/optimizers/undo_record.h"

#include <ATen/core/grad_mode.h>

#include "parallel/optimizers/libtorch_optimizers.h"

namespace shampoo::detail {

void UndoRecord::save_values(const at::Tensor& tensor) {
  if (!saved_values_.insert(tensor.unsafeGetTensorImpl()).second) return;
  at::NoGradGuard no_grad;
  values_.emplace_back(tensor, tensor.detach().clone());
}

void UndoRecord::save_states(torch::optim::Optimizer& optimizer,
                             const std::vector<at::Tensor>& params) {
  if (libtorch_optimizer_name(optimizer).empty()) {
    complete_ = complete_ && params.empty();
    return;
  }
  for (const auto& p : params) {
    void* key = p.unsafeGetTensorImpl();
    if (!saved_states_.insert(key).second) continue;
    const auto it = optimizer.state().find(key);
    states_.push_back(
        {&optimizer, key,
         it == optimizer.state().end() ? nullptr : copy_param_state(optimizer, *it->second)});
  }
}

void UndoRecord::undo() {
  at::NoGradGuard no_grad;
  for (auto* p : phased_) p->abort();
  for (auto& saved : states_) {
    saved.optimizer->state().erase(saved.key);
    if (saved.state) saved.optimizer->state()[saved.key] = std::move(saved.state);
  }
  for (auto& [tensor, before] : values_) tensor.detach().copy_(before);
  clear();
}

void UndoRecord::commit() {
  for (auto* p : phased_) p->finish();
  clear();
}

void UndoRecord::clear() {
  phased_.clear();
  states_.clear();
  values_.clear();
  saved_values_.clear();
  saved_states_.clear();
  complete_ = true;
}

}  // namespace shampoo::detail
