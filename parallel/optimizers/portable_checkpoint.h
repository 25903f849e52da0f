#pragma once
/// Optimizer state saved by parameter name, so that a whole-run checkpoint (TrainingCheckpoint,
/// shampoo/training_checkpoint.h) resumes under any layout: one plain process, data parallelism,
/// state and gradient sharding (ZeRO-1/2), optimizer-in-backward, full sharding, hybrid sharding,
/// at any number of ranks.
///
/// What is saved does not depend on the layout that saved it:
/// - the param groups the user gave (their options, serialized, and their parameters' names);
/// - per parameter, by the rank that keeps its state: "<name>/optimizer", the optimizer's kind
///   ("DistributedShampoo", or LibTorch's "Adam", "AdamW", "SGD", "Adagrad", "RMSprop") with a
///   LibTorch optimizer's state of the parameter, or DistributedShampoo's step count and lr sum
///   of its group; and for DistributedShampoo "<name>/block_<k>" per block, whichever rank owns
///   it (a block is the same whoever steps the whole parameter);
/// - the parameters' values: whole, or as row chunks that full sharding's ranks wrote;
/// - what only the layout that saved it reads back (its counters, a gradient accumulation in
///   progress), in an archive of its own.
/// A layout that loads reads the groups (matched by their parameters' names), the state of the
/// parameters it keeps on this rank, and its own archive when it saved the checkpoint itself.

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "parallel/checkpoints/distributed_checkpoint.h"

namespace shampoo {

/// The model's name of a parameter ("0.weight", "encoder.layers.3.bias"); an error for a tensor
/// that is not one of the model's parameters.
using ParamNames = std::function<std::string(const at::Tensor&)>;

/// The parameters' values a checkpoint holds, by name: whole, or in the row chunks that full
/// sharding's ranks wrote (chunk r holds rows [r·c, min((r+1)·c, rows)), c = ceil(rows / W)).
class SavedModel {
 public:
  struct Entry {
    std::vector<int64_t> sizes;
    at::ScalarType dtype = at::kFloat;
    bool parameter = true;  ///< else a buffer
    at::Tensor whole;       ///< undefined when the value is in row pieces
  };
  /// `pieces`: where the row chunks are ("model/<name>/rows_<r>"); `row_pieces` W: their number
  /// per parameter (0: every value is whole).
  SavedModel(std::map<std::string, Entry> entries, int64_t row_pieces, PieceReader pieces);

  bool contains(const std::string& name) const;
  /// The number of parameters and buffers.
  size_t size() const { return entries_.size(); }
  const Entry& entry(const std::string& name) const;
  /// Rows [first, first + count) of the parameter, as [count, numel / rows] (a 0-dim parameter
  /// has one row). An error naming the piece when it is missing or damaged.
  at::Tensor rows(const std::string& name, int64_t first, int64_t count) const;
  /// The whole value, in its saved shape and dtype.
  at::Tensor whole(const std::string& name) const;

  /// The piece key of chunk r of parameter `name`, and what a chunk holds.
  static std::string rows_key(const std::string& name, int64_t r);
  static torch::serialize::OutputArchive rows_piece(const at::Tensor& rows);

