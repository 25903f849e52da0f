#pragma once
/// Cosine annealing of the learning rate, as PyTorch's torch.optim.lr_scheduler.CosineAnnealingLR
/// without restarts: lr_t = min_lr + (base_lr − min_lr)·(1 + cos(π·t / total_steps)) / 2, where
/// base_lr is each param group's lr when the scheduler is made. After total_steps it stays at
/// min_lr. Call step() once after each optimizer step.
/// The library's shampoo::CosineAnnealingLr (shampoo/lr_schedulers.h) is PyTorch's recursive
/// form, equal to it bit for bit; this closed form stays, as the one the trainer's measured runs
/// used (the two differ in the last bits of a double).

#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <cstdint>
#include <vector>

namespace shampoo::examples {

class CosineAnnealingLr : public torch::optim::LRScheduler {
 public:
  /// total_steps ≥ 1; min_lr ≥ 0.
  CosineAnnealingLr(torch::optim::Optimizer& optimizer, int64_t total_steps, double min_lr = 0.0);

  /// Continues a run after `steps_taken` optimizer steps (and as many step() calls), e.g. after
  /// loading a checkpoint: the next step() sets the rates of step steps_taken + 2, as in the
  /// uninterrupted run. (The rates of step steps_taken + 1 come with the loaded optimizer.)
  void resume(int64_t steps_taken);

 private:
  std::vector<double> get_lrs() override;

  std::vector<double> base_lrs_;
  int64_t total_steps_;
  double min_lr_;
};

}  // namespace shampoo::examples
