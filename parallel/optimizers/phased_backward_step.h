#pragma once
/// An optimizer whose step can run in phases during backward (optimizer-in-backward): begin,
/// then the work of some parameters each time their gradients are ready, then finish once
/// backward is done (e.g. one collective that shares every rank's results). An optimizer that
/// implements this is driven phase by phase by InBackwardOptimizer; any other torch::optim
/// optimizer steps whole, once per ready parameter set. DistributedShampoo implements it.

#include <ATen/ATen.h>

#include <vector>

namespace shampoo {

class PhasedBackwardStep {
 public:
  virtual ~PhasedBackwardStep() = default;

  /// Set while an InBackwardOptimizer drives this optimizer (from add() until its destruction);
  /// the optimizer may then refuse an ordinary step().
  virtual void set_in_backward(bool in_backward) = 0;

  /// Whether a step is open: begun and neither finished nor aborted.
  virtual bool backward_step_open() const = 0;
  /// Opens a step; called before the first step_parameters of a backward pass.
  virtual void begin_backward_step() = 0;
  /// The step's work for `params` (registered with this optimizer), whose gradients are final.
  virtual void step_parameters(const std::vector<at::Tensor>& params) = 0;
  /// Completes the open step at the end of backward, on every rank also when none of this
  /// optimizer's gradients arrived in the pass.
  virtual void finish_backward_step() = 0;
  /// Undoes the open step (after an error during backward): state and parameters as before it.
  virtual void abort_backward_step() = 0;

 protected:
  PhasedBackwardStep() = default;
  PhasedBackwardStep(const PhasedBackwardStep&) = default;
  PhasedBackwardStep& operator=(const PhasedBackwardStep&) = default;
  PhasedBackwardStep(PhasedBackwardStep&&) = default;
  PhasedBackwardStep& operator=(PhasedBackwardStep&&) = default;
};

}  // namespace shampoo
