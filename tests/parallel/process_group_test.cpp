// init_process_group_from_env: clear errors for missing or malformed launcher variables, a
// working one-rank group on loopback, and keys of their own for the workers of each elastic
// restart in the launcher's store.
#include <shampoo/shampoo.h>
#include <unistd.h>

#include <cstdlib>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "parallel/communication/collectives.h"
#include "support/test_support.h"

namespace {

class Environment : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                             "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"}) {
      unsetenv(name);
    }
  }
  static void set(const char* name, const std::string& value) { setenv(name, value.c_str(), 1); }
};

void expect_error_mentions(const std::vector<std::string>& fragments) {
  try {
    shampoo::init_process_group_from_env(std::chrono::seconds(5));
    ADD_FAILURE() << "expected an error mentioning " << fragments.front();
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    for (const auto& f : fragments) EXPECT_NE(message.find(f), std::string::npos) << message;
  }
}

TEST_F(Environment, MissingVariablesAreNamed) {
  expect_error_mentions({"WORLD_SIZE", "is not set", "torchrun"});
  set("WORLD_SIZE", "2");
  expect_error_mentions({"RANK", "is not set"});
  set("RANK", "0");
  expect_error_mentions({"MASTER_ADDR", "is not set"});
  set("MASTER_ADDR", "127.0.0.1");
  expect_error_mentions({"MASTER_PORT", "is not set"});
}

TEST_F(Environment, MalformedVariablesAreNamed) {
  set("WORLD_SIZE", "two");
  expect_error_mentions({"WORLD_SIZE='two'", "not an integer"});
  set("WORLD_SIZE", "2");
  set("RANK", "2");
  expect_error_mentions({"RANK='2'", "[0, 1]"});
  set("RANK", "0");
  set("LOCAL_RANK", "-1");
  set("MASTER_ADDR", "127.0.0.1");
  set("MASTER_PORT", "29400");
  expect_error_mentions({"LOCAL_RANK='-1'"});
  unsetenv("LOCAL_RANK");
  set("MASTER_PORT", "70000");
  expect_error_mentions({"MASTER_PORT='70000'", "65535"});
}

TEST_F(Environment, OneRankGroupOnLoopback) {
  set("WORLD_SIZE", "1");
  set("RANK", "0");
  set("LOCAL_RANK", "0");
  set("MASTER_ADDR", "127.0.0.1");
  set("MASTER_PORT", std::to_string(20000 + getpid() % 20000));
  auto group = shampoo::init_process_group_from_env(std::chrono::seconds(30));
  EXPECT_EQ(group->getRank(), 0);
  EXPECT_EQ(group->getSize(), 1);
  std::vector<at::Tensor> tensors{at::ones({4})};
  group->getBackend(c10::DeviceType::CPU)->allreduce(tensors)->wait();
  EXPECT_TRUE(at::equal(tensors[0], at::ones({4})));
  EXPECT_EQ(shampoo::local_rank_from_env(), 0);
}

/// Under torchrun the agent hosts the store and keeps it across restarts of the workers: a
/// restarted attempt that used the failed attempt's keys would find the addresses of dead ranks
/// (seen as "Gloo connectFullMesh failed ... Connection refused" after an elastic restart).
TEST_F(Environment, AgentStoreKeysBelongToTheAttempt) {
  c10d::TCPStoreOptions agent_options;
  agent_options.port = 0;  // any free port
  agent_options.isServer = true;
  agent_options.waitWorkers = false;
  auto agent_store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", agent_options);
  set("WORLD_SIZE", "1");
  set("RANK", "0");
  set("MASTER_ADDR", "127.0.0.1");
  set("MASTER_PORT", std::to_string(agent_store->getPort()));
  set("TORCHELASTIC_USE_AGENT_STORE", "True");
  set("TORCHELASTIC_RESTART_COUNT", "2");
  auto group = shampoo::init_process_group_from_env(std::chrono::seconds(30));
  std::vector<at::Tensor> tensors{at::ones({2})};
  group->getBackend(c10::DeviceType::CPU)->allreduce(tensors)->wait();
  const auto keys = agent_store->listKeys();
  EXPECT_FALSE(keys.empty());
  for (const auto& key : keys) EXPECT_EQ(key.rfind("/worker/attempt_2/", 0), 0u) << key;

  set("TORCHELASTIC_RESTART_COUNT", "again");
  expect_error_mentions({"TORCHELASTIC_RESTART_COUNT='again'", "not an integer"});
}

