// The trainer's checkpoint (one world-size-independent checkpoint directory): what a run saves
// is what a resumed run continues from, in one process and across numbers of ranks (the model
// in place, the optimizer, each rank's or the averaged loss metrics, the progress, the random
// generator); another run's checkpoint is refused naming the field, a damaged one naming the file.
#include "examples/training_checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <shampoo/shampoo.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "support/test_support.h"

namespace {

namespace fs = std::filesystem;
using shampoo::examples::LossMetrics;
using shampoo::examples::RunSignature;
using shampoo::examples::TrainingCheckpoint;
using shampoo::examples::TrainingProgress;
using shampoo::testing::bit_equal;
using shampoo::testing::expect_error;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

/// A linear layer and a buffer (as batch norm's running statistics), the same on every rank.
struct TinyModel : torch::nn::Module {
  TinyModel() {
    linear = register_module("linear", torch::nn::Linear(3, 2));
    running = register_buffer("running", at::zeros({2}));
    auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
    torch::NoGradGuard no_grad;
    linear->weight.copy_(at::randn({2, 3}, gen));
    linear->bias.copy_(at::randn({2}, gen));
  }
  torch::nn::Linear linear{nullptr};
  at::Tensor running;
};

const RunSignature kSignature{{"dataset", "cifar10"}, {"global_batch_size", "32"}, {"seed", "7"}};

/// One run's (or one rank's) training state.
struct Training {
  std::shared_ptr<TinyModel> model = std::make_shared<TinyModel>();
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  LossMetrics metrics{3};
  TrainingProgress progress;
  std::unique_ptr<TrainingCheckpoint> checkpoint;

  Training(const fs::path& dir, const Group& group, bool shampoo,
           RunSignature signature = kSignature) {
    if (shampoo) {
      optimizer = std::make_unique<shampoo::DistributedShampoo>(
          model->parameters(),
          shampoo::ShampooOptions::reference_defaults(0.05).precondition_frequency(1).grafting(
              shampoo::AdamGraftingConfig{}),
          shampoo::DistributedOptions().process_group(group));
    } else {
      optimizer = std::make_unique<torch::optim::Adam>(model->parameters(),
                                                       torch::optim::AdamOptions(0.05));
    }
    checkpoint = std::make_unique<TrainingCheckpoint>(
        dir, group, std::move(signature),
        TrainingCheckpoint::State{model.get(), optimizer.get(), &metrics, &progress});
  }

  /// One step with gradients drawn from `seed` (the same on every rank, as after averaging).
  void step(uint64_t seed) {
    shampoo::testing::set_random_grads(model->parameters(), seed);
    optimizer->step();
  }

  std::vector<at::Tensor> params() const { return shampoo::testing::snapshot(model->parameters()); }
};

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

/// A fresh folder (removed at the end of the test by the caller).
fs::path fresh_dir() {
  const fs::path dir = shampoo::testing::temp_path("checkpoint");
  shampoo::testing::remove_tree(dir);
  return dir;
}

class OneProcess : public ::testing::TestWithParam<bool> {};

TEST_P(OneProcess, ResumedRunContinuesLikeTheUninterruptedOne) {
  const bool shampoo = GetParam();
  const auto dir = fresh_dir();
  Training run(dir, nullptr, shampoo);
  EXPECT_FALSE(run.checkpoint->exists());
  for (int step = 1; step <= 3; ++step) {
    run.step(step);
    run.metrics.update(1.0 / step);
  }
  run.progress = TrainingProgress{1, 3};
  run.model->running.fill_(0.25);
  run.checkpoint->save(/*average_buffers=*/false);
  const auto cpu_draw = at::randn({4});  // after the save: the resumed run draws the same

  Training resumed(dir, nullptr, shampoo);
  ASSERT_TRUE(resumed.checkpoint->exists());
  EXPECT_EQ(resumed.checkpoint->load(), 1);  // the number of ranks that saved it
  EXPECT_EQ(resumed.progress.epoch, 1);
  EXPECT_EQ(resumed.progress.iteration, 3);
  EXPECT_EQ(resumed.metrics.iteration(), 3);
  EXPECT_EQ(resumed.metrics.local().window_loss, run.metrics.local().window_loss);
  EXPECT_TRUE(bit_equal(resumed.params(), run.params()));
  EXPECT_TRUE(bit_equal(resumed.model->running, run.model->running));
  EXPECT_TRUE(bit_equal(at::randn({4}), cpu_draw));
  // The optimizer's state came along: the next steps are the same.
  for (int step = 4; step <= 5; ++step) {
    run.step(step);
    resumed.step(step);
  }
  EXPECT_TRUE(bit_equal(resumed.params(), run.params()));
  shampoo::testing::remove_tree(dir);
}

INSTANTIATE_TEST_SUITE_P(Optimizers, OneProcess, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "shampoo" : "adam"; });

