// init_process_group_from_env: clear errors for missing or malformed launcher variables, a
// working one-rank group on loopback, and keys of their own for the workers of each elastic
// restart in the launcher's store.
#include <shampoo/shampoo.h>
#include <unistd.h>

#include <cstdlib>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

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

}  // namespace
