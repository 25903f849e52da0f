#include "shampoo/lr_schedulers.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <sstream>
#include <utility>

// Each formula below is PyTorch's (torch/optim/lr_scheduler.py, 2.11), operation for operation in
// its order, in double as Python's floats, with the same libm cos and pow: the lrs equal PyTorch's
// bit for bit. This file is compiled without contracting a·b + c into fused multiply-adds
// (CMakeLists.txt), which would round differently.

namespace shampoo {
namespace {

using Lrs = std::vector<double>;

// ---- the schedules: the lrs at construction, at a milestone, and at the next epoch ------------

const LrLambda& lambda_of(const LambdaLrOptions& options, size_t group) {
  const auto& lambdas = options.lr_lambdas();
  return lambdas.size() == 1 ? lambdas[0] : lambdas[group];
}

/// LambdaLR.get_lr: base_lr * lmbda(last_epoch), whatever the current lrs (also at construction
/// and at a milestone, where SequentialLR calls get_lr at epoch 0: LambdaLR has no closed form).
Lrs next_lrs(const LambdaLrOptions& options, int64_t epoch, const Lrs& /*current*/,
             const Lrs& base) {
  Lrs lrs(base.size());
  for (size_t g = 0; g < base.size(); ++g) lrs[g] = base[g] * lambda_of(options, g)(epoch);
  return lrs;
}
Lrs initial_lrs(const LambdaLrOptions& options, const Lrs& base) {
  return next_lrs(options, 0, base, base);
}
Lrs restart_lrs(const LambdaLrOptions& options, const Lrs& base) {
  return next_lrs(options, 0, base, base);
}

/// LinearLR.get_lr at epoch >= 1: the current lrs times 1 + Δ / (total·start + (epoch − 1)·Δ),
/// Δ = end − start, until total_iters; unchanged after.
Lrs next_lrs(const LinearLrOptions& options, int64_t epoch, const Lrs& current,
             const Lrs& /*base*/) {
  if (epoch > options.total_iters()) return current;
  const double start = options.start_factor();
  const double end = options.end_factor();
  const double factor = 1.0 + (end - start) / (static_cast<double>(options.total_iters()) * start +
                                               static_cast<double>(epoch - 1) * (end - start));
  Lrs lrs(current.size());
  for (size_t g = 0; g < current.size(); ++g) lrs[g] = current[g] * factor;
  return lrs;
}
/// LinearLR.get_lr at epoch 0 (its initial step): the current (= base) lrs times start_factor.
Lrs initial_lrs(const LinearLrOptions& options, const Lrs& base) {
  Lrs lrs(base.size());
  for (size_t g = 0; g < base.size(); ++g) lrs[g] = base[g] * options.start_factor();
  return lrs;
}
/// LinearLR._get_closed_form_lr at epoch 0 (SequentialLR's milestone).
Lrs restart_lrs(const LinearLrOptions& options, const Lrs& base) {
  const auto total = static_cast<double>(options.total_iters());
  const double factor =
      options.start_factor() + (options.end_factor() - options.start_factor()) * 0.0 / total;
  Lrs lrs(base.size());
  for (size_t g = 0; g < base.size(); ++g) lrs[g] = base[g] * factor;
  return lrs;
}

/// CosineAnnealingLR.get_lr at epoch >= 1: the recursion
///   lr ← (1 + cos(π·e/T)) / (1 + cos(π·(e − 1)/T)) · (lr − η) + η,
/// except where its denominator vanishes (e − 1 − T a multiple of 2T), where PyTorch adds
/// (base − η)·(1 − cos(π/T)) / 2 instead.
Lrs next_lrs(const CosineAnnealingLrOptions& options, int64_t epoch, const Lrs& current,
             const Lrs& base) {
  const int64_t t_max = options.t_max();
  const auto t = static_cast<double>(t_max);
  const double eta_min = options.eta_min();
  constexpr double pi = std::numbers::pi;
  Lrs lrs(current.size());
  if ((epoch - 1 - t_max) % (2 * t_max) == 0) {
    const double cos_step = std::cos(pi / t);
    for (size_t g = 0; g < lrs.size(); ++g) {
      lrs[g] = current[g] + (base[g] - eta_min) * (1 - cos_step) / 2;
    }
    return lrs;
  }
  const double ratio = (1 + std::cos(pi * static_cast<double>(epoch) / t)) /
                       (1 + std::cos(pi * static_cast<double>(epoch - 1) / t));
  for (size_t g = 0; g < lrs.size(); ++g) lrs[g] = ratio * (current[g] - eta_min) + eta_min;
  return lrs;
}
/// CosineAnnealingLR's initial step leaves the lrs.
Lrs initial_lrs(const CosineAnnealingLrOptions& /*options*/, const Lrs& base) { return base; }
/// CosineAnnealingLR._get_closed_form_lr at epoch 0: η + (base − η)·(1 + cos 0) / 2, which need
/// not round to base.
Lrs restart_lrs(const CosineAnnealingLrOptions& options, const Lrs& base) {
  const double eta_min = options.eta_min();
  const double cos_zero = std::cos(std::numbers::pi * 0.0 / static_cast<double>(options.t_max()));
  Lrs lrs(base.size());
  for (size_t g = 0; g < base.size(); ++g) {
    lrs[g] = eta_min + (base[g] - eta_min) * (1 + cos_zero) / 2;
  }
  return lrs;
}

// ---- checks ------------------------------------------------------------------------------------

void check(const LambdaLrOptions& options, const std::string& where, size_t num_groups) {
  const auto& lambdas = options.lr_lambdas();
  TORCH_CHECK(lambdas.size() == 1 || lambdas.size() == num_groups, where, "lr_lambdas: got ",
              lambdas.size(),
              " functions, expected 1 (for every param group) "
              "or one per param group (",
              num_groups, ")");
  for (size_t i = 0; i < lambdas.size(); ++i) {
    TORCH_CHECK(static_cast<bool>(lambdas[i]), where, "lr_lambdas[", i,
                "]: got an empty std::function, expected a function of the epoch");
  }
}

void check(const LinearLrOptions& options, const std::string& where, size_t /*num_groups*/) {
  TORCH_CHECK(options.start_factor() > 0.0 && options.start_factor() <= 1.0, where,
              "start_factor: got ", options.start_factor(), ", expected a value in (0, 1]");
  TORCH_CHECK(options.end_factor() >= 0.0 && options.end_factor() <= 1.0, where, "end_factor: got ",
              options.end_factor(), ", expected a value in [0, 1]");
  TORCH_CHECK(options.total_iters() >= 1, where, "total_iters: got ", options.total_iters(),
              ", expected >= 1");
}

void check(const CosineAnnealingLrOptions& options, const std::string& where,
           size_t /*num_groups*/) {
  TORCH_CHECK(options.t_max() >= 1, where, "t_max: got ", options.t_max(), ", expected >= 1");
  TORCH_CHECK(std::isfinite(options.eta_min()) && options.eta_min() >= 0.0, where, "eta_min: got ",
              options.eta_min(), ", expected a finite value >= 0");
}

std::string list(const std::vector<int64_t>& values) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < values.size(); ++i) out << (i > 0 ? ", " : "") << values[i];
  out << "]";
  return out.str();
}

