#pragma once
/// DistributedShampoo in checkpoints (DistributedShampoo::Checkpoint, the object its
/// checkpoint_delegate() and portable_delegate() return; also its BlockStates). Internal: not
/// installed.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "parallel/optimizers/block_states.h"
#include "shampoo/distributed_shampoo.h"

namespace shampoo {

class DistributedShampoo::Checkpoint final : public DistributedCheckpointable,
                                             public PortableCheckpointable,
                                             public BlockStates {
 public:
  explicit Checkpoint(DistributedShampoo& owner) : owner_(&owner) {}
  /// After the optimizer moved: the object that owns this one now.
  void rebind(DistributedShampoo& owner) { owner_ = &owner; }

  std::string checkpoint_kind() const override { return "DistributedShampoo"; }
  c10::intrusive_ptr<c10d::ProcessGroup> checkpoint_group() const override;
  void sync_for_checkpoint() const override;
  void save_common(torch::serialize::OutputArchive& common) const override;
  void save_pieces(PieceWriter& pieces) const override;
  std::function<void()> prepare_load(torch::serialize::InputArchive& common,
                                     PieceReader& pieces) override;

  std::vector<const torch::optim::OptimizerParamGroup*> portable_groups() const override;
  int64_t portable_param_step(const at::Tensor& param) const override;
  void save_portable_pieces(PieceWriter& pieces, const PortableSave& save) const override;
  std::function<void()> prepare_portable_load(const PortableLoad& load) override;

  // BlockStates (full sharding: one optimizer per rank over the parameters it owns, checkpointed
  // per model parameter).
  void register_appended() override { owner_->sync_groups_and_state(); }
  void save_block_pieces(PieceWriter& pieces, const BlockPieceName& name_of) const override;
  std::function<void()> prepare_block_load(PieceReader& pieces, const BlockPieceName& name_of,
                                           std::vector<int64_t> group_steps,
                                           std::vector<double> group_lr_sums,
                                           std::optional<bool> eval_mode) override;
  bool in_eval_mode() const override { return !owner_->is_training(); }
  int64_t group_step(size_t group) const override { return owner_->group_step(group); }
  double group_lr_sum(size_t group) const override { return owner_->group_lr_sum(group); }

 private:
  DistributedShampoo* owner_;  // which owns this object
};

}  // namespace shampoo
