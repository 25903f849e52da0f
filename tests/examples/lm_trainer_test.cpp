// The trainer's language-model workload (--dataset ptb --model lm) on a tiny corpus that this
// program writes, and --micro-batches and --save-params on every workload: the validation
// perplexity decreases; n micro-batches step the same parameters as one batch (read with
// examples/param_distance); a run stopped and resumed equals an uninterrupted one; two ranks
// (plain and fully sharded) equal one; bad flags are errors naming them.
//
// Arguments (CTest passes them): --trainer PATH --param-distance PATH [--torchrun PATH]
// --work-dir DIR [gtest flags].

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "trainer_runs.h"

namespace {

namespace fs = std::filesystem;
using shampoo::testing::close;
using shampoo::testing::identical;
using shampoo::testing::read_text;
using shampoo::testing::rows;
using shampoo::testing::run_trainer;
using shampoo::testing::trainer_paths;
using shampoo::testing::TrainerRun;
using shampoo::testing::operator+;

constexpr int kWords = 40;

/// Removes `path` and everything under it (not std::filesystem::remove_all: see trainer_runs).
void remove_folder(const fs::path& path) {
  std::error_code ec;
  if (fs::is_directory(fs::symlink_status(path, ec))) {
    for (const auto& entry : fs::directory_iterator(path, ec)) remove_folder(entry.path());
  }
  fs::remove(path, ec);
}

/// `lines` sentences of a language with structure to learn: each word is usually (3 times in 4)
/// a fixed function of the one before, else any word; 4 to 11 words per sentence. From
/// std::mt19937's raw output, so the text is the same everywhere.
std::string sentences(std::mt19937& random, int lines) {
  std::string text;
  for (int line = 0; line < lines; ++line) {
    const uint32_t length = 4 + random() % 8;
    uint32_t word = random() % kWords;
    for (uint32_t i = 0; i < length; ++i) {
      text += " w" + std::to_string(word);
      word = random() % 4 != 0 ? (word * 7 + 3) % kWords : random() % kWords;
    }
    text += " \n";
  }
  return text;
}

/// ptb.train.txt (600 sentences, about 4500 tokens), ptb.valid.txt and ptb.test.txt (60 each).
void write_tiny_corpus(const fs::path& dir) {
  fs::create_directories(dir);
  std::mt19937 random(2024);
  std::ofstream(dir / "ptb.train.txt") << sentences(random, 600);
  std::ofstream(dir / "ptb.valid.txt") << sentences(random, 60);
  std::ofstream(dir / "ptb.test.txt") << sentences(random, 60);
}

/// The language model on the tiny corpus: sequences of 10 tokens, d = 16, 8 sequences per step
/// over all ranks, 2 epochs.
std::vector<std::string> lm_flags(const fs::path& data_dir, int ranks) {
  return {"--dataset",
          "ptb",
          "--data-dir",
          data_dir.string(),
          "--bptt",
          "10",
          "--lm-dim",
          "16",
          "--epochs",
          "2",
          "--global-batch-size",
          "8",
          "--local-batch-size",
          std::to_string(8 / ranks),
          "--seed",
          "11",
          "--log-every",
          "1000",
          "--progress",
          "off",
          "--threads",
          "1"};
}

std::vector<std::string> adam_flags(const std::string& lr) {
  return {"--optimizer", "adam", "--lr", lr, "--epsilon", "1e-8"};
}

/// Shampoo with roots every 5 steps from step 10, small blocks (cheap; full-rank factors).
std::vector<std::string> shampoo_flags() {
  return {"--optimizer",
          "shampoo",
          "--lr",
          "0.003",
          "--epsilon",
          "1e-10",
          "--grafting",
          "adam",
          "--max-preconditioner-dim",
          "16",
          "--precondition-frequency",
          "5",
          "--start-preconditioning-step",
          "10"};
}

/// What param_distance printed and how it ended.
struct Distance {
  int exit_code = -1;
  std::string output;
  double max_relative = NAN;  // the "(all)" row
  double norm_relative = NAN;
};

Distance param_distance(const fs::path& a, const fs::path& b) {
  const auto out = a.parent_path() / "distance.txt";
  const std::string command = "'" + trainer_paths().param_distance + "' '" + a.string() + "' '" +
                              b.string() + "' > '" + out.string() + "' 2>&1";
  const int status = std::system(command.c_str());
  Distance d;
  d.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  d.output = read_text(out);
  std::istringstream lines(d.output);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream words(line);
    std::string name;
    if (words >> name && name == "(all)") words >> d.max_relative >> d.norm_relative;
  }
  return d;
}

class LmTrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = trainer_paths().work_dir / (std::string("LmTrainerTest.") + info->name());
    remove_folder(dir_);
    data_dir_ = dir_ / "ptb";
    write_tiny_corpus(data_dir_);
  }

  TrainerRun run_ok(const std::string& name, int ranks, const std::vector<std::string>& flags) {
    TrainerRun run = run_trainer(dir_ / name, ranks, flags);
    EXPECT_EQ(run.exit_code, 0) << "run " << name << " failed:\n" << run.log;
    return run;
  }

  fs::path dir_;
  fs::path data_dir_;
};

TEST_F(LmTrainerTest, ValidationPerplexityDecreases) {
  for (const auto& [name, optimizer] :
       std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"adam", adam_flags("0.01")}, {"shampoo", shampoo_flags()}}) {
    SCOPED_TRACE(name);
    const auto run = run_ok(
        name, 1, lm_flags(data_dir_, 1) + optimizer + std::vector<std::string>{"--epochs", "3"});
    ASSERT_EQ(rows(run.eval, "test_loss"), 3u) << run.log;
    const auto& loss = run.eval.at("test_loss");
    EXPECT_LT(loss[1], loss[0]) << run.log;
    EXPECT_LT(loss[2], loss[1]) << run.log;
    // 41 words (and <eos>): a model that learned nothing has perplexity about 41; the language
    // has a likely next word, so a learned one is far below.
    EXPECT_LT(std::exp(loss[2]), 20.0) << run.log;
    EXPECT_TRUE(std::isnan(run.eval.at("test_accuracy")[2]));
    EXPECT_NE(run.log.find("Validation Perplexity: "), std::string::npos) << run.log;
    std::ostringstream final_line;
    final_line.precision(2);
    final_line << std::fixed << "Final validation perplexity: " << std::exp(loss[2]);
    EXPECT_NE(run.log.find(final_line.str()), std::string::npos) << run.log;
  }
}

TEST_F(LmTrainerTest, MicroBatchesStepTheParametersOfOneBatch) {
  // SGD: the step is linear in the gradient, so the parameters differ only by the rounding of
  // the gradient's sums (float32), carried through the 63 steps of one epoch.
  const std::vector<std::string> sgd{"--optimizer", "sgd", "--lr", "0.2", "--epochs", "1"};
  const auto whole =
      run_ok("whole", 1,
             lm_flags(data_dir_, 1) + sgd +
                 std::vector<std::string>{"--save-params", (dir_ / "whole.pt").string()});
  const auto micro = run_ok("micro", 1,
                            lm_flags(data_dir_, 1) + sgd +
                                std::vector<std::string>{"--micro-batches", "2", "--save-params",
                                                         (dir_ / "micro.pt").string()});
  EXPECT_TRUE(close(micro.train.at("loss"), whole.train.at("loss"), 1e-5));
  const auto d = param_distance(dir_ / "micro.pt", dir_ / "whole.pt");
  ASSERT_EQ(d.exit_code, 0) << d.output;
  EXPECT_NE(d.output.find("lstm.weight_hh"), std::string::npos) << d.output;
  EXPECT_LT(d.norm_relative, 1e-5) << d.output;
  EXPECT_LT(d.max_relative, 1e-5) << d.output;
  // The comparison can fail: another lr moves the parameters far more than rounding.
  const auto other =
      run_ok("other_lr", 1,
             lm_flags(data_dir_, 1) + std::vector<std::string>{"--optimizer", "sgd", "--lr", "0.19",
                                                               "--epochs", "1", "--save-params",
                                                               (dir_ / "other.pt").string()});
  const auto far = param_distance(dir_ / "other.pt", dir_ / "whole.pt");
  ASSERT_EQ(far.exit_code, 0) << far.output;
  EXPECT_GT(far.norm_relative, 1e-3) << far.output;
}

