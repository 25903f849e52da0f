#pragma once
/// Full sharding in checkpoints (lossless mode): FsdpCheckpoint, the object that
/// FullyShardedDataParallel's checkpoint_delegate() and portable_delegate() return, saves and
/// loads world-size-independent checkpoints of the wrapper (fully_sharded_checkpoint.cpp) and
/// whole-run checkpoints that any layout loads (fully_sharded_portable.cpp). Internal: not
/// installed.

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "parallel/full_sharding/fully_sharded_state.h"

namespace shampoo::detail {

/// Checkpoint format 2: one optimizer per rank, its state saved per parameter.
inline constexpr int64_t kFsdpCheckpointFormat = 2;

class FsdpCheckpoint final : public DistributedCheckpointable, public PortableCheckpointable {
 public:
  explicit FsdpCheckpoint(FsdpState& state) : state_(state) {}

  // World-size-independent checkpoints (fully_sharded_checkpoint.cpp).
  std::string checkpoint_kind() const override { return "FullyShardedDataParallel"; }
  c10::intrusive_ptr<c10d::ProcessGroup> checkpoint_group() const override;
  /// Waits for the steps in flight, registers param groups added to optimizer() since, and
  /// copies options changed since the last step into the rank's optimizers.
  void sync_for_checkpoint() const override;
  int checkpoint_replicas() const override;
  int checkpoint_replica() const override;
  bool agree_across_replicas(bool ok) const override;
  bool every_replica_writes() const override;
  void save_common(torch::serialize::OutputArchive& common) const override;
  void save_pieces(PieceWriter& pieces) const override;
  std::function<void()> prepare_load(torch::serialize::InputArchive& common,
                                     PieceReader& pieces) override;

  // Whole-run checkpoints by parameter name (fully_sharded_portable.cpp).
  std::vector<const torch::optim::OptimizerParamGroup*> portable_groups() const override;
  int64_t portable_param_step(const at::Tensor& param) const override;
  int64_t portable_row_pieces() const override;
  std::vector<int64_t> portable_full_sizes(const at::Tensor& param) const override;
  bool portable_between_steps() const override;
  void save_portable_pieces(PieceWriter& pieces, const PortableSave& save) const override;
  void save_portable_layout(torch::serialize::OutputArchive& layout) const override;
  std::function<void()> prepare_portable_load(const PortableLoad& load) override;

 private:
  FsdpState& state_;  // the wrapper's, which outlives this object
};

/// An integer entry of a checkpoint's archive; an error naming `key` when it is missing.
int64_t read_fsdp_int(torch::serialize::InputArchive& archive, const std::string& key);
/// An error in local-shard mode (its optimizer state depends on the world size).
void check_checkpointable(const FsdpState& s);
/// A load's counters and the reduced gradients of an accumulation in progress (both formats).
void install_fsdp_progress(FsdpState& s, int64_t saved_passes, int64_t saved_steps,
                           int64_t saved_since,
                           const std::vector<std::pair<ParamSlot*, at::Tensor>>& accumulated);

}  // namespace shampoo::detail
