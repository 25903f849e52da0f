#pragma once
/// The one way a wrapper steps an optimizer (in-backward's sets, ZeRO-1's local optimizer in
/// backward, full sharding's rank optimizer and its units' optimizers): which parameters, whether
/// inside a pass that is finished or undone as a whole, and what to keep for the undo. The
/// optimizer's capabilities (capabilities.h) say how: an optimizer that steps in phases
/// (PhasedStep) opens its step once per pass and does each parameter set's work in it, or, alone,
/// begins, does the parameters' work and finishes; any other steps the given parameters alone
/// (the LibTorch subset step, libtorch_optimizers.h), for good.

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <vector>

#include "parallel/optimizers/capabilities.h"

namespace shampoo::detail {

class UndoRecord;  // undo_record.h

enum class StepScope {
  /// A step that stands once taken (after backward, no pass around it).
  kAlone,
  /// Part of a pass (a backward pass, a unit step) that its driver finishes or undoes as a
  /// whole: an optimizer that steps in phases opens its step (once) and does the work of
  /// `params` in it; finish_open_step / abort_open_step close it.
  kInPass,
};

/// Steps `params` (registered with `optimizer`, their gradients final) and no other parameter.
/// `capabilities` are `optimizer`'s. With `undo`: what undoes the step is kept there first (the
/// phased step it opens, or LibTorch's per-parameter states; another optimizer stepped whole
/// makes the record incomplete).
void step_optimizer(torch::optim::Optimizer& optimizer, const Capabilities& capabilities,
                    const std::vector<at::Tensor>& params, StepScope scope, UndoRecord* undo);

/// Ends a pass whose phased step every rank ends together (its finish is collective:
/// DistributedShampoo's AllGather): opened first where none of the pass's parameters stepped on
/// this rank, then finished, or undone when `undo`. Nothing for an optimizer without phases.
void end_pass_on_every_rank(const Capabilities& capabilities, bool undo);

/// Finishes, or undoes, the optimizer's open phased step, if it has one (this rank's alone).
void finish_open_step(const Capabilities& capabilities);
void abort_open_step(const Capabilities& capabilities);

}  // namespace shampoo::detail
