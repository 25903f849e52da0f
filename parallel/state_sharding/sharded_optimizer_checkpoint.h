#pragma once
/// ShardedOptimizer in checkpoints (ShardedOptimizer::Checkpoint, the object its
/// checkpoint_delegate() and portable_delegate() return): world-size-independent checkpoint
/// directories and whole-run checkpoints by parameter name, and the per-parameter step counts
/// that torch::save holds too. Internal: not installed.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "parallel/state_sharding/sharded_optimizer.h"

namespace shampoo {

class ShardedOptimizer::Checkpoint final : public DistributedCheckpointable,
                                           public PortableCheckpointable {
 public:
  explicit Checkpoint(ShardedOptimizer& owner) : owner_(owner) {}

  std::string checkpoint_kind() const override { return "ShardedOptimizer"; }
  c10::intrusive_ptr<c10d::ProcessGroup> checkpoint_group() const override { return owner_.group_; }
  void sync_for_checkpoint() const override { sync_before_save(); }
  void save_common(torch::serialize::OutputArchive& common) const override;
  void save_pieces(PieceWriter& pieces) const override;
  std::function<void()> prepare_load(torch::serialize::InputArchive& common,
                                     PieceReader& pieces) override;

  std::vector<const torch::optim::OptimizerParamGroup*> portable_groups() const override;
  int64_t portable_param_step(const at::Tensor& param) const override;
  void save_portable_pieces(PieceWriter& pieces, const PortableSave& save) const override;
  void save_portable_layout(torch::serialize::OutputArchive& layout) const override;
  std::function<void()> prepare_portable_load(const PortableLoad& load) override;

  /// Registers what was appended and copies the options into the local optimizer, so that a
  /// save holds them (a save is const; these change only the optimizer's bookkeeping).
  void sync_before_save() const;
  /// Per parameter: completed steps since it was added (ShardedParamState::step).
  at::Tensor param_steps() const;
  /// (steps, per-parameter counts) of a checkpoint; nullopt for one written before they were
  /// kept. restore_param_steps installs them and writes state()'s entries.
  std::optional<std::pair<int64_t, std::vector<int64_t>>> read_param_steps(
      torch::serialize::InputArchive& archive, const char* who) const;
  void restore_param_steps(const std::optional<std::pair<int64_t, std::vector<int64_t>>>& saved);

 private:
  ShardedOptimizer& owner_;  // which owns this object (and does not move)
};

}  // namespace shampoo
