#pragma once
/// The checkpoint of a training run in --checkpoint-dir: one world-size-independent checkpoint
/// directory (parallel/checkpoints/distributed_checkpoint.h) that every rank writes together and
/// that a run at any number of ranks resumes from. Its MANIFEST is the commit point: a save killed
/// at any moment leaves the previous checkpoint complete.
///
/// The model, the optimizer, the GradScaler and the random generators are the library's
/// training checkpoint (shampoo/training_checkpoint.h: "model", "optimizer", "grad_scaler" in the
/// common part, "optimizer/...", "random/rank-R-of-W" pieces); the trainer adds:
///   signature   the run's identity: data set, model, optimizer, global batch, training
///               examples, seed (not the number of ranks)
///   progress    epochs and iterations done (a checkpoint may be taken within an epoch)
///   metrics     the loss metrics averaged over the ranks (those of the global batches)
///   metrics/rank-R-of-W (pieces)  rank R's own loss metrics, which a run at the same number of
///               ranks resumes bit for bit; at another number every rank starts from the
///               averaged ones

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
#include "parallel/checkpoints/distributed_checkpoint.h"
#include "shampoo/training_checkpoint.h"

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
    /// The run's optimizer; with --sharding full or hybrid the fully sharded model's optimizer(),
    /// whose checkpoint holds the model's parameters as row pieces. A checkpoint of any
    /// --sharding resumes under any other, at any number of ranks.
    torch::optim::Optimizer* optimizer = nullptr;
    LossMetrics* metrics = nullptr;
    TrainingProgress* progress = nullptr;
    /// --amp fp16's loss scaler (null without one). A checkpoint written with a scaler is
    /// resumed only with one, and the other way round.
    shampoo::GradScaler* scaler = nullptr;
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
  void sync_for_checkpoint() const override { run_.sync_for_checkpoint(); }
  void save_common(torch::serialize::OutputArchive& common) const override;
  void save_pieces(shampoo::PieceWriter& pieces) const override;
  std::function<void()> prepare_load(torch::serialize::InputArchive& common,
                                     shampoo::PieceReader& pieces) override;

 private:
  void check_signature(torch::serialize::InputArchive& common) const;

  std::filesystem::path dir_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  RunSignature signature_;
  State state_;
  shampoo::TrainingCheckpoint run_;  // the model, optimizer, scaler and generators
  int rank_ = 0;
  int world_size_ = 1;
  /// Filled by save() for save_common: the metrics averaged over the ranks.
  std::optional<LossMetrics> mean_metrics_;
};

/// The model's parameters and buffers (by name, on the CPU) in the trainer checkpoint committed
/// in `dir`; for tools and tests that compare runs.
std::vector<std::pair<std::string, at::Tensor>> read_checkpoint_model(
    const std::filesystem::path& dir);

}  // namespace shampoo::examples
