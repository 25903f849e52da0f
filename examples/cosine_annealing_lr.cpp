#include "examples/cosine_annealing_lr.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <numbers>

namespace shampoo::examples {

CosineAnnealingLr::CosineAnnealingLr(torch::optim::Optimizer& optimizer, int64_t total_steps,
                                     double min_lr)
    : torch::optim::LRScheduler(optimizer),
      base_lrs_(get_current_lrs()),
      total_steps_(total_steps),
      min_lr_(min_lr) {
  TORCH_CHECK(total_steps >= 1, "CosineAnnealingLr: total_steps: got ", total_steps,
              ", expected >= 1");
  TORCH_CHECK(min_lr >= 0, "CosineAnnealingLr: min_lr: got ", min_lr, ", expected >= 0");
}

void CosineAnnealingLr::resume(int64_t steps_taken) {
  TORCH_CHECK(steps_taken >= 0, "CosineAnnealingLr::resume: steps_taken: got ", steps_taken,
              ", expected >= 0");
  step_count_ = static_cast<unsigned>(steps_taken);
}

std::vector<double> CosineAnnealingLr::get_lrs() {
  // LRScheduler::step() counts its calls after asking for the rates: the k-th call (step_count_
  // = k − 1) sets the rates of the optimizer's step k + 1, i.e. t = k.
  const int64_t t = std::min<int64_t>(static_cast<int64_t>(step_count_) + 1, total_steps_);
  const double factor = 0.5 * (1.0 + std::cos(std::numbers::pi * static_cast<double>(t) /
                                              static_cast<double>(total_steps_)));
  std::vector<double> lrs;
  lrs.reserve(base_lrs_.size());
  for (const double base_lr : base_lrs_) lrs.push_back(min_lr_ + (base_lr - min_lr_) * factor);
  return lrs;
}

}  // namespace shampoo::examples
