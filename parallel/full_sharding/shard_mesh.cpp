// Full sharding's ranks and process groups: subgroups, agreements, ranks in messages.
#include "parallel/full_sharding/shard_mesh.h"

#include <sstream>

#include "parallel/communication/collectives.h"
#include "parallel/communication/process_group.h"

namespace shampoo::detail {

void wait_all_of(std::vector<c10::intrusive_ptr<c10d::Work>>& works, const std::string& what,
                 int rank) {
  wait_collectives(works, kFsdpWho, what, rank);
}

void wait_one(c10::intrusive_ptr<c10d::Work> work, const std::string& what, int rank) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works{std::move(work)};
  wait_all_of(works, what, rank);
}

void ShardMesh::make_groups(int64_t tag, bool overlap) {
  reduce_group = group;
  step_group = group;
  const auto timeout = group_timeout(*group);
  const auto name = "fsdp_" + std::to_string(tag);
  if (world == 1) {
    // An NCCL communicator must not be used by two threads at once (NCCL's thread-safety
    // rule), and with overlap_step the worker's all-to-alls run while backward gathers on the
    // autograd thread: over CUDA the worker gets a communicator of its own at world 1 too (seen
    // on an H200 without it: "unhandled system error" on the gathers, 2 runs in 24).
    if (overlap && has_cuda_backend(*group) && group->getStore()) {
      step_group = make_subgroup(group, 0, 1, name + "_step", timeout);
    }
    return;
  }
  reduce_group = make_subgroup(group, 0, world, name + "_reduce", timeout);
  if (overlap) step_group = make_subgroup(group, 0, world, name + "_step", timeout);
}

/// The worker's group over the replica group's ranks is for its agreements (and, split,
/// broadcasts) across replicas while the main thread reduces across them; it is named by a tag
/// drawn over the replica group (its members come from different shard groups).
void ShardMesh::make_replica_step_group(bool overlap) {
  replica_step_group = replica_group;
  if (replicas == 1 || !overlap) return;
  const int64_t ticket =
      replica == 0 ? replica_group->getStore()->add("shampoo_fsdp_replica_ticket", 1) : 0;
  const auto tag = gather_int64(*replica_group, {ticket})[0][0];
  replica_step_group =
      make_subgroup(replica_group, 0, replicas, "fsdp_replica_step_" + std::to_string(tag),
                    group_timeout(*replica_group));
}

std::string ShardMesh::ranks_text(const std::vector<int>& ranks) const {
  const auto list = [&](const std::vector<int>& values) {
    std::ostringstream out;
    for (size_t k = 0; k < values.size(); ++k) out << (k ? ", " : "") << values[k];
    return out.str();
  };
  const bool hybrid = replicas > 1;
  std::ostringstream out;
  if (!global_ranks.empty()) {
    std::vector<int> global;
    for (const int r : ranks) global.push_back(global_ranks.at(static_cast<size_t>(r)));
    out << "global rank(s) " << list(global);
    if (hybrid) out << " (rank(s) " << list(ranks) << " of shard group " << replica << ")";
  } else {
    out << "rank(s) " << list(ranks);
    if (hybrid) out << " of shard group " << replica;
  }
  return out.str();
}

std::vector<int> ShardMesh::ranks_that_failed(c10d::ProcessGroup& via, bool failed) const {
  const auto flags = gather_int64(via, {failed ? 1 : 0});
  std::vector<int> out;
  for (int r = 0; r < world; ++r) {
    if (flags[r][0] != 0) out.push_back(r);
  }
  return out;
}

std::vector<int64_t> ShardMesh::or_across_replicas(
    std::vector<int64_t> flags, const c10::intrusive_ptr<c10d::ProcessGroup>& via) const {
  if (replicas == 1) return flags;
  for (const auto& row : gather_int64(*via, flags)) {
    for (size_t i = 0; i < flags.size(); ++i) flags[i] = flags[i] != 0 || row[i] != 0 ? 1 : 0;
  }
  return flags;
}

}  // namespace shampoo::detail
