// The trainer resumed at other numbers of ranks: 2 ranks stopped within epoch 1, resumed by 4
// ranks that stop within epoch 2, resumed by 1 rank that finishes (--global-batch-size 32, so
// every global batch holds the same examples at every number of ranks). The run equals an
// uninterrupted one-process run: losses and test losses within the tolerance of the world-size
// parity tests (the ranks' gradients are averaged in another order), the lr schedule exactly,
// and the final parameters (read from both runs' checkpoints) within float32's tolerance.
//
// Arguments (CTest passes them): --trainer PATH --torchrun PATH --work-dir DIR [gtest flags]

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "examples/training_checkpoint.h"
#include "support/test_support.h"
#include "trainer_runs.h"

namespace {

namespace fs = std::filesystem;
using namespace shampoo::testing;

/// The same tolerance as the parity suite's one rank vs two ranks (trainer_parity_test.cpp):
/// rounding only, measured ≤ 2.5e-7 there; a batch taken from other examples or a step lost or
/// repeated at a resume moves the losses by 1e-3 or more.
constexpr double kWorldSizeRtol = 1e-5;

/// base_flags with the global batch given instead of the local one.
std::vector<std::string> global_batch_flags(const fs::path& data_dir) {
  auto flags = base_flags(data_dir, 1);
  for (size_t i = 0; i + 1 < flags.size(); ++i) {
    if (flags[i] == "--local-batch-size") {
      flags[i] = "--global-batch-size";
      flags[i + 1] = "32";
    }
  }
  return flags;
}

struct ResumeCase {
  std::string name;
  std::vector<std::string> flags;
  /// Added to the flags of the 2-, 4- and 1-rank runs (e.g. a --sharding each).
  std::vector<std::vector<std::string>> per_run = {{}, {}, {}};
};

class WorldSizeResumeTest : public TrainerTest, public ::testing::WithParamInterface<ResumeCase> {
 protected:
  /// Runs and asserts success.
  TrainerRun run(const fs::path& checkpoints, const std::string& metrics, int ranks,
                 const std::vector<std::string>& extra) {
    const auto flags = global_batch_flags(data_dir_) + GetParam().flags +
                       std::vector<std::string>{"--checkpoint-dir", checkpoints.string()} + extra;
    TrainerRun result = run_trainer(dir_ / metrics, ranks, flags);
    EXPECT_EQ(result.exit_code, 0) << result.log;
    return result;
  }

  /// The resume line of a run resumed after `epochs` epochs and `iterations` iterations.
  std::string resumed_line(const fs::path& checkpoints, int epochs, int iterations, int from,
                           int now) const {
    return "Resumed from " + checkpoints.string() + ": " + std::to_string(epochs) + " epoch(s), " +
           std::to_string(iterations) + " iterations done; saved at world size " +
           std::to_string(from) + ", now " + std::to_string(now);
  }
};

TEST_P(WorldSizeResumeTest, TwoThenFourThenOneRankEqualsOneUninterruptedRank) {
  if (trainer_paths().torchrun.empty()) GTEST_SKIP() << "no torchrun";
  const auto uninterrupted_checkpoints = dir_ / "uninterrupted_checkpoints";
  const TrainerRun uninterrupted = run(uninterrupted_checkpoints, "uninterrupted", 1, {});
  // Checkpoints within the epochs too (every 4 iterations) in the interrupted runs.
  const std::vector<std::string> every{"--checkpoint-every", "4"};
  ASSERT_EQ(rows(uninterrupted.train, "loss"), 30u) << uninterrupted.log;

  // One metrics folder for the three runs: each resumed run continues the CSV files.
  const auto checkpoints = dir_ / "checkpoints";
  const auto& per_run = GetParam().per_run;
  const TrainerRun two =
      run(checkpoints, "resumed", 2,
          every + std::vector<std::string>{"--stop-after-iteration", "7"} + per_run[0]);
  EXPECT_NE(two.log.find("ranks: 2 | global batch 32 (16 per rank)"), std::string::npos);
  EXPECT_NE(two.log.find("Stopped after iteration 7"), std::string::npos) << two.log;
  const TrainerRun four =
      run(checkpoints, "resumed", 4,
          every + std::vector<std::string>{"--stop-after-iteration", "18"} + per_run[1]);
  EXPECT_NE(four.log.find("ranks: 4 | global batch 32 (8 per rank)"), std::string::npos);
  EXPECT_NE(four.log.find(resumed_line(checkpoints, 0, 7, 2, 4)), std::string::npos) << four.log;
  const TrainerRun one = run(checkpoints, "resumed", 1, every + per_run[2]);
  EXPECT_NE(one.log.find(resumed_line(checkpoints, 1, 18, 4, 1)), std::string::npos) << one.log;

  ASSERT_EQ(rows(one.train, "loss"), 30u) << one.log;
  for (const char* column : {"global_loss", "global_lifetime_loss", "global_window_loss"}) {
    EXPECT_TRUE(close(one.train.at(column), uninterrupted.train.at(column), kWorldSizeRtol))
        << column;
  }
  EXPECT_TRUE(identical(one.train.at("lr"), uninterrupted.train.at("lr")));
  EXPECT_TRUE(close(one.eval.at("test_loss"), uninterrupted.eval.at("test_loss"), kWorldSizeRtol));

  const auto resumed_model = shampoo::examples::read_checkpoint_model(checkpoints);
  const auto expected_model = shampoo::examples::read_checkpoint_model(uninterrupted_checkpoints);
  ASSERT_EQ(resumed_model.size(), expected_model.size());
  for (size_t i = 0; i < resumed_model.size(); ++i) {
    EXPECT_EQ(resumed_model[i].first, expected_model[i].first);
    EXPECT_TRUE(all_close(resumed_model[i].second, expected_model[i].second))
        << resumed_model[i].first;
  }
}

// An epsilon of 1e-6 (not 1e-8) in Adam and in Shampoo's Adam grafting: with 1e-8, weights whose
// gradient is near 0 (linear-layer inputs that ReLU zeroes on nearly every example) step by about
// lr whichever sign the rounding gives their gradient, which moved single weights by up to
// 5.9e-6 between the two runs (float32's atol is 1e-5); with 1e-6, by at most 2.2e-7.
INSTANTIATE_TEST_SUITE_P(
    Optimizers, WorldSizeResumeTest,
    ::testing::Values(
        // DistributedShampoo: its blocks are owned by 2, then 4 ranks, then one.
        ResumeCase{"shampoo",
                   shampoo_flags() + std::vector<std::string>{"--grafting-epsilon", "1e-6", "--lr",
                                                              "1e-4", "--lr-schedule", "cosine"}},
        // Adam: replicated on every rank.
        ResumeCase{"adam", {"--optimizer", "adam", "--lr", "1e-4", "--epsilon", "1e-6"}},
        // DistributedShampoo moving between layouts: fully sharded at 2 ranks, hybrid 2 x 2 at
        // 4, one plain process to finish.
        ResumeCase{"shampoo_layouts",
                   shampoo_flags() + std::vector<std::string>{"--grafting-epsilon", "1e-6", "--lr",
                                                              "1e-4", "--lr-schedule", "cosine"},
                   {{"--sharding", "full"},
                    {"--sharding", "hybrid", "--shard-group-size", "2"},
                    {}}}),
    [](const auto& info) { return info.param.name; });

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (!parse_trainer_test_args(argc, argv, "trainer_world_size_resume_test")) return 2;
  return RUN_ALL_TESTS();
}
