// The trainer's per-rank checkpoints: a resumed run reads back what was written; a file that is
// not a readable checkpoint (truncated, damaged, not a torch archive) is an error naming it.
#include "examples/training_checkpoint.h"

#include <gtest/gtest.h>
#include <shampoo/shampoo.h>
#include <torch/nn/modules/linear.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "support/test_support.h"

namespace {

using shampoo::testing::expect_error;

using shampoo::examples::CheckpointDir;
using shampoo::examples::LossMetrics;
using shampoo::examples::TrainingProgress;

struct Training {
  torch::nn::Linear model{3, 2};
  std::unique_ptr<shampoo::DistributedShampoo> optimizer;
  LossMetrics metrics{4};
  Training() { optimizer = std::make_unique<shampoo::DistributedShampoo>(model->parameters()); }
};

/// Removes the folder and its files. (Not std::filesystem::remove_all: the libtorch.so of the
/// torch wheel exports a copy of it that crashes when called from here.)
void remove_dir(const std::filesystem::path& dir) {
  if (!std::filesystem::exists(dir)) return;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    std::filesystem::remove(entry.path());
  }
  std::filesystem::remove(dir);
}

/// A folder of its own (removed at the end of the test).
std::filesystem::path fresh_dir() {
  const std::filesystem::path dir = shampoo::testing::temp_path("checkpoints");
  remove_dir(dir);
  return dir;
}

TEST(TrainingCheckpoint, WrittenEpochIsReadBack) {
  const auto dir = fresh_dir();
  CheckpointDir checkpoints(dir, nullptr, "signature");
  Training run;
  run.metrics.update(0.5);
  checkpoints.save(TrainingProgress{1, 1}, *run.model, *run.optimizer, run.metrics);
  ASSERT_EQ(checkpoints.find_resume_epoch(), 1);
  Training resumed;
  checkpoints.load_model(1, *resumed.model);
  const auto progress = checkpoints.load_training_state(1, *resumed.optimizer, resumed.metrics);
  EXPECT_EQ(progress.epoch, 1);
  EXPECT_EQ(progress.iteration, 1);
  EXPECT_TRUE(at::equal(resumed.model->weight, run.model->weight));
  remove_dir(dir);
}

TEST(TrainingCheckpoint, UnreadableFileIsNamed) {
  const auto dir = fresh_dir();
  CheckpointDir checkpoints(dir, nullptr, "signature");
  Training run;
  run.metrics.update(0.5);
  checkpoints.save(TrainingProgress{1, 1}, *run.model, *run.optimizer, run.metrics);
  const auto path = checkpoints.file(1);

  // Truncated (a crash while copying the folder, a full disk).
  std::filesystem::resize_file(path, std::filesystem::file_size(path) / 2);
  Training resumed;
  for (const bool model : {true, false}) {
    expect_error(
        [&] {
          if (model) {
            checkpoints.load_model(1, *resumed.model);
          } else {
            checkpoints.load_training_state(1, *resumed.optimizer, resumed.metrics);
          }
        },
        {path.string(), "not a readable checkpoint"});
  }

  // Not a torch archive at all.
  {
    std::ofstream garbage(path, std::ios::binary | std::ios::trunc);
    garbage << "these are not the bytes of a checkpoint";
  }
  expect_error([&] { checkpoints.load_model(1, *resumed.model); },
               {path.string(), "not a readable checkpoint"});
  remove_dir(dir);
}

}  // namespace
