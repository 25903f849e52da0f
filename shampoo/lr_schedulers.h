#pragma once
/// Learning-rate schedulers for C++ training loops, each equal to its PyTorch counterpart
/// (torch.optim.lr_scheduler of PyTorch 2.11) step for step, bit for bit: LambdaLr (LambdaLR),
/// LinearLr (LinearLR), CosineAnnealingLr (CosineAnnealingLR, its recursive form), SequentialLr
/// (SequentialLR), and warmup_cosine (linear warm-up, then cosine annealing).
///
/// They are torch::optim::LRScheduler subclasses and work with any torch::optim::Optimizer
/// (LibTorch's Adam, DistributedShampoo, full sharding's optimizer(), ...): call step() once after
/// each optimizer step. As in PyTorch:
///   - the base lrs are the param groups' lrs when the scheduler is made;
///   - making the scheduler sets the lrs of the first optimizer step (epoch 0): LinearLr multiplies
///     them by start_factor, LambdaLr by f(0), CosineAnnealingLr leaves them;
///   - the k-th step() sets the lrs of optimizer step k + 1 (epoch k), from the current lrs where
///     PyTorch's formula is recursive (LinearLr, CosineAnnealingLr), from the base lrs otherwise.
///
/// Resuming: make the scheduler on the freshly built optimizer (before loading a checkpoint into
/// it: the base lrs are the configured ones), load, then resume(steps_taken) with the number of
/// optimizer steps (and step() calls) taken before the checkpoint.

#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <cstdint>
#include <functional>
#include <string>
#include <variant>
#include <vector>

namespace shampoo {

/// The factor of a param group's base lr at an epoch (PyTorch's lr_lambda(epoch)): lr = base_lr ·
/// f(epoch), epoch 0 being the first optimizer step.
using LrLambda = std::function<double(int64_t)>;

/// LambdaLR: lr = base_lr · f(epoch).
struct LambdaLrOptions {
  /// One function for every param group.
  /* implicit */ LambdaLrOptions(LrLambda lr_lambda);
  /// One function per param group, in the optimizer's order (or a single one for all).
  /* implicit */ LambdaLrOptions(std::vector<LrLambda> lr_lambdas);

  TORCH_ARG(std::vector<LrLambda>, lr_lambdas);
};

/// LinearLR: the lr goes from base_lr · start_factor at epoch 0 to base_lr · end_factor at epoch
/// total_iters, linearly, and stays there. start_factor in (0, 1], end_factor in [0, 1],
/// total_iters >= 1 (PyTorch's defaults: 1/3, 1, 5).
struct LinearLrOptions {
  TORCH_ARG(double, start_factor) = 1.0 / 3;
  TORCH_ARG(double, end_factor) = 1.0;
  TORCH_ARG(int64_t, total_iters) = 5;
};

/// CosineAnnealingLR: lr = eta_min + (base_lr − eta_min)·(1 + cos(π·epoch / t_max)) / 2, computed
/// by PyTorch's recursion from the current lr. After t_max the cosine goes on as PyTorch's does:
/// the lr rises back to base_lr at 2·t_max, falls again, and so on (period 2·t_max); it does not
/// stay at eta_min. t_max >= 1; eta_min finite and >= 0 (default 0).
struct CosineAnnealingLrOptions {
  /* implicit */ CosineAnnealingLrOptions(int64_t t_max) : t_max_(t_max) {}

  TORCH_ARG(int64_t, t_max);
  TORCH_ARG(double, eta_min) = 0.0;
};

/// One schedule of a SequentialLr.
using LrSchedule = std::variant<LambdaLrOptions, LinearLrOptions, CosineAnnealingLrOptions>;

/// What the schedulers below share: schedules one after another, schedule i from epoch
/// milestones[i − 1] on (restarted there at its epoch 0, from the base lrs); LambdaLr, LinearLr
/// and CosineAnnealingLr are sequences of one schedule. Bad arguments raise c10::Error naming the
/// argument, its value and what is allowed.
class PhasedLrScheduler : public torch::optim::LRScheduler {
 public:
  /// Continues a run after `steps_taken` optimizer steps (and as many step() calls), e.g. after
  /// loading a checkpoint: sets the lrs of optimizer step steps_taken + 1 as the uninterrupted run
  /// had them (replayed from the base lrs, bit for bit; the loaded optimizer's lrs are replaced),
  /// and the next step() sets those of step steps_taken + 2 (cost: one recursion step per epoch
  /// since the start of the current schedule). steps_taken >= 0.
  void resume(int64_t steps_taken);

