#pragma once
/// What a loss scaler (shampoo::GradScaler, amp/grad_scaler.h) and the wrappers whose steps are
/// not a plain torch::optim step need of each other. The wrappers (full sharding, its
/// optimizer(), optimizer-in-backward) implement ScaledStepping; the scaler implements
/// BackwardUnscaler. Neither side includes the other: amp/ knows no wrapper.

#include <ATen/ATen.h>

#include <vector>

namespace shampoo {

/// The scaler's side, for optimizer-in-backward (GradScaler::attach): unscale each set of
/// gradients before it steps, and agree across ranks at the end of the pass whether any gradient
/// overflowed.
class BackwardUnscaler {
 public:
  virtual ~BackwardUnscaler() = default;
  /// Unscales the gradients of `params` in place (those without one are skipped); false when
  /// one of them holds inf or NaN on this rank.
  virtual bool unscale_ready(const std::vector<at::Tensor>& params) = 0;
  /// At the end of every pass that steps, on every rank: whether any rank found inf or NaN
  /// (`found_here`: this one did). Collective. True makes the pass undo its steps.
  virtual bool pass_overflowed(bool found_here) = 0;

 protected:
  BackwardUnscaler() = default;
  BackwardUnscaler(const BackwardUnscaler&) = default;
  BackwardUnscaler& operator=(const BackwardUnscaler&) = default;
};

/// The wrapper's side. GradScaler::unscale_ and step on a wrapper (or on an optimizer that is
/// one) use the first four; GradScaler::attach the last. Each one a wrapper does not support is
/// an error naming the scaler's call (`caller`, or the wrapper's default text).
class ScaledStepping {
 public:
  virtual ~ScaledStepping() = default;
  /// The object whose gradients and step are meant; the scaler keeps one state per target (a
  /// fully sharded model's optimizer() answers the model).
  virtual ScaledStepping& scaling_target() { return *this; }
  /// The gradients the next step uses, which the scaler unscales in place.
  virtual std::vector<at::Tensor> gradients_to_unscale(const char* caller);
  /// Steps on the unscaled gradients (finite on every rank).
  virtual void scaled_step();
  /// Drops the gradients instead of stepping (inf or NaN on some rank; every rank skips).
  virtual void skip_scaled_step();
  /// A disabled scaler's step: what stepping does without a scaler.
  virtual void unscaled_step();
  /// Calls `unscaler` on each set of gradients before it steps in backward (null: none).
  virtual void set_backward_unscaler(BackwardUnscaler* unscaler);

 protected:
  ScaledStepping() = default;
  ScaledStepping(const ScaledStepping&) = default;
  ScaledStepping& operator=(const ScaledStepping&) = default;
};

}  // namespace shampoo