// Hybrid sharding's groups (make_hybrid_groups): shard groups of consecutive ranks, replica groups
// across them, each a working process group (an all-reduce of the global ranks gives the members'
// sum), at 2x2, 1x4 and 4x1; LOCAL_WORLD_SIZE by default; clear errors.
TEST(HybridGroups, ShardAndReplicaGroupsHoldTheRightRanks) {
  using Group = c10::intrusive_ptr<c10d::ProcessGroup>;
  const auto sum_of_ranks = [](const Group& group, int rank) {
    std::vector<at::Tensor> value{at::full({1}, static_cast<double>(rank), at::kDouble)};
    group->allreduce(value)->wait();
    return static_cast<int>(value[0].item<double>());
  };
  for (const int shard_size : {2, 1, 4}) {
    shampoo::testing::run_ranks(4, [&](int rank, const Group& group) {
      const auto hybrid = shampoo::make_hybrid_groups(group, shard_size);
      EXPECT_EQ(hybrid.shard_size, shard_size);
      EXPECT_EQ(hybrid.replicas, 4 / shard_size);
      EXPECT_EQ(hybrid.shard->getSize(), shard_size);
      EXPECT_EQ(hybrid.shard->getRank(), rank % shard_size);
      EXPECT_EQ(hybrid.replica->getSize(), 4 / shard_size);
      EXPECT_EQ(hybrid.replica->getRank(), rank / shard_size);
      const int first = rank / shard_size * shard_size;
      int shard_sum = 0;
      for (int r = first; r < first + shard_size; ++r) shard_sum += r;
      int replica_sum = 0;
      for (int r = rank % shard_size; r < 4; r += shard_size) replica_sum += r;
      EXPECT_EQ(sum_of_ranks(hybrid.shard, rank), shard_sum) << "rank " << rank;
      EXPECT_EQ(sum_of_ranks(hybrid.replica, rank), replica_sum) << "rank " << rank;
      // Every rank is past its last collective on the subgroups before any drops them: Gloo's
      // wait() can return on one rank while a peer is still finishing the same all-reduce, and
      // closing the connections then crashed the peer (1 run in 15 under load).
      shampoo::detail::gather_int64(*group, {1});
    });
  }
}

TEST(HybridGroups, LocalWorldSizeByDefaultAndClearErrors) {
  using Group = c10::intrusive_ptr<c10d::ProcessGroup>;
  setenv("LOCAL_WORLD_SIZE", "2", 1);
  shampoo::testing::run_ranks(4, [&](int, const Group& group) {
    const auto hybrid = shampoo::make_hybrid_groups(group);
    EXPECT_EQ(hybrid.shard_size, 2);
    EXPECT_EQ(hybrid.replicas, 2);
  });
  setenv("LOCAL_WORLD_SIZE", "two", 1);
  shampoo::testing::run_ranks(1, [&](int, const Group& group) {
    shampoo::testing::expect_error(
        [&] { shampoo::make_hybrid_groups(group); },
        {"make_hybrid_groups: LOCAL_WORLD_SIZE='two'", "not an integer"});
  });
  unsetenv("LOCAL_WORLD_SIZE");
  shampoo::testing::run_ranks(4, [&](int, const Group& group) {
    shampoo::testing::expect_error([&] { shampoo::make_hybrid_groups(group, 3); },
                                   {"shard_group_size: got 3", "divisor of the world size 4"});
    shampoo::testing::expect_error([&] { shampoo::make_hybrid_groups(group); },
                                   {"LOCAL_WORLD_SIZE", "not set"});
  });
}

}  // namespace
