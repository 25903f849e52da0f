#pragma once
/// An optimizer whose step runs in phases: begin, then the work of some parameters (each time
/// their gradients are ready, during backward), then finish (e.g. one collective that shares every
/// rank's results), or abort. A step of some parameters alone is the same three phases with one
/// call in between. Wrappers drive it through optimizer_step.h; DistributedShampoo and
/// ShardedOptimizer implement it; any other torch::optim optimizer steps whole.

#include <ATen/ATen.h>

#include <vector>

namespace shampoo {

class PhasedStep {
 public:
  virtual ~PhasedStep() = default;

  /// Set while an InBackwardOptimizer drives this optimizer (from add() until its destruction);
  /// the optimizer then refuses an ordinary step() and a step that is not part of a pass.
  virtual void set_in_backward(bool in_backward) = 0;

  /// Whether a step is open: begun and neither finished nor aborted.
  virtual bool step_open() const = 0;
  /// Opens a step. `in_pass`: part of a pass (a backward pass, a unit step) that calls
  /// step_parameters any number of times before finish; otherwise exactly one step_parameters
  /// call follows (a step of those parameters alone), then finish.
  virtual void begin(bool in_pass) = 0;
  /// The step's work for `params` (registered with this optimizer), whose gradients are final.
  /// After an error the step is no longer open (undone).
  virtual void step_parameters(const std::vector<at::Tensor>& params) = 0;
  /// Completes the open step (at the end of backward: on every rank, also when none of this
  /// optimizer's gradients arrived in the pass). After an error the step is undone.
  virtual void finish() = 0;
  /// Undoes the open step (after an error): state and parameters as before it.
  virtual void abort() = 0;

 protected:
  PhasedStep() = default;
  PhasedStep(const PhasedStep&) = default;
  PhasedStep& operator=(const PhasedStep&) = default;
  PhasedStep(PhasedStep&&) = default;
  PhasedStep& operator=(PhasedStep&&) = default;
};

}  // namespace shampoo
