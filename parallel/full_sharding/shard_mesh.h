#pragma once
/// Full sharding's ranks and process groups (FSDP2's mesh): the shard group and its subgroups,
/// the replica group of hybrid sharding, and what a message or an agreement over them needs.
/// Internal: not installed.

#include <cstdint>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

namespace shampoo::detail {

inline constexpr const char* kFsdpWho = "FullyShardedDataParallel: ";

/// Waits for full sharding's collectives; `what` names them in the error.
void wait_all_of(std::vector<c10::intrusive_ptr<c10d::Work>>& works, const std::string& what,
                 int rank);
void wait_one(c10::intrusive_ptr<c10d::Work> work, const std::string& what, int rank);

struct ShardMesh {
  c10::intrusive_ptr<c10d::ProcessGroup> group;         // gathers; step() without overlap
  c10::intrusive_ptr<c10d::ProcessGroup> reduce_group;  // gradient reductions in backward
  c10::intrusive_ptr<c10d::ProcessGroup> step_group;    // the worker's all-to-alls of rows
  // Hybrid: the ranks that hold the same shards (FullyShardedOptions::replica_group); else null.
  c10::intrusive_ptr<c10d::ProcessGroup> replica_group;
  // Split across replicas with overlap: the worker's broadcasts and agreements across replicas
  // (else the replica group itself).
  c10::intrusive_ptr<c10d::ProcessGroup> replica_step_group;
  int rank = 0;
  int world = 1;       // ranks of the shard group (group)
  int replicas = 1;    // hybrid: ranks of the replica group
  int replica = 0;     // hybrid: this rank's replica (its rank in the replica group)
  bool split = false;  // the optimizer state split across more than one replica
  // The global rank of each rank of the shard group, when it was split from the world group
  // (make_hybrid_groups); empty otherwise. For messages.
  std::vector<int> global_ranks;

  /// The shard group's subgroups for reductions and (with overlap) the worker, named by `tag`.
  void make_groups(int64_t tag, bool overlap);
  /// Hybrid with overlap: the worker's own group over the replica group's ranks.
  void make_replica_step_group(bool overlap);
  /// "rank(s) 0, 1", or under hybrid sharding "global rank(s) 2, 3 (rank(s) 0, 1 of shard
  /// group 1)": ranks of the shard group as a message names them.
  std::string ranks_text(const std::vector<int>& ranks) const;
  /// The ranks of the shard group whose flag is set, after one AllGather of this rank's
  /// `failed` over `via`. Collective.
  std::vector<int> ranks_that_failed(c10d::ProcessGroup& via, bool failed) const;
  /// Hybrid: `flags` (this shard group's agreement, per item) or-ed over the replicas over
  /// `via`, so that a failure in one replica fails every replica alike. Unchanged without
  /// replicas.
  std::vector<int64_t> or_across_replicas(std::vector<int64_t> flags,
                                          const c10::intrusive_ptr<c10d::ProcessGroup>& via) const;
};

}  // namespace shampoo::detail
