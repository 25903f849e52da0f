#pragma once
/// Optimizer-state sharding (ZeRO-1 / fairscale OSS) for any torch::optim optimizer: whole
/// parameters are assigned to the ranks, balanced by size; each rank keeps optimizer state only
/// for its own parameters and steps them; one AllGather of the updated parameters per step brings
/// every rank up to date. Gradients must be averaged before step() (GradientSynchronizer).
///
///   shampoo::ShardedOptimizer opt(model->parameters(), [](std::vector<torch::Tensor> p) {
///     return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-3)); }, group);

#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <memory>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "parallel/distributed_checkpoint.h"
#include "parallel/optimizer_factory.h"

namespace shampoo {

class ShardedOptimizer : public torch::optim::Optimizer, public DistributedCheckpointable {
 public:
  /// All parameters must share one dtype and device. Every rank passes the same parameters.
  ShardedOptimizer(std::vector<torch::Tensor> params, const OptimizerFactory& factory,
                   c10::intrusive_ptr<c10d::ProcessGroup> group);

  /// Steps this rank's parameters, then one AllGather of every rank's updated parameters.
  torch::Tensor step(LossClosure closure = nullptr) override;

  /// This rank's optimizer (over its own parameters): lr changes, schedulers.
  torch::optim::Optimizer& local_optimizer() { return *local_; }
  /// Owner rank of each parameter (in the order given).
  const std::vector<int>& owners() const { return owners_; }
  /// Bytes of optimizer state on this rank (-1 when the optimizer type is not one of LibTorch's).
  int64_t state_bytes() const { return optimizer_state_bytes(*local_); }

  /// Each rank saves its own optimizer state; loading needs the same world size and rank.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  /// World-size-independent checkpoints (save_distributed_checkpoint): one piece per parameter
  /// ("param/<i>", its state in the local optimizer) written by its owner, and the local
  /// optimizer's options once; loading at any world size gives each rank the states of the
  /// parameters it owns now. The local optimizer must be LibTorch's SGD, Adam, AdamW, Adagrad
  /// or RMSprop (whose per-parameter state types are known).
  std::string checkpoint_kind() const override { return "ShardedOptimizer"; }
  c10::intrusive_ptr<c10d::ProcessGroup> checkpoint_group() const override { return group_; }
  void save_common(torch::serialize::OutputArchive& common) const override;
  void save_pieces(PieceWriter& pieces) const override;
  std::function<void()> prepare_load(torch::serialize::InputArchive& common,
                                     PieceReader& pieces) override;

 private:
  std::vector<torch::Tensor> params_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::vector<int> owners_;
  std::vector<int64_t> offsets_;  // element offset of each parameter in its owner's segment
  int64_t segment_size_ = 0;
  at::Tensor send_;
  at::Tensor receive_;
  std::unique_ptr<torch::optim::Optimizer> local_;
};

}  // namespace shampoo