void check_milestones(const std::string& name, const std::vector<LrSchedule>& schedules,
                      const std::vector<int64_t>& milestones) {
  TORCH_CHECK(!schedules.empty(), name, ": schedules: got none, expected at least one");
  TORCH_CHECK(milestones.size() + 1 == schedules.size(), name, ": milestones: got ",
              milestones.size(), " (", list(milestones), ") for ", schedules.size(),
              " schedules, expected one fewer than the schedules");
  for (size_t i = 0; i < milestones.size(); ++i) {
    TORCH_CHECK(milestones[i] >= 1 && (i == 0 || milestones[i] > milestones[i - 1]), name,
                ": milestones: got ", list(milestones),
                ", expected strictly increasing epochs >= 1");
  }
}

}  // namespace

LambdaLrOptions::LambdaLrOptions(LrLambda lr_lambda) : lr_lambdas_{std::move(lr_lambda)} {}
LambdaLrOptions::LambdaLrOptions(std::vector<LrLambda> lr_lambdas)
    : lr_lambdas_(std::move(lr_lambdas)) {}

PhasedLrScheduler::PhasedLrScheduler(std::string name, torch::optim::Optimizer& optimizer,
                                     std::vector<LrSchedule> schedules,
                                     std::vector<int64_t> milestones)
    : torch::optim::LRScheduler(optimizer),
      name_(std::move(name)),
      optimizer_(optimizer),
      schedules_(std::move(schedules)),
      milestones_(std::move(milestones)),
      base_lrs_(get_current_lrs()) {
  check_milestones(name_, schedules_, milestones_);
  for (size_t i = 0; i < schedules_.size(); ++i) {
    // Of several schedules, the message names the one at fault.
    const std::string where =
        name_ + ": " + (schedules_.size() > 1 ? "schedules[" + std::to_string(i) + "]." : "");
    std::visit([&](const auto& options) { check(options, where, base_lrs_.size()); },
               schedules_[i]);
  }
  // PyTorch's initial step: the lrs of epoch 0 are set when the scheduler is made.
  set_lrs(std::visit([&](const auto& options) { return initial_lrs(options, base_lrs_); },
                     schedules_[0]));
}

