#include "parallel/communication/process_group.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <exception>
#include <numeric>
#include <sstream>
#include <string>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "parallel/communication/collectives.h"
#include "shampoo/config.h"

namespace shampoo {
namespace {

std::string required_env(const char* name, const char* meaning) {
  const char* value = std::getenv(name);
  TORCH_CHECK(value != nullptr && *value != '\0',
              "init_process_group_from_env: environment "
              "variable ",
              name, " (", meaning,
              ") is not set; launch with torchrun --no-python "
              "or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT");
  return value;
}

int64_t parse_int(const std::string& text, const char* name, int64_t min, int64_t max,
                  const char* caller = "init_process_group_from_env") {
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  TORCH_CHECK(errno == 0 && end != text.c_str() && *end == '\0' && value >= min && value <= max,
              caller, ": ", name, "='", text, "' is not an integer in [", min, ", ", max, "]");
  return value;
}

}  // namespace

int local_rank_from_env() {
  const char* value = std::getenv("LOCAL_RANK");
  if (value == nullptr || *value == '\0') return 0;
  return static_cast<int>(parse_int(value, "LOCAL_RANK", 0, 1 << 20));
}

HybridGroups make_hybrid_groups(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                int64_t shard_group_size) {
  TORCH_CHECK(group, "make_hybrid_groups: the process group is null");
  const int world = group->getSize();
  const int rank = group->getRank();
  int64_t size = shard_group_size;
  if (size == -1) {
    const char* local = std::getenv("LOCAL_WORLD_SIZE");
    TORCH_CHECK(local != nullptr && *local != '\0',
                "make_hybrid_groups: shard_group_size -1 means LOCAL_WORLD_SIZE (torchrun's "
                "processes per node), which is not set; pass the shard group size");
    size = parse_int(local, "LOCAL_WORLD_SIZE", 1, 1 << 20, "make_hybrid_groups");
  }
  TORCH_CHECK(size >= 1 && size <= world && world % size == 0,
              "make_hybrid_groups: shard_group_size: got ", size,
              ", expected a divisor of the "
              "world size ",
              world, " (shard groups of consecutive ranks, replicated ", "world / size times)");
  HybridGroups out;
  out.shard_size = static_cast<int>(size);
  out.replicas = world / out.shard_size;
  // One tag for both calls, equal on every rank: a ticket drawn by rank 0, shared by all.
  const int64_t ticket = rank == 0 ? group->getStore()->add("shampoo_hybrid_ticket", 1) : 0;
  const auto tag = "hybrid" + std::to_string(detail::gather_int64(*group, {ticket})[0][0]);
  const auto timeout = detail::group_timeout(*group);
  const int first = rank / out.shard_size * out.shard_size;
  std::vector<int> shard(static_cast<size_t>(out.shard_size));
  std::iota(shard.begin(), shard.end(), first);
  std::vector<int> replica;
  for (int r = rank % out.shard_size; r < world; r += out.shard_size) replica.push_back(r);
  out.shard = detail::make_subgroup_of(group, shard, tag + "_shard", timeout);
  out.replica = detail::make_subgroup_of(group, replica, tag + "_replica", timeout);
  // Every rank has finished connecting both groups before any returns (a rank that returned and
  // dropped its groups at once would close connections another rank is still opening).
  detail::gather_int64(*group, {1});
  return out;
}

c10::intrusive_ptr<c10d::ProcessGroup> init_process_group_from_env(
    std::chrono::milliseconds timeout) {
  TORCH_CHECK(timeout.count() > 0, "init_process_group_from_env: timeout must be positive, got ",
              timeout.count(), " ms");
  const auto world_size = static_cast<int>(
      parse_int(required_env("WORLD_SIZE", "number of processes"), "WORLD_SIZE", 1, 1 << 20));
  const auto rank = static_cast<int>(
      parse_int(required_env("RANK", "global rank of this process"), "RANK", 0, world_size - 1));
  local_rank_from_env();  // validates LOCAL_RANK when set
  const auto host = required_env("MASTER_ADDR", "address of the rendezvous store");
  const auto port = static_cast<uint16_t>(parse_int(
      required_env("MASTER_PORT", "port of the rendezvous store"), "MASTER_PORT", 1, 65535));
  const char* agent_store = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  const bool launcher_hosts_store = agent_store != nullptr && std::string(agent_store) == "True";
  const char* restart_value = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const std::string restart_count =
      restart_value != nullptr && *restart_value != '\0'
          ? std::to_string(parse_int(restart_value, "TORCHELASTIC_RESTART_COUNT", 0, 1 << 30))
          : "0";

  c10d::TCPStoreOptions store_options;
  store_options.port = port;
  store_options.isServer = !launcher_hosts_store && rank == 0;
  store_options.numWorkers = world_size;
  store_options.waitWorkers = false;
  store_options.timeout = timeout;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(host, store_options);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "init_process_group_from_env: cannot reach the rendezvous store at ", host,
                ":", port, " (MASTER_ADDR/MASTER_PORT) within ", timeout.count(),
                " ms: ", e.what());
  }
  if (launcher_hosts_store) {
    // The agent's store outlives the workers: after an elastic restart it still holds the keys
    // of the failed attempt (the dead ranks' addresses), so every attempt takes keys of its own,
    // under the prefix PyTorch's own env:// rendezvous uses.
    store = c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + restart_count, store);
  }
  // The process group's collectives use their own prefix, so the launcher's keys never clash.
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("shampoo", store);
  const bool with_nccl = SHAMPOO_WITH_CUDA && at::hasCUDA();
  return detail::make_process_group(prefixed, rank, world_size, timeout, with_nccl);
}

