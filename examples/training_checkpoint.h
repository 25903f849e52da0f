#pragma once
/// Checkpoints of a training run, one file per rank and epoch in --checkpoint-dir:
///   rank<r>-of-<w>-epoch<e>.pt
/// holding the model (parameters and buffers), the optimizer (for DistributedShampoo the blocks
/// this rank owns), the loss metrics, the epoch and iteration reached, the default CPU
/// generator's state and a signature of the run (data set, model, optimizer, world size, batch,
/// seed). A file is written under a temporary name and renamed; once every rank has written
/// epoch e, each removes its files of earlier epochs. So after a crash at any point the latest
/// epoch that every rank has is complete, and a resumed run continues exactly where the
/// uninterrupted one would be (same losses, bit for bit).

#include <c10/core/Device.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "examples/loss_metrics.h"

namespace shampoo::examples {

/// How far training got: `epoch` epochs and `iteration` iterations finished.
struct TrainingProgress {
  int64_t epoch = 0;
  int64_t iteration = 0;
};

class CheckpointDir {
 public:
  /// `group` null = one process. `signature` must match for a checkpoint to be loaded. The
  /// tensors of a checkpoint are loaded onto `device` (the run's --device), whatever device
  /// wrote them.
  CheckpointDir(std::filesystem::path dir, c10::intrusive_ptr<c10d::ProcessGroup> group,
                std::string signature, c10::Device device = c10::Device(c10::kCPU));

  /// The latest epoch that every rank has a checkpoint of; 0 when there is none (collective).
  /// Throws c10::Error on every rank when the folder only holds checkpoints of a different
  /// world size, or when a rank lacks the file the others would resume from.
  int64_t find_resume_epoch() const;

  /// Loads this rank's checkpoint of `epoch`: the model first (call before building the
  /// optimizer and gradient synchronizer: Module::load replaces the parameters' storage).
  void load_model(int64_t epoch, torch::nn::Module& model) const;
  /// Then the optimizer, metrics, progress and random generator state; checks the signature.
  TrainingProgress load_training_state(int64_t epoch, torch::optim::Optimizer& optimizer,
                                       LossMetrics& metrics) const;

  /// Writes this rank's checkpoint after `progress.epoch` epochs (collective: after every rank
  /// has written it, the earlier epochs' files are removed).
  void save(const TrainingProgress& progress, const torch::nn::Module& model,
            const torch::optim::Optimizer& optimizer, const LossMetrics& metrics) const;

  std::filesystem::path file(int64_t epoch) const;

 private:
  /// Sum of `value` over the ranks.
  int64_t all_reduce_sum(int64_t value) const;
  int64_t all_reduce_min(int64_t value) const;
  /// The archive of `epoch`, its tensors on device_.
  torch::serialize::InputArchive read(int64_t epoch) const;

  std::filesystem::path dir_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::string signature_;
  c10::Device device_;
  int rank_ = 0;
  int world_size_ = 1;
};

}  // namespace shampoo::examples