TEST_F(LmTrainerTest, MicroBatchesStepTheParametersOfOneBatchForTheConvNet) {
  // A small lr without momentum: on this data set larger steps make the trajectory chaotic
  // (lr 0.05 with momentum 0.9: the loss reaches 53, and rounding differences of 1e-7 after the
  // first step grow to 4e-3 by the tenth), which would test the data, not the accumulation.
  const auto cifar = dir_ / "cifar";
  shampoo::testing::write_cifar10_files(cifar);
  const auto flags =
      shampoo::testing::base_flags(cifar, 1) +
      std::vector<std::string>{"--optimizer", "sgd", "--lr", "0.01", "--epochs", "1"};
  run_ok("whole", 1,
         flags + std::vector<std::string>{"--save-params", (dir_ / "whole.pt").string()});
  const auto micro =
      run_ok("micro", 1,
             flags + std::vector<std::string>{"--micro-batches", "4", "--save-params",
                                              (dir_ / "micro.pt").string()});
  EXPECT_EQ(rows(micro.train, "loss"), 10u);
  const auto d = param_distance(dir_ / "micro.pt", dir_ / "whole.pt");
  ASSERT_EQ(d.exit_code, 0) << d.output;
  EXPECT_NE(d.output.find("linear.weight"), std::string::npos) << d.output;
  EXPECT_LT(d.norm_relative, 1e-5) << d.output;
  // Files of different models do not match: an error naming the parameter.
  const auto lm = run_ok(
      "lm", 1,
      lm_flags(data_dir_, 1) + adam_flags("0.01") +
          std::vector<std::string>{"--epochs", "1", "--save-params", (dir_ / "lm.pt").string()});
  const auto mismatch = param_distance(dir_ / "lm.pt", dir_ / "whole.pt");
  EXPECT_EQ(mismatch.exit_code, 1) << mismatch.output;
  EXPECT_NE(mismatch.output.find("do not match"), std::string::npos) << mismatch.output;
}

TEST_F(LmTrainerTest, ResumedRunEqualsUninterruptedRun) {
  const auto flags = lm_flags(data_dir_, 1) + shampoo_flags();
  const auto uninterrupted = run_ok(
      "uninterrupted", 1,
      flags + std::vector<std::string>{"--save-params", (dir_ / "uninterrupted.pt").string()});
  const auto checkpoints = (dir_ / "checkpoints").string();
  const auto stopped = run_ok("resumed", 1,
                              flags + std::vector<std::string>{"--checkpoint-dir", checkpoints,
                                                               "--stop-after-iteration", "37"});
  EXPECT_NE(stopped.log.find("Stopped after iteration 37"), std::string::npos) << stopped.log;
  const auto resumed =
      run_ok("resumed", 1,
             flags + std::vector<std::string>{"--checkpoint-dir", checkpoints, "--save-params",
                                              (dir_ / "resumed.pt").string()});
  EXPECT_NE(resumed.log.find("Resumed from"), std::string::npos) << resumed.log;
  EXPECT_TRUE(identical(resumed.train.at("loss"), uninterrupted.train.at("loss")));
  EXPECT_TRUE(identical(resumed.eval.at("test_loss"), uninterrupted.eval.at("test_loss")));
  const auto d = param_distance(dir_ / "resumed.pt", dir_ / "uninterrupted.pt");
  ASSERT_EQ(d.exit_code, 0) << d.output;
  EXPECT_EQ(d.max_relative, 0.0) << d.output;
}