/// Saves at 2 ranks whose metrics and buffers differ (rank r's losses are r + 1 and r + 2), then
/// resumes at `resume_world`.
void save_at_two_resume_at(int resume_world, const fs::path& dir,
                           const std::function<void(int rank, Training&)>& check) {
  shampoo::testing::run_ranks(2, [&](int rank, const Group& group) {
    Training run(dir, group, /*shampoo=*/true);
    run.step(1);
    run.metrics.update(rank + 1.0);
    run.metrics.update(rank + 2.0);
    run.progress = TrainingProgress{0, 2};
    run.model->running.fill_(static_cast<double>(rank));
    run.checkpoint->save(/*average_buffers=*/true);
  });
  shampoo::testing::run_ranks(resume_world, [&](int rank, const Group& group) {
    Training resumed(dir, group, /*shampoo=*/true);
    ASSERT_TRUE(resumed.checkpoint->exists());
    EXPECT_EQ(resumed.checkpoint->load(), 2);
    EXPECT_EQ(resumed.progress.iteration, 2);
    check(rank, resumed);
  });
}

TEST(Ranks, SameNumberOfRanksResumesEachRanksOwnMetrics) {
  const auto dir = fresh_dir();
  save_at_two_resume_at(2, dir, [](int rank, Training& resumed) {
    EXPECT_EQ(resumed.metrics.local().lifetime_loss, rank + 1.5);
    EXPECT_EQ(resumed.metrics.local().loss, rank + 2.0);
    // The buffers' mean over the ranks (they differed within the epoch).
    EXPECT_TRUE(bit_equal(resumed.model->running, at::full({2}, 0.5)));
  });
  shampoo::testing::remove_tree(dir);
}

TEST(Ranks, OtherNumberOfRanksResumesTheAveragedMetricsAndTheOptimizer) {
  const auto dir = fresh_dir();
  // The uninterrupted run, in one process: the ranks averaged their gradients to the same ones.
  Training reference(fs::path(), nullptr, /*shampoo=*/true);
  reference.step(1);
  reference.step(2);
  save_at_two_resume_at(3, dir, [&](int, Training& resumed) {
    EXPECT_EQ(resumed.metrics.local().lifetime_loss, 2.0);  // mean of 1.5 and 2.5
    EXPECT_EQ(resumed.metrics.local().window_loss, 2.0);
    EXPECT_TRUE(bit_equal(resumed.model->running, at::full({2}, 0.5)));
    resumed.step(2);  // DistributedShampoo's blocks, now owned by 3 ranks
    EXPECT_TRUE(bit_equal(resumed.params(), reference.params()));
  });
  shampoo::testing::remove_tree(dir);
}

