#pragma once
/// The checkpoint of a training run in --checkpoint-dir: one world-size-independent checkpoint
/// directory (parallel/distributed_checkpoint.h) that every rank writes together and that a run
/// at any number of ranks resumes from. Its MANIFEST is the commit point: a save killed at any
/// moment leaves the previous checkpoint complete.
///
/// Common part (written by rank 0, read by every rank):
///   signature   the run's identity: data set, model, optimizer, global batch, training
///               examples, seed (not the number of ranks)
///   progress    epochs and iterations done (a checkpoint may be taken within an epoch)
///   metrics     the loss metrics averaged over the ranks (those of the global batches)
///   model       every parameter and buffer by name, on the CPU
///   rng         the default CPU generator's state (and the CUDA generator's on a CUDA run)
///   optimizer   a DistributedCheckpointable optimizer's common part (DistributedShampoo), or
///               the whole state of a torch::optim optimizer, which every rank holds alike
///   grad_scaler the GradScaler's state (--amp fp16 only; the same on every rank)
/// Pieces, each written by one rank:
///   optimizer/...          a DistributedCheckpointable optimizer's (DistributedShampoo: every
///                          block by the rank that owns it)
///   metrics/rank-R-of-W    rank R's own loss metrics, which a run at the same number of ranks
///                          resumes bit for bit; at another number every rank starts from the
///                          averaged ones

#include <c10/core/Device.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <utility>
#include <vector>

#include "amp/grad_scaler.h"
#include "examples/loss_metrics.h"
#include "parallel/distributed_checkpoint.h"

namespace shampoo::examples {

/// How far training got: `epoch` epochs and `iteration` iterations finished.
struct TrainingProgress {
  int64_t epoch = 0;
  int64_t iteration = 0;
};

/// The fields that identify a run, (name, value) in order. A checkpoint is resumed only by a run
/// whose fields are all equal; a difference is an error naming the field.
using RunSignature = std::vector<std::pair<std::string, std::string>>;

class TrainingCheckpoint : public shampoo::DistributedCheckpointable {
 public:
  /// The training state, owned by the trainer; loading writes into it.
  struct State {
    torch::nn::Module* model = nullptr;
    torch::optim::Optimizer* optimizer = nullptr;
    LossMetrics* metrics = nullptr;
    TrainingProgress* progress = nullptr;
    /// --amp fp16's loss scaler (null without one). A checkpoint written with a scaler is
    /// resumed only with one, and the other way round.
    shampoo::GradScaler* scaler = nullptr;
    /// --sharding full: the fully sharded model with its optimizers, in place of `optimizer`;
    /// the model's parameters are saved in its pieces (any number of ranks resumes them), the
    /// model's buffers in the common part.
    shampoo::DistributedCheckpointable* sharded = nullptr;
  };

  /// `group` null = one process. `device`: the run's (--device), for the optimizer's state and
  /// the CUDA generator.
  TrainingCheckpoint(std::filesystem::path dir, c10::intrusive_ptr<c10d::ProcessGroup> group,
                     RunSignature signature, State state,
                     c10::Device device = c10::Device(c10::kCPU));

  /// Whether `dir` holds a committed checkpoint (collective). Every rank must see the same:
  /// otherwise an error on every rank naming which ranks see one (the folder is not on a
  /// filesystem they share). A folder of the earlier per-rank format is an error too.
  bool exists() const;

  /// Loads the checkpoint into the state (collective; nothing changes on any rank unless every
  /// rank could read and check its part). Returns the number of ranks that saved it.
  int64_t load();

  /// Saves the state (collective); returns once the checkpoint is committed. With
  /// `average_buffers` the model's floating-point buffers (batch-norm statistics, which every
  /// rank gathers from its own batches) are saved as their mean over the ranks; without, as
  /// rank 0 has them (call it so when the ranks hold the same buffers).
  void save(bool average_buffers);

  const std::filesystem::path& dir() const { return dir_; }

  // DistributedCheckpointable.
  std::string checkpoint_kind() const override { return "cifar10_trainer"; }
  c10::intrusive_ptr<c10d::ProcessGroup> checkpoint_group() const override { return group_; }
  void save_common(torch::serialize::OutputArchive& common) const override;
  void save_pieces(shampoo::PieceWriter& pieces) const override;
  std::function<void()> prepare_load(torch::serialize::InputArchive& common,
                                     shampoo::PieceReader& pieces) override;

 private:
  /// What saves the optimizer part: the sharded model, or the optimizer when it is a
  /// DistributedCheckpointable (null: a replicated torch::optim optimizer).
  shampoo::DistributedCheckpointable* checkpointable() const;
  std::function<void()> prepare_optimizer(torch::serialize::InputArchive& common,
                                          shampoo::PieceReader& pieces);
  std::function<void()> prepare_model(torch::serialize::InputArchive& common) const;
  std::function<void()> prepare_scaler(torch::serialize::InputArchive& common) const;
  void check_signature(torch::serialize::InputArchive& common) const;

  std::filesystem::path dir_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  RunSignature signature_;
  State state_;
  c10::Device device_;
  int rank_ = 0;
  int world_size_ = 1;
  /// Filled by save() for save_common: the metrics and buffers averaged over the ranks.
  std::optional<LossMetrics> mean_metrics_;
  std::vector<at::Tensor> saved_buffers_;
};

/// The model's parameters and buffers (by name, on the CPU) in the trainer checkpoint committed
/// in `dir`; for tools and tests that compare runs.
std::vector<std::pair<std::string, at::Tensor>> read_checkpoint_model(
    const std::filesystem::path& dir);

}  // namespace shampoo::examples
