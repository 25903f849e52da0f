#pragma once
/// The one undo record of the wrappers (ZeRO-1 in backward, full sharding's units and passes):
/// what a step changed, saved before it, put back when the step must not stand. The Shampoo
/// engine keeps its own transaction inside its phased step; a wrapper adds that step here
/// (add_phased), so that undoing the record aborts it and committing it finishes it.

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <unordered_set>
#include <utility>
#include <vector>

#include "parallel/optimizers/phased_step.h"

namespace shampoo::detail {

class UndoRecord {
 public:
  /// Saves a copy of `tensor`'s values (a parameter, a shard), once per tensor.
  void save_values(const at::Tensor& tensor);
  /// Saves `optimizer`'s per-parameter state of each of `params` (a copy, or that it had none),
  /// once per parameter. Only LibTorch's optimizers' states can be copied
  /// (libtorch_optimizers.h): for another optimizer the record becomes incomplete instead.
  void save_states(torch::optim::Optimizer& optimizer, const std::vector<at::Tensor>& params);
  /// A phased step opened for what this record covers: undo() aborts it, commit() finishes it.
  void add_phased(PhasedStep& phased) { phased_.push_back(&phased); }

  /// Whether undo() puts everything back (false: an optimizer stepped whose state it could not
  /// copy).
  bool complete() const { return complete_; }
  /// Puts back what was saved: the phased steps aborted (in the order added), the optimizers'
  /// states, the values. The record is then empty.
  void undo();
  /// The steps stand: the phased steps finished. The record is then empty.
  void commit();
  /// Forgets what was saved (the steps stand; phased steps are the caller's to finish).
  void clear();

 private:
  struct SavedState {
    torch::optim::Optimizer* optimizer;
    void* key;
    std::unique_ptr<torch::optim::OptimizerParamState> state;  // null: none before
  };
  std::vector<PhasedStep*> phased_;
  std::vector<SavedState> states_;
  std::vector<std::pair<at::Tensor, at::Tensor>> values_;  // (tensor, its values before)
  std::unordered_set<const void*> saved_values_;
  std::unordered_set<const void*> saved_states_;  // parameters whose state is saved
  bool complete_ = true;
};

}  // namespace shampoo::detail