TEST(Ranks, ShampooPiecesAreNestedUnderOptimizer) {
  const auto dir = fresh_dir();
  shampoo::testing::run_ranks(2, [&](int, const Group& group) {
    Training run(dir, group, /*shampoo=*/true);
    run.step(1);
    run.metrics.update(1.0);
    run.progress.iteration = 1;
    run.checkpoint->save(/*average_buffers=*/false);
  });
  const auto manifest = shampoo::read_checkpoint_manifest(dir);
  EXPECT_EQ(manifest.kind, "cifar10_trainer");
  EXPECT_EQ(manifest.world_size, 2);
  std::string keys;
  for (const auto& file : manifest.files) {
    if (file.name.size() > 5 && file.name.substr(file.name.size() - 5) == ".keys") {
      keys += read_text(dir / file.name);
    }
  }
  EXPECT_NE(keys.find("metrics/rank-0-of-2\n"), std::string::npos) << keys;
  EXPECT_NE(keys.find("metrics/rank-1-of-2\n"), std::string::npos) << keys;
  EXPECT_NE(keys.find("\noptimizer/"), std::string::npos) << keys;
  shampoo::testing::remove_tree(dir);
}

TEST(Errors, AnotherRunsCheckpointIsRefusedNamingTheField) {
  const auto dir = fresh_dir();
  Training run(dir, nullptr, /*shampoo=*/false);
  run.checkpoint->save(/*average_buffers=*/false);
  RunSignature other = kSignature;
  other[1].second = "64";
  Training resumed(dir, nullptr, /*shampoo=*/false, other);
  const auto before = resumed.params();
  expect_error([&] { resumed.checkpoint->load(); },
               {"--checkpoint-dir " + dir.string(), "holds a checkpoint of another run",
                "global_batch_size is 32 there and 64 in this run"});
  EXPECT_TRUE(bit_equal(resumed.params(), before));
  shampoo::testing::remove_tree(dir);
}

TEST(Errors, DamagedFileIsNamed) {
  const auto dir = fresh_dir();
  Training run(dir, nullptr, /*shampoo=*/true);
  run.checkpoint->save(/*average_buffers=*/false);
  const auto common = dir / "gen-000001" / "common.pt";
  fs::resize_file(common, fs::file_size(common) / 2);
  Training resumed(dir, nullptr, /*shampoo=*/true);
  expect_error([&] { resumed.checkpoint->load(); }, {"gen-000001/common.pt", "truncated"});
  shampoo::testing::remove_tree(dir);
}

TEST(Errors, RanksThatSeeDifferentFoldersAreAnError) {
  // Rank 0's folder holds a checkpoint, rank 1's (another machine's disk) does not.
  const auto dir = fresh_dir();
  Training(dir / "0", nullptr, /*shampoo=*/false).checkpoint->save(/*average_buffers=*/false);
  shampoo::testing::run_ranks(2, [&](int rank, const Group& group) {
    Training run(dir / std::to_string(rank), group, /*shampoo=*/false);
    expect_error([&] { run.checkpoint->exists(); },
                 {"rank(s) 0 see a committed checkpoint there, rank(s) 1 do not",
                  "a filesystem that every node mounts"});
  });
  shampoo::testing::remove_tree(dir);
}

TEST(Errors, EarlierPerRankFormatIsAnError) {
  const auto dir = fresh_dir();
  fs::create_directories(dir);
  std::ofstream(dir / "rank0-of-2-epoch3.pt") << "old";
  Training run(dir, nullptr, /*shampoo=*/false);
  expect_error([&] { run.checkpoint->exists(); },
               {"earlier per-rank format (rank0-of-2-epoch3.pt)", "use another folder"});
  shampoo::testing::remove_tree(dir);
}

TEST(ReadCheckpointModel, GivesTheSavedParametersByName) {
  const auto dir = fresh_dir();
  Training run(dir, nullptr, /*shampoo=*/false);
  run.step(1);
  run.checkpoint->save(/*average_buffers=*/false);
  const auto model = shampoo::examples::read_checkpoint_model(dir);
  ASSERT_EQ(model.size(), 3u);
  EXPECT_EQ(model[0].first, "linear.weight");
  EXPECT_EQ(model[2].first, "running");
  EXPECT_TRUE(bit_equal(model[0].second, run.model->linear->weight.detach()));
  shampoo::testing::remove_tree(dir);
}

}  // namespace
