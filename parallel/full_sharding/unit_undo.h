#pragma once
/// What full sharding keeps to undo a unit's step until its backward pass ends, so that a unit
/// failing later in the pass undoes the whole iteration (FullyShardedOptions::undo_failed_steps),
/// and the finiteness check of the gradients it steps on.

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "parallel/optimizers/phased_backward_step.h"

namespace shampoo::detail {

/// Whether every element is finite: one read pass (aminmax propagates NaN, and an infinity is its
/// min or max; isfinite(...).all() took 30x as long on 15M floats).
bool all_finite(const at::Tensor& t);

/// One unit's step on this rank: the rows the rank had before it, the optimizers' steps in
/// phases (local shards' DistributedShampoo; finished at the end of the pass, or aborted), and
/// LibTorch optimizers' per-parameter states before it.
struct UnitUndo {
  std::vector<std::pair<at::Tensor, at::Tensor>> shards;  // (shard, its rows before the step)
  std::vector<PhasedBackwardStep*> phased;
  struct Saved {
    torch::optim::Optimizer* optimizer;
    void* key;
    std::unique_ptr<torch::optim::OptimizerParamState> state;  // null: none before
  };
  std::vector<Saved> states;
  bool complete = true;  // false: an optimizer stepped whose step cannot be undone

  /// Puts everything back: the phased steps aborted (their optimizers' state; a parameter whose
  /// storage full sharding released since is left to the rows below), the LibTorch states, the
  /// rows.
  void revert();
  /// Finishes the phased steps: the iteration stands.
  void commit();
};

}  // namespace shampoo::detail
