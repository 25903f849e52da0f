// Atomic saves under SIGKILL: checkpoint_writer saves a world-size-independent checkpoint after
// every step and is killed during a save, at known points (just before each file) and at random
// times. Every time, the checkpoint directory still loads, and resuming from it continues exactly
// as the uninterrupted run (bit for bit).
#include <fcntl.h>
#include <shampoo/shampoo.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <random>
#include <thread>

#include "checkpoint_writer_model.h"
#include "support/test_support.h"

extern char** environ;

namespace {

namespace fs = std::filesystem;
using shampoo::testing::bit_equal;
using shampoo::testing::snapshot;

/// Starts checkpoint_writer with `args` (its output goes to `log`); returns its pid.
pid_t spawn_writer(const std::vector<std::string>& args, const fs::path& log) {
  std::vector<std::string> all{CHECKPOINT_WRITER_PATH};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& arg : all) argv.push_back(arg.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  EXPECT_EQ(rc, 0) << "cannot start " << argv[0];
  return pid;
}

/// Waits for `pid`; true when SIGKILL ended it.
bool killed_by_sigkill(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
}

/// The checkpoint in `dir` loads, and resuming from it for two more steps equals the
/// uninterrupted run bit for bit. Returns its generation (= the step it was saved at).
int64_t expect_exact_resume(const fs::path& dir) {
  const auto generation = shampoo::read_checkpoint_manifest(dir).generation;
  EXPECT_GE(generation, 1);
  checkpoint_writer::Model uninterrupted;
  for (int t = 1; t <= generation; ++t) uninterrupted.step(static_cast<int>(t));
  checkpoint_writer::Model resumed;
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < resumed.params.size(); ++i) {
      resumed.params[i].copy_(uninterrupted.params[i]);
    }
  }
  shampoo::load_distributed_checkpoint(*resumed.optimizer, dir);
  for (int t = static_cast<int>(generation) + 1; t <= generation + 2; ++t) {
    uninterrupted.step(t);
    resumed.step(t);
  }
  EXPECT_TRUE(bit_equal(snapshot(resumed.params), snapshot(uninterrupted.params)))
      << "resumed from generation " << generation;
  return generation;
}

class KilledBefore : public ::testing::TestWithParam<std::string> {};

TEST_P(KilledBefore, ThePreviousGenerationStaysCurrentAndExact) {
  const fs::path dir = shampoo::testing::temp_path("ckpt");
  const auto pid = spawn_writer({dir.string(), "3", GetParam(), "3"}, dir.string() + ".log");
  ASSERT_TRUE(killed_by_sigkill(pid)) << "the writer should have died before " << GetParam();
  EXPECT_EQ(expect_exact_resume(dir), 2);
  shampoo::testing::remove_tree(dir);
  fs::remove(dir.string() + ".log");
}

INSTANTIATE_TEST_SUITE_P(EachFile, KilledBefore,
                         ::testing::Values("common.pt", "rank-00000-of-00001.pt",
                                           "rank-00000-of-00001.keys", "MANIFEST"),
                         [](const auto& info) { return shampoo::testing::test_name(info.param); });

TEST(KilledAtRandom, EveryKillLeavesALoadableExactCheckpoint) {
  std::mt19937 random(2026);
  int interrupted_saves = 0;
  for (int trial = 0; trial < 4; ++trial) {
    const fs::path dir = shampoo::testing::temp_path("ckpt" + std::to_string(trial));
    const auto pid = spawn_writer({dir.string(), "1000"}, dir.string() + ".log");
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!shampoo::distributed_checkpoint_exists(dir) &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50 + random() % 400));
    kill(pid, SIGKILL);
    ASSERT_TRUE(killed_by_sigkill(pid)) << "trial " << trial;
    const auto generation = expect_exact_resume(dir);
    // Evidence that the kill hit a save: a newer generation directory or a temporary file.
    char committed[32];
    std::snprintf(committed, sizeof(committed), "gen-%06lld", static_cast<long long>(generation));
    for (const auto& entry : fs::recursive_directory_iterator(dir)) {
      const auto name = entry.path().filename().string();
      if (name.find(".tmp-") != std::string::npos || (entry.is_directory() && name > committed)) {
        ++interrupted_saves;
        break;
      }
    }
    shampoo::testing::remove_tree(dir);
    fs::remove(dir.string() + ".log");
  }
  RecordProperty("interrupted_saves", interrupted_saves);
  std::printf("%d of 4 kills interrupted a save\n", interrupted_saves);
}

}  // namespace
