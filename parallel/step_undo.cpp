#include "parallel/step_undo.h"

#include <ATen/core/grad_mode.h>

#include <cmath>

namespace shampoo::detail {

bool all_finite(const at::Tensor& t) {
  if (t.numel() == 0) return true;
  const auto [low, high] = at::aminmax(t);
  return std::isfinite(low.item<double>()) && std::isfinite(high.item<double>());
}

void UnitUndo::revert(
    const std::function<void(const at::Tensor&, at::IntArrayRef, at::ScalarType)>& allocate,
    const std::function<void(const at::Tensor&, at::ScalarType)>& release) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> allocated;
  for (auto& s : stepped) {
    if (s.param.numel() == 0) {
      allocate(s.param, s.sizes, s.dtype);
      allocated.push_back(s.param);
    }
  }
  for (auto* p : phased) p->abort_backward_step();
  for (const auto& param : allocated) release(param, param.scalar_type());
  for (auto& saved : states) {
    saved.optimizer->state().erase(saved.key);
    if (saved.state) saved.optimizer->state()[saved.key] = std::move(saved.state);
  }
  for (auto& [shard, before] : shards) shard.copy_(before);
  phased.clear();
  states.clear();
  shards.clear();
  stepped.clear();
}

void UnitUndo::commit() {
  for (auto* p : phased) p->finish_backward_step();
  phased.clear();
}

}  // namespace shampoo::detail