namespace detail {

c10::intrusive_ptr<c10d::ProcessGroup> make_process_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, bool with_nccl) {
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  using BackendType = c10d::ProcessGroup::BackendType;
  auto gloo =
      make_gloo_backend(c10::make_intrusive<c10d::PrefixStore>("gloo", store), rank, size, timeout);
  group->setBackend(c10::DeviceType::CPU, BackendType::GLOO, gloo);
  if (with_nccl) {
    auto nccl = make_nccl_backend(c10::make_intrusive<c10d::PrefixStore>("nccl", store), rank, size,
                                  timeout);
    group->setBackend(c10::DeviceType::CUDA, BackendType::NCCL, nccl);
  }
  group->setDefaultBackend(BackendType::GLOO);
  return group;
}

bool has_cuda_backend(const c10d::ProcessGroup& group) {
  for (const auto& device : group.getDeviceTypes()) {
    if (!device.is_cuda()) continue;
    // torch.distributed's Gloo groups serve CUDA tensors too (through Gloo): only an NCCL
    // backend for CUDA makes subgroups ask for NCCL (which a machine without GPUs refuses).
    auto backend = const_cast<c10d::ProcessGroup&>(group).getBackend(c10::DeviceType::CUDA);
    return backend && backend->getBackendName() == "nccl";
  }
  return false;
}

c10::intrusive_ptr<c10d::ProcessGroup> make_subgroup(
    const c10::intrusive_ptr<c10d::ProcessGroup>& parent, int first, int size,
    const std::string& tag, std::chrono::milliseconds timeout) {
  std::vector<int> ranks(static_cast<size_t>(size));
  std::iota(ranks.begin(), ranks.end(), first);
  return make_subgroup_of(parent, ranks, tag, timeout);
}

c10::intrusive_ptr<c10d::ProcessGroup> make_subgroup_of(
    const c10::intrusive_ptr<c10d::ProcessGroup>& parent, const std::vector<int>& ranks,
    const std::string& tag, std::chrono::milliseconds timeout) {
  const auto position = std::find(ranks.begin(), ranks.end(), parent->getRank());
  TORCH_INTERNAL_ASSERT(position != ranks.end() && std::is_sorted(ranks.begin(), ranks.end()));
  const auto parent_store = parent->getStore();
  TORCH_CHECK(parent_store,
              "subgroups need a process group made with a store "
              "(init_process_group_from_env or shampoo::detail::make_process_group)");
  // Subgroups of one call never share a first rank, so it names each one's keys.
  auto store = c10::make_intrusive<c10d::PrefixStore>(
      "subgroup_" + tag + "_" + std::to_string(ranks.front()), parent_store);
  auto group =
      make_process_group(store, static_cast<int>(position - ranks.begin()),
                         static_cast<int>(ranks.size()), timeout, has_cuda_backend(*parent));
  // The ranks it holds, as the outermost group numbers them (for messages that name ranks).
  const auto above = global_ranks(*parent);
  std::string description = kSubgroupDescription;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const int rank = above.empty() ? ranks[i] : above.at(static_cast<size_t>(ranks[i]));
    if (i > 0) description += ',';
    description += std::to_string(rank);
  }
  group->setGroupDesc(description);
  return group;
}

std::vector<int> global_ranks(const c10d::ProcessGroup& group) {
  const auto& description = group.getGroupDesc();
  const std::string marker = kSubgroupDescription;
  if (description.rfind(marker, 0) != 0) return {};
  std::vector<int> out;
  std::istringstream in(description.substr(marker.size()));
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::stoi(item));
  return out;
}

std::chrono::milliseconds group_timeout(c10d::ProcessGroup& group) {
  try {
    return group.getBackend(c10::DeviceType::CPU)->getBackendOptions()->timeout;
  } catch (const c10::Error&) {
    return kDefaultProcessGroupTimeout;
  }
}

}  // namespace detail
}  // namespace shampoo