TEST_F(LmTrainerTest, TwoRanksEqualOneRank) {
  if (trainer_paths().torchrun.empty()) GTEST_SKIP() << "no torchrun";
  const auto one = run_ok("one", 1, lm_flags(data_dir_, 1) + adam_flags("0.01"));
  for (const std::string sharding : {"none", "full"}) {
    SCOPED_TRACE(sharding);
    const auto two = run_ok("two_" + sharding, 2,
                            lm_flags(data_dir_, 2) + adam_flags("0.01") +
                                std::vector<std::string>{"--sharding", sharding});
    EXPECT_TRUE(close(two.train.at("global_loss"), one.train.at("loss"), 1e-5));
    EXPECT_TRUE(close(two.eval.at("test_loss"), one.eval.at("test_loss"), 1e-5));
  }
}

TEST_F(LmTrainerTest, ShampooAtTwoRanksEndsWhereOneRankEnds) {
  // The all-reduce sums the gradient in another order than one process: the parameters differ by
  // rounding. With the reference's factoring (every dim, 1-D parameters included, float32
  // factors, an absolute epsilon) the roots of rank-deficient factors amplify that; the defaults
  // keep the runs together.
  if (trainer_paths().torchrun.empty()) GTEST_SKIP() << "no torchrun";
  const auto save = [&](const std::string& name) {
    return std::vector<std::string>{"--save-params", (dir_ / (name + ".pt")).string()};
  };
  run_ok("one", 1, lm_flags(data_dir_, 1) + shampoo_flags() + save("one"));
  run_ok("two", 2, lm_flags(data_dir_, 2) + shampoo_flags() + save("two"));
  const auto d = param_distance(dir_ / "two.pt", dir_ / "one.pt");
  ASSERT_EQ(d.exit_code, 0) << d.output;
  EXPECT_LT(d.norm_relative, 1e-3) << d.output;
  EXPECT_LT(d.max_relative, 1e-3) << d.output;
  const std::vector<std::string> reference{"--precondition-1d",
                                           "--max-factored-dim",
                                           "-1",
                                           "--relative-epsilon",
                                           "0",
                                           "--factor-dtype",
                                           "fp32"};
  run_ok("one_reference", 1, lm_flags(data_dir_, 1) + shampoo_flags() + reference + save("one_r"));
  run_ok("two_reference", 2, lm_flags(data_dir_, 2) + shampoo_flags() + reference + save("two_r"));
  const auto far = param_distance(dir_ / "two_r.pt", dir_ / "one_r.pt");
  ASSERT_EQ(far.exit_code, 0) << far.output;
  EXPECT_GT(far.norm_relative, 10 * d.norm_relative) << far.output;
}

TEST_F(LmTrainerTest, BadFlagsAndMissingFilesAreErrorsNamingThem) {
  auto run = run_trainer(dir_ / "micro", 1,
                         lm_flags(data_dir_, 1) + std::vector<std::string>{"--micro-batches", "3"});
  EXPECT_EQ(run.exit_code, 2) << run.log;
  EXPECT_NE(run.log.find("--micro-batches: got 3, which does not divide the local batch of 8"),
            std::string::npos)
      << run.log;
  run = run_trainer(dir_ / "model", 1, {"--dataset", "cifar10", "--model", "lm"});
  EXPECT_EQ(run.exit_code, 2) << run.log;
  EXPECT_NE(run.log.find("--model: got lm with --dataset cifar10"), std::string::npos) << run.log;
  fs::remove(data_dir_ / "ptb.valid.txt");
  run = run_trainer(dir_ / "missing", 1, lm_flags(data_dir_, 1));
  EXPECT_EQ(run.exit_code, 1) << run.log;
  EXPECT_NE(run.log.find("cannot read " + (data_dir_ / "ptb.valid.txt").string()),
            std::string::npos)
      << run.log;
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (!shampoo::testing::parse_trainer_test_args(argc, argv, "lm_trainer_test")) return 2;
  if (trainer_paths().param_distance.empty()) {
    std::cerr << "lm_trainer_test: --param-distance PATH is required\n";
    return 2;
  }
  return RUN_ALL_TESTS();
}
