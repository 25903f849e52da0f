#pragma once
/// A whole training run in one checkpoint: the model's parameters and buffers, the optimizer (any
/// of this library's, or one of LibTorch's), the GradScaler, the random generators and the
/// user's values (step, epoch, position in the data), in one atomic generation of a
/// world-size-independent checkpoint directory (parallel/checkpoints/distributed_checkpoint.h).
///
/// It resumes under any layout and at any number of ranks, whichever layout wrote it: one
/// process, data parallelism, state and gradient sharding (ZeRO-1/2), optimizer-in-backward,
/// full sharding, hybrid sharding. The optimizer state is saved by the model's parameter names
/// (parallel/optimizers/portable_checkpoint.h): the user's param groups with their options, and
/// each parameter's state (DistributedShampoo's blocks and step counts, or the state of LibTorch's
/// SGD, Adam, AdamW, Adagrad, RMSprop). The resuming run must build the same model, the same
/// optimizer for every parameter and the same param groups (the same parameters in each; a
/// difference is an error naming it); what only one layout can resume (full sharding's
/// gradient accumulation in progress) is an error elsewhere. An optimizer of another type
/// (LBFGS, one of the user's) is saved whole by rank 0, in the form of format 1, which only the
/// same layout loads; checkpoints of format 1 (before 2026-12-02) load into the layout that
/// wrote them.
///
///   std::map<std::string, c10::IValue> values{{"step", int64_t{0}}, {"epoch", int64_t{0}}};
///   shampoo::TrainingState state{model.get(), &optimizer, &scaler, &values};
///   if (shampoo::load_training_checkpoint("ckpt", state, group)) {
///     step = values["step"].toInt();                    // resumed
///   }
///   ...
///   values["step"] = step;
///   shampoo::save_training_checkpoint("ckpt", state, group);   // every rank
///
/// Layout of the common part (rank 0): "format" (2), "model" (every parameter and buffer by name,
/// its shape and dtype, its value on the CPU; under full sharding the parameters' values are the
/// pieces "model/<name>/rows_<r>"), "optimizer" (its kind, the param groups by parameter name
/// with their options and step counts, the layout's own archive), "grad_scaler", "values".
/// Pieces: "optimizer/<name>/..." (each parameter's state, by the rank that keeps it),
/// "random/rank-R-of-W" (each rank's generators), and with TrainingState::gradients
/// "gradients/rank-R-of-W".

#include <c10/core/Device.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <unordered_map>
#include <utility>
#include <vector>

#include "amp/grad_scaler.h"
#include "parallel/checkpoints/distributed_checkpoint.h"
#include "parallel/optimizers/portable_checkpoint.h"

namespace shampoo {

/// What a training checkpoint holds; the pointers are the run's own objects (loading writes into
/// them). `model` and `optimizer` are required.
struct TrainingState {
  /// Its parameters (in place: the optimizer and a GradientSynchronizer hold them) and buffers.
  torch::nn::Module* model = nullptr;
  /// DistributedShampoo, ShardedOptimizer, InBackwardOptimizer, FullyShardedDataParallel's
  /// optimizer() (which also holds the model's parameters), or a LibTorch optimizer (saved by
  /// rank 0: under data parallelism every rank holds the same state).
  torch::optim::Optimizer* optimizer = nullptr;
  /// The loss scaler (null: none). A checkpoint with a scaler loads only with one, and the other
  /// way round.
  GradScaler* scaler = nullptr;
  /// The user's values by name (ints, doubles, bools, strings, tensors); loading replaces the
  /// map's contents with the saved ones. Null: none.
  std::map<std::string, c10::IValue>* values = nullptr;
  /// Saves each rank's default CPU generator (and `device`'s, for CUDA) and restores them when
  /// the run resumes at the same number of ranks; at another number every rank takes rank 0's
  /// (the generators of a run seeded alike on every rank).
  bool random_state = true;
  /// Saves each rank's parameter gradients too (those defined), for a checkpoint taken in the
  /// middle of a gradient accumulation that the run accumulates itself (data parallelism with
  /// GradientSynchronizer::NoSync, one process); resumable at the same number of ranks only,
  /// since the local sums differ per rank. (FullyShardedDataParallel keeps what it accumulated
  /// in its own pieces; an InBackwardOptimizer refuses a save mid-accumulation.)
  bool gradients = false;
  /// Where the optimizer's state and the random generator live (CUDA runs).
  c10::Device device = c10::Device(c10::kCPU);
};

/// The training state as a DistributedCheckpointable: what save_training_checkpoint writes, for
/// code that nests it in a checkpoint of its own (the example trainer adds its run's signature
/// and metrics).
class TrainingCheckpoint : public DistributedCheckpointable {
 public:
  /// `group`: the ranks that train together (null: one process).
  TrainingCheckpoint(TrainingState state, c10::intrusive_ptr<c10d::ProcessGroup> group);

