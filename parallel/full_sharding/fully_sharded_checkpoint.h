#pragma once
/// Full sharding in checkpoints (lossless mode): world-size-independent checkpoints of the
/// wrapper (fully_sharded_checkpoint.cpp) and whole-run checkpoints that any layout loads
/// (fully_sharded_portable.cpp). Internal: not installed.

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "parallel/full_sharding/fully_sharded_state.h"

namespace shampoo::detail {

/// Checkpoint format 2: one optimizer per rank, its state saved per parameter.
inline constexpr int64_t kFsdpCheckpointFormat = 2;

/// An integer entry of a checkpoint's archive; an error naming `key` when it is missing.
int64_t read_fsdp_int(torch::serialize::InputArchive& archive, const std::string& key);
/// An error in local-shard mode (its optimizer state depends on the world size).
void check_checkpointable(const FsdpState& s);
void save_fsdp_common(FsdpState& s, torch::serialize::OutputArchive& common);
void save_fsdp_pieces(FsdpState& s, PieceWriter& pieces);
std::function<void()> prepare_fsdp_load(FsdpState& s, torch::serialize::InputArchive& common,
                                        PieceReader& pieces);
/// A load's counters and the reduced gradients of an accumulation in progress (both formats).
void install_fsdp_progress(FsdpState& s, int64_t saved_passes, int64_t saved_steps,
                           int64_t saved_since,
                           const std::vector<std::pair<ParamSlot*, at::Tensor>>& accumulated);

/// Steps since `param` joined its group (-1 for a parameter in no group).
int64_t fsdp_portable_param_step(const FsdpState& s, const at::Tensor& param);
void save_fsdp_portable_pieces(FsdpState& s, PieceWriter& pieces, const PortableSave& save);
void save_fsdp_portable_layout(const FsdpState& s, torch::serialize::OutputArchive& layout);
std::function<void()> prepare_fsdp_portable_load(FsdpState& s, const PortableLoad& load);

}  // namespace shampoo::detail
