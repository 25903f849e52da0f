#include "parallel/full_sharding/unit_undo.h"

#include <ATen/core/grad_mode.h>

#include <cmath>

namespace shampoo::detail {

bool all_finite(const at::Tensor& t) {
  if (t.numel() == 0) return true;
  const auto [low, high] = at::aminmax(t);
  return std::isfinite(low.item<double>()) && std::isfinite(high.item<double>());
}

void UnitUndo::revert() {
  at::NoGradGuard no_grad;
  for (auto* p : phased) p->abort_backward_step();
  for (auto& saved : states) {
    saved.optimizer->state().erase(saved.key);
    if (saved.state) saved.optimizer->state()[saved.key] = std::move(saved.state);
  }
  for (auto& [shard, before] : shards) shard.copy_(before);
  phased.clear();
  states.clear();
  shards.clear();
}

void UnitUndo::commit() {
  for (auto* p : phased) p->finish_backward_step();
  phased.clear();
}

}  // namespace shampoo::detail