  /// Floating-point buffers to save in place of the model's own (e.g. their mean over the
  /// ranks); empty: the model's. Cleared by the next save.
  void set_saved_buffers(std::vector<at::Tensor> buffers) { saved_buffers_ = std::move(buffers); }

  std::string checkpoint_kind() const override { return "TrainingCheckpoint"; }
  c10::intrusive_ptr<c10d::ProcessGroup> checkpoint_group() const override { return group_; }
  void sync_for_checkpoint() const override;
  void save_common(torch::serialize::OutputArchive& common) const override;
  void save_pieces(PieceWriter& pieces) const override;
  std::function<void()> prepare_load(torch::serialize::InputArchive& common,
                                     PieceReader& pieces) override;

 private:
  /// The optimizer's own checkpointing, or null for a LibTorch optimizer.
  DistributedCheckpointable* checkpointable() const;
  /// The optimizer saved by parameter name (a LibTorch optimizer through an adapter); null for
  /// an optimizer whose per-parameter state is not known (saved in format 1).
  PortableCheckpointable* portable() const;
  /// The optimizer's checkpoint kind ("replicated" for a LibTorch optimizer).
  /// The model's name of a parameter; an error for a tensor that is not one.
  std::string name_of(const at::Tensor& param) const;
  /// The parameters (none when `with_parameters` is false) and buffers, by name.
  std::vector<std::pair<std::string, at::Tensor>> named_state(bool with_parameters) const;

  // format 2: by parameter name (training_checkpoint.cpp)
  void save_model(torch::serialize::OutputArchive& common) const;
  void save_optimizer(torch::serialize::OutputArchive& common) const;
  std::function<void()> prepare_model(const SavedModel& saved) const;
  std::function<void()> prepare_optimizer(torch::serialize::InputArchive& common, PieceReader& pieces,
                                          const std::shared_ptr<SavedModel>& model) const;
  // format 1: the optimizer in its layout's own form (training_checkpoint_by_layout.cpp)
  void save_common_by_layout(torch::serialize::OutputArchive& common) const;
  void save_pieces_by_layout(PieceWriter& pieces) const;
  std::function<void()> prepare_model_by_layout(torch::serialize::InputArchive& common) const;
  std::function<void()> prepare_optimizer_by_layout(torch::serialize::InputArchive& common,
                                                    PieceReader& pieces) const;
  std::function<void()> prepare_scaler(torch::serialize::InputArchive& common) const;
  std::function<void()> prepare_values(torch::serialize::InputArchive& common) const;
  std::function<void()> prepare_rank_pieces(torch::serialize::InputArchive& common,
                                            PieceReader& pieces) const;

  /// The generators and gradients of each rank, the scaler and the values (both formats).
  void save_run_common(torch::serialize::OutputArchive& common) const;
  void save_rank_pieces(PieceWriter& pieces) const;

  TrainingState state_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int rank_ = 0;
  int world_size_ = 1;
  std::vector<at::Tensor> saved_buffers_;
  std::unique_ptr<detail::ReplicatedPortable> replicated_;  // a LibTorch optimizer's adapter
  std::unordered_map<const c10::TensorImpl*, std::string> names_;
};

/// Saves the training run into the checkpoint directory `dir` (a new generation, committed
/// atomically). Collective over `group` (null: one process): every rank calls it.
void save_training_checkpoint(const std::filesystem::path& dir, const TrainingState& state,
                              c10::intrusive_ptr<c10d::ProcessGroup> group = {});

/// Loads the run saved in `dir` into `state`, whatever the number of ranks that saved it;
/// returns false, changing nothing, when `dir` holds no committed checkpoint (a fresh start).
/// Nothing changes on any rank unless every rank read and checked its part; a checkpoint of
/// another model, optimizer kind or scaler setting is an error naming the difference.
/// Collective.
bool load_training_checkpoint(const std::filesystem::path& dir, const TrainingState& state,
                              c10::intrusive_ptr<c10d::ProcessGroup> group = {});

/// The model's parameters and buffers (by name, on the CPU, whole) in the training checkpoint
/// committed in `dir` (also one nested in a checkpoint of its own kind, as the example
/// trainer's), whichever layout wrote it (full sharding's rows are put together), without a
/// process group. (A checkpoint of format 1 written under full sharding holds the buffers only.)
std::vector<std::pair<std::string, at::Tensor>> read_training_checkpoint_model(
    const std::filesystem::path& dir);

/// Writes the model of the training checkpoint in `dir` as torch::save(model, path) writes the
/// model, so that the plain model loads it with torch::load(model, path): a model file out of a
/// checkpoint of any layout (full or hybrid sharding included), in one process, without the
/// model's code. Atomic (a temporary file of this process, renamed).
void save_training_checkpoint_model(const std::filesystem::path& dir,
                                    const std::filesystem::path& path);

}  // namespace shampoo
