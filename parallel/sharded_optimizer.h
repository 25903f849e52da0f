#pragma once
/// Optimizer-state sharding (ZeRO-1 / fairscale OSS) for any torch::optim optimizer: whole
/// parameters are assigned to the ranks, balanced by size; each rank keeps optimizer state only
/// for its own parameters and steps them; one AllGather of the updated parameters per step brings
/// every rank up to date. Gradients must be averaged before step() (GradientSynchronizer); with
/// GradientSynchronizer::shard_gradients(optimizer) each rank receives only the gradients of the
/// parameters it owns (ZeRO-2).
///
///   shampoo::ShardedOptimizer opt(model->parameters(), [](std::vector<torch::Tensor> p) {
///     return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-3)); }, group);

#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <memory>
#include <optional>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <unordered_map>
#include <vector>

#include "parallel/distributed_checkpoint.h"
#include "parallel/optimizer_factory.h"
#include "parallel/parameter_owners.h"
#include "parallel/phased_backward_step.h"

namespace shampoo {

class ShardedOptimizer : public torch::optim::Optimizer,
                         public DistributedCheckpointable,
                         public ParameterOwners,
                         public PhasedBackwardStep {
 public:
  /// All parameters must share one dtype and device (any floating dtype, any strided layout:
  /// a channels_last weight is gathered in its logical order and written back in its layout).
  /// Every rank passes the same parameters; an empty list is an error.
  ShardedOptimizer(std::vector<torch::Tensor> params, const OptimizerFactory& factory,
                   c10::intrusive_ptr<c10d::ProcessGroup> group);

  /// Steps this rank's parameters, then one AllGather of every rank's updated parameters.
  /// In backward (apply_optimizer_in_backward) the local steps run as gradients arrive and the
  /// AllGather once at the end of backward; step() is then an error.
  torch::Tensor step(LossClosure closure = nullptr) override;

  /// This rank's optimizer (over its own parameters): lr changes, schedulers.
  torch::optim::Optimizer& local_optimizer() { return *local_; }
  /// Owner rank of each parameter (in the order given).
  const std::vector<int>& owners() const { return owners_; }
  /// ParameterOwners (gradient sharding): the owner of `param`, nullopt when it is not one of
  /// this optimizer's.
  c10::intrusive_ptr<c10d::ProcessGroup> owners_group() const override { return group_; }
  std::optional<int> owner_of(const at::Tensor& param) const override;
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
  std::unordered_map<const void*, size_t> index_of_;  // TensorImpl -> position in params_
  std::vector<int64_t> offsets_;  // element offset of each parameter in its owner's segment
  int64_t segment_size_ = 0;
  at::Tensor send_;
  at::Tensor receive_;
  std::unique_ptr<torch::optim::Optimizer> local_;

  /// PhasedBackwardStep (optimizer-in-backward): the local steps of the owned parameters as
  /// their gradients arrive, the one AllGather at the end of backward (so that the collective
  /// never runs inside a gradient hook, in an order that differs between ranks). What a pass
  /// stepped is copied first (values and local state, LibTorch's optimizers only), so that an
  /// aborted pass (an error, or a GradScaler's overflow) leaves parameters and state as before.
  void set_in_backward(bool in_backward) override;
  bool backward_step_open() const override { return open_; }
  void begin_backward_step() override;
  void step_parameters(const std::vector<at::Tensor>& params) override;
  void finish_backward_step() override;
  void abort_backward_step() override;
  /// The owners' updated parameters to every rank.
  void all_gather();

  struct Saved {
    at::Tensor param;
    at::Tensor value;
    std::unique_ptr<torch::optim::OptimizerParamState> state;  // null: none before the pass
  };
  bool in_backward_ = false;
  bool open_ = false;
  std::vector<Saved> journal_;
};

}  // namespace shampoo
