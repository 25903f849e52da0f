#pragma once
/// The Distributor: which rank owns (computes) each block, and how the owners' results reach
/// every rank. Blocks belong to communication units: with merged param groups one unit holds
/// every block (one AllGather per step); unmerged, one unit per virtual group.
///
/// Layout of a unit's AllGather buffer (communication dtype): one segment per rank of the trainer
/// group, padded to the largest; segment r = [status of rank r (1 = its step failed), a flag per
/// block owned by r (1 = updated this step)] followed by those blocks' values, in block order.
/// Owners write their blocks' updates (or updated parameters) and flags into their segment; the
/// AllGather is issued by every rank every step, also by a rank with nothing to send or whose
/// step failed, so ranks never wait on each other forever and all learn of a failure at once.

#include <ATen/ATen.h>

#include <cstdint>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "distributor/block_plan.h"
#include "parallel/communication/ownership_plan.h"

namespace shampoo::detail {

struct DistributorConfig {
  c10::intrusive_ptr<c10d::ProcessGroup> process_group;  ///< null = single process
  at::ScalarType communication_dtype = at::kFloat;
  int64_t num_trainers_per_group = -1;
  bool communicate_params = false;
  /// Every block of a parameter gets the same owner (DistributedOptions::shard_by_parameter).
  bool shard_by_parameter = false;
};

/// A block as the distributor sees it.
struct DistributedBlock {
  BlockId id;
  int64_t numel = 0;
  int64_t unit = 0;
  at::Device device = at::kCPU;
};

class Distributor {
 public:
  explicit Distributor(DistributorConfig config);

  /// True when a process group with more than zero peers is used (even of size 1).
  bool distributed() const { return static_cast<bool>(group_); }
  /// Rank and size within this rank's trainer group (0 and 1 for a single process).
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  /// Global rank and size of the whole process group.
  int global_rank() const { return global_rank_; }
  int global_world_size() const { return global_world_size_; }
  bool communicate_params() const { return config_.communicate_params; }
  bool shard_by_parameter() const { return config_.shard_by_parameter; }
  at::ScalarType communication_dtype() const { return config_.communication_dtype; }

  /// Registers blocks (in order; indices continue the earlier ones) and assigns their owners,
  /// continuing the loads of earlier blocks so existing assignments never move (with
  /// shard_by_parameter, whole parameters: the blocks of one parameter, all new in one call,
  /// share an owner). Rebuilds the buffer layouts. Returns the owner (trainer-group rank) of
  /// each new block.
  std::vector<int> add_blocks(const std::vector<DistributedBlock>& blocks);

  int owner(int64_t block) const { return plan_.owner_of(item_of_[block]); }
  bool owns(int64_t block) const { return owner(block) == rank_; }
  int64_t num_blocks() const { return static_cast<int64_t>(blocks_.size()); }

  /// Starts a step: clears this rank's flags. Call before writing slots.
  void begin_step();
  /// The slot of an owned block in this rank's segment ([numel], communication dtype).
  at::Tensor slot(int64_t block);
  /// Marks an owned block as updated this step.
  void mark_updated(int64_t block);
  /// One AllGather per unit. `failed`: this rank's step failed (its status word says so, its
  /// updates are not applied by anyone). Returns the number of collectives issued.
  int64_t exchange(bool failed = false);
  /// What a rank tells the others before its step changes any state (agree()).
  enum class Readiness : int64_t { kReady = 0, kNeedsJournal = 1, kFailed = 2 };
  /// What agree() learned: per trainer-group rank, its readiness and the values it passed.
  struct Agreement {
    std::vector<Readiness> readiness;
    std::vector<std::vector<int64_t>> values;
  };
  /// One all-reduce over the trainer group, before any state changes: every rank's readiness and
  /// a few `values` (every rank passes as many: fingerprints of what must be equal at this
  /// step). Every rank calls it once in a step that agrees, also a rank whose step already
  /// failed, and then no exchange() follows. No collective in a single process.
  Agreement agree(Readiness mine, const std::vector<int64_t>& values);
  /// After exchange(): the trainer-group ranks whose step failed (ascending; empty when none).
  const std::vector<int>& failed_ranks() const { return failed_ranks_; }
  /// After exchange(): whether the owner of `block` updated it, and its values ([numel]).
  bool received_updated(int64_t block) const;
  at::Tensor received(int64_t block) const;

  /// AllGathers a few int64 values from every rank of the whole process group (not only the
  /// trainer group): result[r] = ranks r's values. All ranks must pass the same count.
  std::vector<std::vector<int64_t>> gather_from_all_ranks(const std::vector<int64_t>& values);

  /// Bytes this rank sends per step (all units) and receives.
  int64_t bytes_sent_per_step() const;
  int64_t bytes_received_per_step() const;

 private:
  struct Unit {
    std::vector<int64_t> blocks;  // global block indices, ascending
    OwnerMajorLayout layout;      // of `blocks` (with status and flags)
    at::Tensor send;              // [segment_size]
    at::Tensor receive;           // [world_size * segment_size]
  };
  void layout_unit(Unit& unit);

  DistributorConfig config_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;  // trainer group (subgroup or the whole group)
  int rank_ = 0;
  int world_size_ = 1;
  int global_rank_ = 0;
  int global_world_size_ = 1;
  std::vector<DistributedBlock> blocks_;
  // The owners, one plan over every unit, so that many small units (unmerged groups) spread over
  // the ranks instead of all starting on rank 0. Blocks are added to it unit by unit.
  OwnershipPlan plan_;
  std::vector<int64_t> item_of_;   // per block: its item in plan_
  std::vector<int64_t> position_;  // per block: its index in its unit's layout
  std::vector<Unit> units_;
  std::vector<bool> updated_;           // this rank's blocks updated this step
  std::vector<bool> received_updated_;  // every block, after exchange()
  std::vector<int> failed_ranks_;       // after exchange()
};

}  // namespace shampoo::detail