  /// The number of step() calls since construction, or since resume's steps_taken (PyTorch's
  /// last_epoch): the lrs now set are those of epoch last_epoch().
  int64_t last_epoch() const { return last_epoch_; }
  /// Each param group's lr when the scheduler was made (PyTorch's base_lrs).
  const std::vector<double>& base_lrs() const { return base_lrs_; }
  /// The lrs this scheduler set last (PyTorch's get_last_lr()).
  const std::vector<double>& get_last_lr() const { return last_lrs_; }

 protected:
  /// `name` is the class's name, for messages.
  PhasedLrScheduler(std::string name, torch::optim::Optimizer& optimizer,
                    std::vector<LrSchedule> schedules, std::vector<int64_t> milestones);

 private:
  std::vector<double> get_lrs() final;
  /// The lrs of `epoch` >= 1 after those of epoch − 1, `current`.
  std::vector<double> lrs_at(int64_t epoch, const std::vector<double>& current) const;
  /// The index of the schedule that sets the lrs of `epoch`.
  size_t schedule_at(int64_t epoch) const;
  void set_lrs(std::vector<double> lrs);

  std::string name_;
  // The base class keeps its optimizer private.
  torch::optim::Optimizer& optimizer_;
  std::vector<LrSchedule> schedules_;
  std::vector<int64_t> milestones_;
  std::vector<double> base_lrs_;
  std::vector<double> last_lrs_;
  int64_t last_epoch_ = 0;
};

/// torch.optim.lr_scheduler.LambdaLR: lr = base_lr · f(epoch) (one f for all groups, or one per
/// group). Making it sets lr = base_lr · f(0).
class LambdaLr : public PhasedLrScheduler {
 public:
  LambdaLr(torch::optim::Optimizer& optimizer, LrLambda lr_lambda);
  LambdaLr(torch::optim::Optimizer& optimizer, LambdaLrOptions options);
};

/// torch.optim.lr_scheduler.LinearLR (LinearLrOptions). Making it multiplies the lrs by
/// start_factor.
class LinearLr : public PhasedLrScheduler {
 public:
  explicit LinearLr(torch::optim::Optimizer& optimizer, double start_factor = 1.0 / 3,
                    double end_factor = 1.0, int64_t total_iters = 5);
  LinearLr(torch::optim::Optimizer& optimizer, const LinearLrOptions& options);
};

/// torch.optim.lr_scheduler.CosineAnnealingLR (CosineAnnealingLrOptions): t_max, eta_min.
class CosineAnnealingLr : public PhasedLrScheduler {
 public:
  CosineAnnealingLr(torch::optim::Optimizer& optimizer, int64_t t_max, double eta_min = 0.0);
  CosineAnnealingLr(torch::optim::Optimizer& optimizer, const CosineAnnealingLrOptions& options);
};

/// torch.optim.lr_scheduler.SequentialLR: schedules[0] until epoch milestones[0], then
/// schedules[1] (restarted at its epoch 0 from the base lrs: LinearLR's start_factor, a cosine's
/// base lr) until milestones[1], and so on. PyTorch takes scheduler objects made on the same
/// optimizer, here their options, so that every schedule's base lrs are the groups' lrs when the
/// SequentialLr is made (PyTorch's initial_lr). milestones: schedules.size() − 1 strictly
/// increasing epochs >= 1.
class SequentialLr : public PhasedLrScheduler {
 public:
  SequentialLr(torch::optim::Optimizer& optimizer, std::vector<LrSchedule> schedules,
               std::vector<int64_t> milestones);
};

/// Linear warm-up from base_lr · start_factor to base_lr over `warmup_steps` optimizer steps, then
/// cosine annealing to eta_min at step `total_steps`: PyTorch's
///   SequentialLR(opt, [LinearLR(opt, start_factor, 1.0, warmup_steps),
///                      CosineAnnealingLR(opt, total_steps − warmup_steps, eta_min)],
///                milestones=[warmup_steps])
/// (with warmup_steps = 0, the cosine alone). 0 <= warmup_steps < total_steps; start_factor in
/// (0, 1] (default 0.01); eta_min >= 0 (default 0).
SequentialLr warmup_cosine(torch::optim::Optimizer& optimizer, int64_t warmup_steps,
                           int64_t total_steps, double eta_min = 0.0, double start_factor = 0.01);

}  // namespace shampoo
