#pragma once
/// Full sharding's optimizer on one rank (lossless mode): one optimizer from the factory over
/// every parameter the rank owns, across all units, in the user's param groups (its group g holds
/// the rank's parameters of optimizer()'s group g). DistributedShampoo then merges the groups into
/// virtual groups and computes the roots of all the rank's blocks batched. It steps any subset of
/// its parameters: a unit's as their gradients arrive during backward (DistributedShampoo in
/// phases, so that its step counts advance once per iteration), or all of them in one ordinary
/// step after backward. Its checkpoint pieces carry the wrapper's names for the parameters, so
/// that a checkpoint loads at any world size.

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "parallel/checkpoints/distributed_checkpoint.h"
#include "parallel/optimizers/capabilities.h"
#include "parallel/optimizers/optimizer_factory.h"
#include "parallel/optimizers/portable_checkpoint.h"

namespace shampoo::detail {

class UndoRecord;

/// Sets `target`'s options to a copy of `options` (param group `group` of the user's optimizer);
/// an error starting with `who` when they are of another type than the optimizer's.
void set_group_options(torch::optim::OptimizerParamGroup& target,
                       const torch::optim::OptimizerOptions& options, size_t group,
                       const std::string& who);

class RankOptimizer {
 public:
  /// `who` starts the errors (the wrapper's name).
  RankOptimizer(GroupOptimizerFactory factory, std::string who);

  /// The options of param group k of the user's optimizer.
  using GroupOptions = std::function<const torch::optim::OptimizerOptions&(size_t)>;
  /// Adds `params` (this rank's, holding their full values now) to param group `group`; the
  /// groups before it that the optimizer lacks are made first (empty), group k with
  /// options_of(k). The optimizer is made by the factory at the first parameter, over group 0
  /// (this rank's parameters of it, possibly none, with options_of(0)).
  void add(size_t group, const std::vector<at::Tensor>& params, const GroupOptions& options_of);
  /// The optimizer; null while the rank owns no parameter.
  torch::optim::Optimizer* get() const { return optimizer_.get(); }
  /// Copies `options` into param group `group` (nothing when the optimizer lacks it). An error
  /// when they are of another type than the optimizer's.
  void set_options(size_t group, const torch::optim::OptimizerOptions& options);

  /// Steps `params` (its parameters, their gradients set; optimizer_step.h). `in_pass`: one of
  /// the steps of an iteration during backward, ended by finish() or abort() (or by `undo`'s
  /// commit or undo, when given, which then holds the phased step it opened); else one ordinary
  /// step. With `undo`, a LibTorch optimizer's per-parameter states before the step are kept
  /// there.
  void step(const std::vector<at::Tensor>& params, bool in_pass, UndoRecord* undo);
  /// Ends the iteration's steps in backward: kept, or undone (the optimizer's state; the
  /// parameters' values are the wrapper's to put back). Nothing when none is open.
  void finish();
  void abort();

  /// The state of each of its parameters under the wrapper's name for it
  /// (detail::save_param_states: name/optimizer, and DistributedShampoo's name/block_<k>), so
  /// that a checkpoint loads at any world size and into any layout. An error for an optimizer
  /// whose per-parameter state is not known.
  void save_pieces(PieceWriter& pieces, const ParamNames& name_of) const;
  /// Reads every parameter's pieces; the returned function installs them (nothing changes
  /// unless it runs).
  std::function<void()> prepare_load(PieceReader& pieces, const ParamNames& name_of);

 private:
  GroupOptimizerFactory factory_;
  std::string who_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  Capabilities capabilities_;  // optimizer_'s, looked up when it is made
};

}  // namespace shampoo::detail