size_t PhasedLrScheduler::schedule_at(int64_t epoch) const {
  // SequentialLR: bisect_right(milestones, epoch).
  return static_cast<size_t>(std::upper_bound(milestones_.begin(), milestones_.end(), epoch) -
                             milestones_.begin());
}

std::vector<double> PhasedLrScheduler::lrs_at(int64_t epoch,
                                              const std::vector<double>& current) const {
  const size_t index = schedule_at(epoch);
  const int64_t start = index == 0 ? 0 : milestones_[index - 1];
  return std::visit(
      [&](const auto& options) {
        // At its milestone a schedule restarts (SequentialLR: _update_lr(0)); after it, its own
        // epoch counts from the milestone.
        return epoch == start ? restart_lrs(options, base_lrs_)
                              : next_lrs(options, epoch - start, current, base_lrs_);
      },
      schedules_[index]);
}

std::vector<double> PhasedLrScheduler::get_lrs() {
  // LRScheduler::step() calls this once per step and sets what it returns. The epoch is counted
  // here, not in the base class's step_count_: resume() sets it.
  const std::vector<double> current = get_current_lrs();
  TORCH_CHECK(current.size() == base_lrs_.size(), name_, ": the optimizer has ", current.size(),
              " param groups, the scheduler was made for ", base_lrs_.size(),
              " (a group added after the scheduler has no base lr: make the scheduler after "
              "adding every group)");
  ++last_epoch_;
  last_lrs_ = lrs_at(last_epoch_, current);
  return last_lrs_;
}

void PhasedLrScheduler::resume(int64_t steps_taken) {
  TORCH_CHECK(steps_taken >= 0, name_, "::resume: steps_taken: got ", steps_taken,
              ", expected >= 0");
  TORCH_CHECK(optimizer_.param_groups().size() == base_lrs_.size(), name_,
              "::resume: the optimizer has ", optimizer_.param_groups().size(),
              " param groups, the scheduler was made for ", base_lrs_.size());
  // Replayed from the start of the schedule that holds steps_taken: the same operations as the
  // uninterrupted run's, so the same lrs.
  const size_t index = schedule_at(steps_taken);
  const int64_t start = index == 0 ? 0 : milestones_[index - 1];
  std::vector<double> lrs = std::visit(
      [&](const auto& options) {
        return index == 0 ? initial_lrs(options, base_lrs_) : restart_lrs(options, base_lrs_);
      },
      schedules_[index]);
  // LambdaLR's lrs do not depend on the previous ones: no need to call f for every epoch.
  const bool recursive = !std::holds_alternative<LambdaLrOptions>(schedules_[index]);
  for (int64_t epoch = recursive ? start + 1 : std::max(start + 1, steps_taken);
       epoch <= steps_taken; ++epoch) {
    lrs = lrs_at(epoch, lrs);
  }
  last_epoch_ = steps_taken;
  set_lrs(std::move(lrs));
}