 private:
  std::map<std::string, Entry> entries_;
  int64_t row_pieces_ = 0;
  mutable PieceReader pieces_;
};

/// What a portable save hands the optimizer.
struct PortableSave {
  ParamNames names;
  /// This rank in the checkpoint's process group (every rank of the job).
  int rank = 0;
  /// The checkpoint's pieces outside the optimizer's, for the model's row chunks
  /// (SavedModel::rows_key).
  PieceWriter* model_pieces = nullptr;
};

/// What a portable load hands the optimizer.
struct PortableLoad {
  /// The checkpoint's pieces of the optimizer (prefix "optimizer/").
  PieceReader* pieces = nullptr;
  ParamNames names;
  /// Per param group of portable_groups(), in order: the options the saving run had for the
  /// group of the same parameters (serialized; read them into options of the group's type).
  std::vector<std::shared_ptr<torch::serialize::InputArchive>> group_options;
  /// Per parameter name: its step count in the saving run (ShardedParamState::step,
  /// ShampooParamState::step); absent when the saving layout did not count them.
  std::map<std::string, int64_t> param_steps;
  /// The completed steps of the saving run (its largest count).
  int64_t steps_taken = 0;
  /// The saving layout's own archive, when it was of this optimizer's checkpoint kind; null
  /// otherwise.
  std::shared_ptr<torch::serialize::InputArchive> layout;
  /// The parameters' saved values (full sharding reads its rows from it).
  const SavedModel* model = nullptr;
};

/// An optimizer, or a wrapper of optimizers, whose state a whole-run checkpoint saves by
/// parameter name. DistributedShampoo, ShardedOptimizer, InBackwardOptimizer and
/// FullyShardedDataParallel implement it; LibTorch's optimizers are saved through
/// detail::ReplicatedPortable.
class PortableCheckpointable {
 public:
  virtual ~PortableCheckpointable() = default;
  /// The param groups as the user sees them (their options and parameters), in order.
  virtual std::vector<const torch::optim::OptimizerParamGroup*> portable_groups() const = 0;
  /// Per parameter of the groups: its step count (-1 where this layout does not keep one).
  virtual int64_t portable_param_step(const at::Tensor& param) const = 0;
  /// The number of row pieces per parameter this optimizer writes for the model's values (full
  /// sharding: its shard group's size); 0: the checkpoint holds the values whole, and the
  /// checkpoint installs them (else the optimizer installs its rows from PortableLoad::model).
  virtual int64_t portable_row_pieces() const { return 0; }
  /// The full shape of a parameter (full sharding's module tensors are empty between
  /// iterations).
  virtual std::vector<int64_t> portable_full_sizes(const at::Tensor& param) const {
    return param.sizes().vec();
  }
  /// False while a gradient accumulation is in progress that only this layout can resume.
  virtual bool portable_between_steps() const { return true; }
  /// Whether its state is saved by parameter; false (an InBackwardOptimizer with an optimizer
  /// whose state is not known per parameter) saves the checkpoint in format 1.
  virtual bool portable_supported() const { return true; }
  /// This rank's pieces (no collectives): the state of the parameters it keeps (in `pieces`), and
  /// its rows (in save.model_pieces).
  virtual void save_portable_pieces(PieceWriter& pieces, const PortableSave& save) const = 0;
  /// What only the same layout reads back (rank 0; no collectives).
  virtual void save_portable_layout(torch::serialize::OutputArchive& /*layout*/) const {}
  /// Reads and checks everything this rank needs without changing anything; the returned
  /// function installs it and must not throw. No collectives.
  virtual std::function<void()> prepare_portable_load(const PortableLoad& load) = 0;
};

/// A PortableCheckpointable that is another one's face: every call goes to portable_delegate()
/// (FullyShardedDataParallel::optimizer(), which saves the whole wrapper).
class DelegatingPortable : public PortableCheckpointable {
 public:
  std::vector<const torch::optim::OptimizerParamGroup*> portable_groups() const override {
    return delegate().portable_groups();
  }
  int64_t portable_param_step(const at::Tensor& param) const override {
    return delegate().portable_param_step(param);
  }
  int64_t portable_row_pieces() const override { return delegate().portable_row_pieces(); }
  std::vector<int64_t> portable_full_sizes(const at::Tensor& param) const override {
    return delegate().portable_full_sizes(param);
  }
  bool portable_between_steps() const override { return delegate().portable_between_steps(); }
  bool portable_supported() const override { return delegate().portable_supported(); }
  void save_portable_pieces(PieceWriter& pieces, const PortableSave& save) const override {
    delegate().save_portable_pieces(pieces, save);
  }
  void save_portable_layout(torch::serialize::OutputArchive& layout) const override {
    delegate().save_portable_layout(layout);
  }
  std::function<void()> prepare_portable_load(const PortableLoad& load) override {
    return portable_delegate().prepare_portable_load(load);
  }

 protected:
  /// The object that saves and loads.
  virtual PortableCheckpointable& portable_delegate() const = 0;

 private:
  const PortableCheckpointable& delegate() const { return portable_delegate(); }
};

/// `optimizer` as a PortableCheckpointable, or null.
PortableCheckpointable* as_portable(torch::optim::Optimizer& optimizer);

namespace detail {

/// Writes the state that `optimizer` (DistributedShampoo, or one of LibTorch's SGD, Adam, AdamW,
/// Adagrad, RMSprop) keeps of its parameters, named by `names`: "<name>/optimizer" for each of
/// `heads` (parameters of the optimizer), and with DistributedShampoo "<name>/block_<k>" for
/// every block it holds. An error starting with `who` for another optimizer type.
void save_param_states(const torch::optim::Optimizer& optimizer,
                       const std::vector<at::Tensor>& heads, PieceWriter& pieces,
                       const ParamNames& names, const std::string& who);

/// Reads what save_param_states wrote for every parameter of `optimizer` (and the blocks it
/// holds); the returned function installs it: a LibTorch optimizer's per-parameter states, or
/// DistributedShampoo's blocks with each group's step count and lr sum (the largest of its
/// parameters', which differ only for parameters left out of some steps) and the eval mode. The
/// groups' options are left alone. An error names a parameter stepped by another kind there.
std::function<void()> prepare_param_states(torch::optim::Optimizer& optimizer, PieceReader& pieces,
                                           const ParamNames& names, const std::string& who);

/// Copies the serialized options into `group`'s options (of the same type) and returns them:
/// LibTorch's options deserialize every field.
std::unique_ptr<torch::optim::OptimizerOptions> read_options(
    const torch::optim::OptimizerParamGroup& group, torch::serialize::InputArchive& saved);

/// A LibTorch optimizer (SGD, Adam, AdamW, Adagrad, RMSprop) that every rank of the checkpoint
/// holds alike (one process, data parallelism): rank 0 writes its state, every rank reads it.
class ReplicatedPortable final : public PortableCheckpointable {
 public:
  explicit ReplicatedPortable(torch::optim::Optimizer& optimizer) : optimizer_(optimizer) {}
  std::vector<const torch::optim::OptimizerParamGroup*> portable_groups() const override;
  int64_t portable_param_step(const at::Tensor&) const override { return -1; }
  void save_portable_pieces(PieceWriter& pieces, const PortableSave& save) const override;
  std::function<void()> prepare_portable_load(const PortableLoad& load) override;

 private:
  torch::optim::Optimizer& optimizer_;
};

/// Whether save_param_states knows `optimizer`'s per-parameter state (DistributedShampoo, or
/// LibTorch's SGD, Adam, AdamW, Adagrad, RMSprop).
bool has_param_states(const torch::optim::Optimizer& optimizer);

/// The groups of `optimizer` as portable_groups() gives them.
std::vector<const torch::optim::OptimizerParamGroup*> groups_of(
    const torch::optim::Optimizer& optimizer);

}  // namespace detail
}  // namespace shampoo
