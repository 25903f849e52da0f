#pragma once
/// Process groups on PyTorch's c10d: a TCPStore rendezvous and a c10d::ProcessGroup with Gloo for
/// CPU tensors and, when LibTorch has CUDA and a GPU is present, NCCL for CUDA tensors.

#include <chrono>
#include <cstdint>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

namespace shampoo {

/// Default timeout of collectives and of the rendezvous.
inline constexpr std::chrono::milliseconds kDefaultProcessGroupTimeout{std::chrono::minutes(5)};

/// Joins the process group described by torchrun's environment: RANK, WORLD_SIZE, LOCAL_RANK,
/// MASTER_ADDR, MASTER_PORT (and TORCHELASTIC_USE_AGENT_STORE: when "True" the launcher hosts the
/// store and every rank connects as a client, using keys of its own attempt,
/// TORCHELASTIC_RESTART_COUNT, so that workers restarted by an elastic agent never read the keys
/// of the attempt that failed; otherwise rank 0 hosts it). A missing or malformed
/// variable is an error naming it. `timeout` bounds the rendezvous and every collective: a rank
/// that dies makes the others fail with a timeout error instead of hanging.
c10::intrusive_ptr<c10d::ProcessGroup> init_process_group_from_env(
    std::chrono::milliseconds timeout = kDefaultProcessGroupTimeout);

/// The LOCAL_RANK of this process (0 when unset), e.g. to pick the CUDA device.
int local_rank_from_env();

/// Hybrid sharding's layout of the ranks (as FSDP2's HSDP): `replicas` shard groups of
/// `shard_size` consecutive ranks each (under torchrun by default one node's ranks, so that the
/// frequent collectives of sharding stay inside a node), and the replica groups across them
/// (the ranks at the same position of every shard group).
struct HybridGroups {
  /// This rank's shard group: global ranks [s * shard_size, (s + 1) * shard_size).
  c10::intrusive_ptr<c10d::ProcessGroup> shard;
  /// This rank's replica group: global ranks {p, p + shard_size, p + 2 * shard_size, ...}, p its
  /// position in its shard group.
  c10::intrusive_ptr<c10d::ProcessGroup> replica;
  int shard_size = 1;
  int replicas = 1;
};

/// Splits `group` (size W) into shard groups of `shard_group_size` consecutive ranks and the
/// replica groups across them. shard_group_size -1: LOCAL_WORLD_SIZE (torchrun's processes per
/// node), which must then be set. Errors: a size that does not divide W, or below 1. Every rank
/// of `group` calls it. Collective.
HybridGroups make_hybrid_groups(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                int64_t shard_group_size = -1);

namespace detail {

/// A process group over `store` (prefixed per backend) with Gloo for CPU tensors and, when
/// `with_nccl`, NCCL for CUDA tensors.
c10::intrusive_ptr<c10d::ProcessGroup> make_process_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, bool with_nccl);

/// The Gloo backend of c10d (parallel/communication/gloo_backend.cpp, the only file that includes
/// ProcessGroupGloo.hpp).
c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout);

/// The NCCL backend of c10d; an error when this build or LibTorch has no NCCL.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout);

/// The subgroup of consecutive ranks [first, first + size) that contains this rank, as a new
/// process group with the parent's backends (every rank of the parent calls this; each gets
/// its own subgroup). `tag` must be the same on every rank.
c10::intrusive_ptr<c10d::ProcessGroup> make_subgroup(
    const c10::intrusive_ptr<c10d::ProcessGroup>& parent, int first, int size,
    const std::string& tag, std::chrono::milliseconds timeout);

/// The same for any list of parent ranks (ascending, containing this rank; rank i of the
/// subgroup is ranks[i]). Every rank of the parent calls this with the list of its own subgroup.
c10::intrusive_ptr<c10d::ProcessGroup> make_subgroup_of(
    const c10::intrusive_ptr<c10d::ProcessGroup>& parent, const std::vector<int>& ranks,
    const std::string& tag, std::chrono::milliseconds timeout);

/// The description make_subgroup_of gives its groups, followed by their ranks' global numbers.
inline constexpr const char* kSubgroupDescription = "shampoo subgroup of global ranks ";
/// The global rank of each rank of `group` (the ranks of the outermost group it was split from,
/// by make_subgroup / make_subgroup_of, make_hybrid_groups), for messages; empty for a group that
/// was not split from another.
std::vector<int> global_ranks(const c10d::ProcessGroup& group);

/// The timeout of `group`'s CPU backend (kDefaultProcessGroupTimeout when it has none).
std::chrono::milliseconds group_timeout(c10d::ProcessGroup& group);

/// Whether `group` has an NCCL backend for CUDA tensors (a Gloo backend that also serves CUDA
/// tensors, as torch.distributed's Gloo groups do, does not count).
bool has_cuda_backend(const c10d::ProcessGroup& group);

}  // namespace detail
}  // namespace shampoo