void PhasedLrScheduler::set_lrs(std::vector<double> lrs) {
  auto& groups = optimizer_.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) groups[g].options().set_lr(lrs[g]);
  last_lrs_ = std::move(lrs);
}

LambdaLr::LambdaLr(torch::optim::Optimizer& optimizer, LrLambda lr_lambda)
    : LambdaLr(optimizer, LambdaLrOptions(std::move(lr_lambda))) {}
LambdaLr::LambdaLr(torch::optim::Optimizer& optimizer, LambdaLrOptions options)
    : PhasedLrScheduler("LambdaLr", optimizer, {std::move(options)}, {}) {}

LinearLr::LinearLr(torch::optim::Optimizer& optimizer, double start_factor, double end_factor,
                   int64_t total_iters)
    : LinearLr(optimizer, LinearLrOptions()
                              .start_factor(start_factor)
                              .end_factor(end_factor)
                              .total_iters(total_iters)) {}
LinearLr::LinearLr(torch::optim::Optimizer& optimizer, const LinearLrOptions& options)
    : PhasedLrScheduler("LinearLr", optimizer, {options}, {}) {}

CosineAnnealingLr::CosineAnnealingLr(torch::optim::Optimizer& optimizer, int64_t t_max,
                                     double eta_min)
    : CosineAnnealingLr(optimizer, CosineAnnealingLrOptions(t_max).eta_min(eta_min)) {}
CosineAnnealingLr::CosineAnnealingLr(torch::optim::Optimizer& optimizer,
                                     const CosineAnnealingLrOptions& options)
    : PhasedLrScheduler("CosineAnnealingLr", optimizer, {options}, {}) {}

SequentialLr::SequentialLr(torch::optim::Optimizer& optimizer, std::vector<LrSchedule> schedules,
                           std::vector<int64_t> milestones)
    : PhasedLrScheduler("SequentialLr", optimizer, std::move(schedules), std::move(milestones)) {}

SequentialLr warmup_cosine(torch::optim::Optimizer& optimizer, int64_t warmup_steps,
                           int64_t total_steps, double eta_min, double start_factor) {
  TORCH_CHECK(total_steps >= 1, "warmup_cosine: total_steps: got ", total_steps, ", expected >= 1");
  TORCH_CHECK(warmup_steps >= 0 && warmup_steps < total_steps, "warmup_cosine: warmup_steps: got ",
              warmup_steps, ", expected 0 <= warmup_steps < total_steps (", total_steps, ")");
  TORCH_CHECK(start_factor > 0.0 && start_factor <= 1.0, "warmup_cosine: start_factor: got ",
              start_factor, ", expected a value in (0, 1]");
  TORCH_CHECK(std::isfinite(eta_min) && eta_min >= 0.0, "warmup_cosine: eta_min: got ", eta_min,
              ", expected a finite value >= 0");
  const auto cosine = CosineAnnealingLrOptions(total_steps - warmup_steps).eta_min(eta_min);
  if (warmup_steps == 0) return SequentialLr(optimizer, {cosine}, {});
  const auto warmup =
      LinearLrOptions().start_factor(start_factor).end_factor(1.0).total_iters(warmup_steps);
  return SequentialLr(optimizer, {warmup, cosine}, {warmup_steps});
}

}  // namespace shampoo
