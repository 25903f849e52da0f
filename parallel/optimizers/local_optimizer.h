#pragma once
/// The optimizer a wrapper runs on one rank over the parameters that rank steps, in the user's
/// param groups (its group g holds the rank's parameters of the user's group g, possibly none):
/// ShardedOptimizer's local optimizer (ZeRO-1), full sharding's rank optimizer (lossless mode:
/// every parameter the rank owns, across all units) and its units' optimizers (local shards mode:
/// the unit's rows on this rank). It is made by the user's factory, gets the user's options
/// through set_options (the one place where a wrapper writes options into an optimizer it
/// drives), is stepped through optimizer_step.h, and saves its parameters' states under the
/// wrapper's names for them, so that a checkpoint loads at any world size.

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "parallel/checkpoints/distributed_checkpoint.h"
#include "parallel/optimizers/capabilities.h"
#include "parallel/optimizers/optimizer_factory.h"
#include "parallel/optimizers/optimizer_step.h"
#include "parallel/optimizers/portable_checkpoint.h"

namespace shampoo::detail {

class UndoRecord;

class LocalOptimizer {
 public:
  /// `who` starts the errors (the wrapper's name, "ShardedOptimizer: ").
  LocalOptimizer(GroupOptimizerFactory factory, std::string who);

  /// Makes the optimizer over `first` (group 0: the rank's parameters of it, possibly none, with
  /// the group's options when it has some); an error when the factory returns null or an
  /// optimizer whose groups differ from the one it was given.
  void make(torch::optim::OptimizerParamGroup first);
  /// The options of param group k of the user's optimizer.
  using GroupOptions = std::function<const torch::optim::OptimizerOptions&(size_t)>;
  /// Adds `params` (this rank's, holding their full values now) to param group `group`; the
  /// groups before it that the optimizer lacks are made first (empty), group k with
  /// options_of(k). Not made yet, it is made at the first parameter, over group 0 (this rank's
  /// parameters of it, possibly none, with options_of(0)).
  void add(size_t group, const std::vector<at::Tensor>& params, const GroupOptions& options_of);
  /// Makes the optimizer over no parameters, in `groups` empty groups (group k with
  /// options_of(k)), unless it is made: a rank that steps no parameter still holds one, so that
  /// options set on it reach the wrapper's groups on every rank as on the others.
  void make_empty(size_t groups, const GroupOptions& options_of);
  /// The optimizer; null until it is made.
  torch::optim::Optimizer* get() const { return optimizer_.get(); }
  /// Copies `options` into param group `group` (nothing when the optimizer lacks it). An error
  /// when they are of another type than the optimizer's.
  void set_options(size_t group, const torch::optim::OptimizerOptions& options);

  /// Steps `params` (its parameters, their gradients set): step_optimizer with its capabilities
  /// (optimizer_step.h), so that a step kInPass is ended by finish() or abort() (or by `undo`'s
  /// commit or undo, when given, which then holds the phased step it opened).
  void step(const std::vector<at::Tensor>& params, StepScope scope, UndoRecord* undo);
  /// Ends the pass's steps: kept, or undone (the optimizer's state; the parameters' values are
  /// the wrapper's to put back). Nothing when none is open.
  void finish();
  void abort();

  /// The state of each of its parameters under the wrapper's name for it
  /// (detail::save_param_states: name/optimizer, and DistributedShampoo's name/block_<k>), so
  /// that a checkpoint loads at any world size. An error for an optimizer whose per-parameter
  /// state is not known.
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
