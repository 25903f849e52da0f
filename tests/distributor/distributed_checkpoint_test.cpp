// World-size-independent checkpoints of DistributedShampoo (save_distributed_checkpoint): saved at
// one world size, resumed at another, the run is bit-identical to an uninterrupted single process;
// saves are atomic (a failed save leaves the previous checkpoint loadable); a damaged checkpoint
// is refused by name and changes nothing on any rank.
#include <shampoo/shampoo.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <vector>

#include "support/test_support.h"

namespace {

/// Every rank reaches this point before any goes on. An all-reduce of one number rather than
/// ProcessGroup::barrier(): with the ranks as threads of one process, ASan once saw a double
/// free inside LibTorch's barrier() called by both threads at once (2026-11-26).
void wait_for_every_rank(c10d::ProcessGroup& group) {
  std::vector<at::Tensor> one{at::zeros({1})};
  group.allreduce(one)->wait();
}

namespace fs = std::filesystem;
using shampoo::DistributedOptions;
using shampoo::DistributedShampoo;
using shampoo::ShampooOptions;
using shampoo::testing::bit_equal;
using shampoo::testing::run_ranks;
using shampoo::testing::snapshot;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

constexpr int kSaveStep = 4;
constexpr int kSteps = 8;

std::vector<at::Tensor> make_params() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  std::vector<at::Tensor> params;
  for (const auto& shape :
       std::vector<std::vector<int64_t>>{{9, 7}, {13}, {4, 3, 5}, {20, 11}, {6}, {5, 5}, {3, 17}}) {
    params.push_back(at::randn(shape, gen).requires_grad_());
  }
  return params;
}

/// Three groups: two that differ only in lr (one virtual group when merged), one with momentum.
std::vector<torch::optim::OptimizerParamGroup> make_groups(const std::vector<at::Tensor>& params,
                                                           const ShampooOptions& base) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{params[0], params[1], params[2]},
                      std::make_unique<ShampooOptions>(base));
  groups.emplace_back(std::vector<at::Tensor>{params[3], params[4]},
                      std::make_unique<ShampooOptions>(ShampooOptions(base).lr(base.lr() * 0.5)));
  groups.emplace_back(std::vector<at::Tensor>{params[5], params[6]},
                      std::make_unique<ShampooOptions>(ShampooOptions(base).momentum(0.9)));
  return groups;
}

ShampooOptions options_for(bool eigenvalue_corrected) {
  auto options = ShampooOptions::reference_defaults(0.02)
                     .betas({0.9, 0.99})
                     .epsilon(1e-6)
                     .precondition_frequency(2)
                     .max_preconditioner_dim(8)
                     .weight_decay(1e-3)
                     .grafting(shampoo::AdamGraftingConfig{0.99, 1e-8});
  if (eigenvalue_corrected) options.preconditioner(shampoo::EigenvalueCorrectedShampooConfig{});
  return options;
}

/// One process (group null) or one rank of a world, with its parameters.
struct Trainer {
  std::vector<at::Tensor> params = make_params();
  std::unique_ptr<DistributedShampoo> optimizer;
  Trainer(const ShampooOptions& options, const Group& group, int64_t trainers, bool merge) {
    optimizer =
        std::make_unique<DistributedShampoo>(make_groups(params, options), options,
                                             DistributedOptions()
                                                 .process_group(group)
                                                 .num_trainers_per_group(group ? trainers : -1)
                                                 .merge_param_groups(merge));
  }
  /// Parameters without a gradient at a step (a frozen or unused layer): none unless set.
  std::function<bool(int step, size_t param)> no_gradient = [](int, size_t) { return false; };
  void steps(int from, int to) {
    for (int step = from; step <= to; ++step) {
      shampoo::testing::set_random_grads(params, 500 + step);
      for (size_t i = 0; i < params.size(); ++i) {
        if (no_gradient(step, i)) params[i].mutable_grad() = at::Tensor();
      }
      optimizer->step();
    }
  }
  void set_params(const std::vector<at::Tensor>& values) {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(values[i]);
  }
};

std::vector<at::Tensor> uninterrupted(const ShampooOptions& options, int steps) {
  Trainer trainer(options, {}, -1, true);
  trainer.steps(1, steps);
  return snapshot(trainer.params);
}

/// Saves at step kSaveStep with `world` ranks (0 = one process without a group) into `dir`;
/// returns the parameters at the save.
std::vector<at::Tensor> save_at(const ShampooOptions& options, int world, int64_t trainers,
                                bool merge, const fs::path& dir) {
  std::vector<at::Tensor> saved;
  std::mutex mutex;
  const auto body = [&](const Group& group) {
    Trainer trainer(options, group, trainers, merge);
    trainer.steps(1, kSaveStep);
    shampoo::save_distributed_checkpoint(*trainer.optimizer, dir);
    std::lock_guard<std::mutex> lock(mutex);
    saved = snapshot(trainer.params);
  };
  if (world == 0) {
    body({});
  } else {
    run_ranks(world, [&](int, const Group& group) { body(group); });
  }
  return saved;
}

/// Resumes from `dir` with `world` ranks and runs to kSteps; every rank's parameters must equal
/// `expected` bit for bit.
void resume_and_check(const ShampooOptions& options, int world, int64_t trainers, bool merge,
                      const fs::path& dir, const std::vector<at::Tensor>& saved,
                      const std::vector<at::Tensor>& expected) {
  const auto body = [&](int rank, const Group& group) {
    Trainer trainer(options, group, trainers, merge);
    trainer.set_params(saved);
    shampoo::load_distributed_checkpoint(*trainer.optimizer, dir);
    EXPECT_EQ(trainer.optimizer->group_step(0), kSaveStep);
    trainer.steps(kSaveStep + 1, kSteps);
    EXPECT_TRUE(bit_equal(snapshot(trainer.params), expected))
        << "resumed at world " << world << " (trainers " << trainers << ") rank " << rank;
  };
  if (world == 0) {
    body(0, {});
  } else {
    run_ranks(world, body);
  }
}

struct WorldCase {
  std::string name;
  bool eigenvalue_corrected;
  bool save_merged;
  bool load_merged;
  int save_world;
  int64_t save_trainers;
};

void PrintTo(const WorldCase& c, std::ostream* os) { *os << c.name; }

class AnyWorldSize : public ::testing::TestWithParam<WorldCase> {};

TEST_P(AnyWorldSize, ResumedRunsEqualTheUninterruptedSingleProcessBitForBit) {
  const auto& c = GetParam();
  const auto options = options_for(c.eigenvalue_corrected);
  const auto expected = uninterrupted(options, kSteps);
  const fs::path dir = shampoo::testing::temp_path("ckpt");
  const auto saved = save_at(options, c.save_world, c.save_trainers, c.save_merged, dir);
  // Resumed in one process, at world 1, 2 and 4, and at world 4 with trainer groups of 2.
  resume_and_check(options, 0, -1, c.load_merged, dir, saved, expected);
  for (const int world : {1, 2, 4}) {
    resume_and_check(options, world, -1, c.load_merged, dir, saved, expected);
  }
  resume_and_check(options, 4, 2, c.load_merged, dir, saved, expected);
  shampoo::testing::remove_tree(dir);
}

INSTANTIATE_TEST_SUITE_P(
    Checkpoints, AnyWorldSize,
    ::testing::Values(WorldCase{"root_inverse_merged_world2", false, true, true, 2, -1},
                      WorldCase{"root_inverse_unmerged_then_merged", false, false, true, 2, -1},
                      WorldCase{"eigenvalue_corrected_merged_then_unmerged", true, true, false, 2,
                                -1},
                      WorldCase{"eigenvalue_corrected_unmerged_world2", true, false, false, 2, -1},
                      WorldCase{"root_inverse_world4_trainer_groups_of_2", false, true, true, 4, 2},
                      WorldCase{"root_inverse_one_process", false, true, true, 0, -1}),
    [](const auto& info) { return info.param.name; });

TEST(DistributedCheckpoint, WithoutTheLoadTheResumedRunDiffers) {
  // The resume test can fail: a run that skips the load ends elsewhere.
  const auto options = options_for(false);
  const auto expected = uninterrupted(options, kSteps);
  Trainer fresh(options, {}, -1, true);
  Trainer first(options, {}, -1, true);
  first.steps(1, kSaveStep);
  fresh.set_params(snapshot(first.params));
  fresh.steps(kSaveStep + 1, kSteps);
  EXPECT_FALSE(bit_equal(snapshot(fresh.params), expected));
}

TEST(DistributedCheckpoint, ParametersWithoutGradientsResumeAtAnyWorldSize) {
  // A frozen parameter (no gradient ever) and one that first gets a gradient after the save: the
  // checkpoint holds their blocks as every other, and the resumed run at another world size is
  // the uninterrupted one bit for bit.
  const auto options = options_for(false);
  const auto no_gradient = [](int step, size_t param) {
    return param == 4 || (param == 1 && step <= kSaveStep + 1);
  };
  Trainer single(options, {}, -1, true);
  single.no_gradient = no_gradient;
  const auto initial = snapshot(single.params);
  single.steps(1, kSteps);
  const auto expected = snapshot(single.params);
  EXPECT_TRUE(at::equal(expected[4], initial[4]));
  EXPECT_FALSE(at::equal(expected[1], initial[1]));
  const fs::path dir = shampoo::testing::temp_path("ckpt");
  std::vector<at::Tensor> saved;
  std::mutex mutex;
  run_ranks(2, [&](int, const Group& group) {
    Trainer trainer(options, group, -1, true);
    trainer.no_gradient = no_gradient;
    trainer.steps(1, kSaveStep);
    shampoo::save_distributed_checkpoint(*trainer.optimizer, dir);
    std::lock_guard<std::mutex> lock(mutex);
    saved = snapshot(trainer.params);
  });
  for (const int world : {1, 3}) {
    run_ranks(world, [&](int rank, const Group& group) {
      Trainer trainer(options, group, -1, world == 1 ? false : true);
      trainer.no_gradient = no_gradient;
      trainer.set_params(saved);
      shampoo::load_distributed_checkpoint(*trainer.optimizer, dir);
      trainer.steps(kSaveStep + 1, kSteps);
      EXPECT_TRUE(bit_equal(snapshot(trainer.params), expected))
          << "world " << world << " rank " << rank;
    });
  }
  shampoo::testing::remove_tree(dir);
}

TEST(DistributedCheckpoint, LayoutIsAManifestAndOneGenerationDirectory) {
  const auto options = options_for(false);
  const fs::path dir = shampoo::testing::temp_path("ckpt");
  save_at(options, 2, -1, true, dir);
  save_at(options, 2, -1, true, dir);  // a second save replaces the first generation
  const auto manifest = shampoo::read_checkpoint_manifest(dir);
  EXPECT_EQ(manifest.kind, "DistributedShampoo");
  EXPECT_EQ(manifest.generation, 2);
  EXPECT_EQ(manifest.world_size, 2);
  std::vector<std::string> names;
  for (const auto& file : manifest.files) names.push_back(file.name);
  EXPECT_EQ(names, (std::vector<std::string>{
                       "gen-000002/common.pt", "gen-000002/rank-00000-of-00002.pt",
                       "gen-000002/rank-00000-of-00002.keys", "gen-000002/rank-00001-of-00002.pt",
                       "gen-000002/rank-00001-of-00002.keys"}));
  std::vector<std::string> entries;
  for (const auto& entry : fs::directory_iterator(dir)) {
    entries.push_back(entry.path().filename().string());
  }
  std::sort(entries.begin(), entries.end());
  EXPECT_EQ(entries, (std::vector<std::string>{"MANIFEST", "gen-000002"}));
  // Every block is saved once, by its owner.
  std::ifstream keys0(dir / "gen-000002/rank-00000-of-00002.keys");
  std::ifstream keys1(dir / "gen-000002/rank-00001-of-00002.keys");
  int64_t count = 0;
  std::string key;
  while (std::getline(keys0, key)) ++count;
  while (std::getline(keys1, key)) ++count;
  Trainer single(options, {}, -1, true);
  EXPECT_EQ(count, single.optimizer->stats().total_blocks);
  shampoo::testing::remove_tree(dir);
}

class FailedSave : public ::testing::TestWithParam<std::string> {};

TEST_P(FailedSave, LeavesThePreviousCheckpointLoadable) {
  // A save that fails at one file (as a crash there would) throws on every rank and commits
  // nothing: the checkpoint of step kSaveStep stays, and resuming from it is exact.
  const auto options = options_for(false);
  const auto expected = uninterrupted(options, kSteps);
  const fs::path dir = shampoo::testing::temp_path("ckpt");
  const auto failing_file = GetParam();
  std::vector<at::Tensor> saved;
  std::mutex mutex;
  run_ranks(2, [&](int rank, const Group& group) {
    Trainer trainer(options, group, -1, true);
    trainer.steps(1, kSaveStep);
    shampoo::save_distributed_checkpoint(*trainer.optimizer, dir);
    {
      std::lock_guard<std::mutex> lock(mutex);
      saved = snapshot(trainer.params);
    }
    trainer.steps(kSaveStep + 1, kSaveStep + 2);
    // Both ranks must have passed the first save before the hook is set (it is global).
    wait_for_every_rank(*group);
    if (rank == 0) {
      shampoo::detail::set_checkpoint_write_hook_for_testing([&](const fs::path& path) {
        if (path.filename() == failing_file) throw std::runtime_error("injected crash");
      });
    }
    wait_for_every_rank(*group);
    try {
      shampoo::save_distributed_checkpoint(*trainer.optimizer, dir);
      ADD_FAILURE() << "rank " << rank << ": the save should have failed";
    } catch (const std::exception& e) {
      const std::string message = e.what();
      const bool own = message.find("injected crash") != std::string::npos;
      const bool other = message.find("failed (its own error says why)") != std::string::npos;
      EXPECT_TRUE(own || other) << message;
    }
    wait_for_every_rank(*group);
    if (rank == 0) shampoo::detail::set_checkpoint_write_hook_for_testing({});
  });
  EXPECT_EQ(shampoo::read_checkpoint_manifest(dir).generation, 1);
  EXPECT_TRUE(fs::exists(dir / "gen-000002")) << "the failed save should have started gen 2";
  resume_and_check(options, 0, -1, true, dir, saved, expected);
  resume_and_check(options, 2, -1, true, dir, saved, expected);
  // The next good save removes the abandoned generation.
  save_at(options, 2, -1, true, dir);
  EXPECT_EQ(shampoo::read_checkpoint_manifest(dir).generation, 3);
  EXPECT_FALSE(fs::exists(dir / "gen-000002"));
  shampoo::testing::remove_tree(dir);
}

INSTANTIATE_TEST_SUITE_P(AtEachFile, FailedSave,
                         ::testing::Values("common.pt", "rank-00001-of-00002.pt",
                                           "rank-00000-of-00002.keys", "MANIFEST"),
                         [](const auto& info) { return shampoo::testing::test_name(info.param); });

/// Saves a world-2 checkpoint, damages it with `damage`, and expects loading at world 2 to fail
/// on both ranks (one naming `fragment`) without changing either optimizer.
void expect_refused(const std::function<void(const fs::path&)>& damage,
                    const std::string& fragment) {
  const auto options = options_for(false);
  const auto expected = uninterrupted(options, kSteps);
  const fs::path dir = shampoo::testing::temp_path("ckpt");
  save_at(options, 2, -1, true, dir);
  damage(dir);
  std::mutex mutex;
  bool named = false;
  run_ranks(2, [&](int rank, const Group& group) {
    Trainer trainer(options, group, -1, true);
    trainer.steps(1, kSaveStep);
    try {
      shampoo::load_distributed_checkpoint(*trainer.optimizer, dir);
      ADD_FAILURE() << "rank " << rank << ": loading a damaged checkpoint should fail";
    } catch (const c10::Error& e) {
      const std::string message = e.what_without_backtrace();
      std::lock_guard<std::mutex> lock(mutex);
      named = named || message.find(fragment) != std::string::npos;
    }
    // Nothing changed: the run goes on as if no load had been tried.
    trainer.steps(kSaveStep + 1, kSteps);
    EXPECT_TRUE(bit_equal(snapshot(trainer.params), expected)) << "rank " << rank;
  });
  EXPECT_TRUE(named) << "no rank's error contains '" << fragment << "'";
  shampoo::testing::remove_tree(dir);
}

void truncate_file(const fs::path& path) { fs::resize_file(path, fs::file_size(path) / 2); }

void flip_last_byte(const fs::path& path) {
  std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
  file.seekg(-1, std::ios::end);
  char c = 0;
  file.get(c);
  file.seekp(-1, std::ios::end);
  file.put(static_cast<char>(c ^ 0x5a));
}

TEST(DamagedCheckpoint, TruncatedPiecesFileIsRefusedByName) {
  expect_refused(
      [](const fs::path& dir) { truncate_file(dir / "gen-000001/rank-00001-of-00002.pt"); },
      "gen-000001/rank-00001-of-00002.pt has");
}

TEST(DamagedCheckpoint, ChangedByteFailsTheChecksum) {
  expect_refused([](const fs::path& dir) { flip_last_byte(dir / "gen-000001/common.pt"); },
                 "gen-000001/common.pt does not match its checksum");
}

TEST(DamagedCheckpoint, MissingFileIsRefusedByName) {
  expect_refused(
      [](const fs::path& dir) { fs::remove(dir / "gen-000001/rank-00000-of-00002.keys"); },
      "gen-000001/rank-00000-of-00002.keys is missing");
}

TEST(DamagedCheckpoint, DamagedOrMissingManifestIsRefused) {
  expect_refused([](const fs::path& dir) { flip_last_byte(dir / "MANIFEST"); },
                 "MANIFEST is damaged");
  expect_refused([](const fs::path& dir) { fs::remove(dir / "MANIFEST"); },
                 "no MANIFEST (not a checkpoint directory, or no save into it completed)");
}

TEST(DamagedCheckpoint, AnotherModelIsRefusedAndNothingChanges) {
  const auto options = options_for(false);
  const fs::path dir = shampoo::testing::temp_path("ckpt");
  {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
    std::vector<at::Tensor> other{at::randn({4, 4}, gen).requires_grad_()};
    DistributedShampoo optimizer(other, options);
    shampoo::testing::set_random_grads(other, 1);
    optimizer.step();
    shampoo::save_distributed_checkpoint(optimizer, dir);
  }
  Trainer trainer(options, {}, -1, true);
  shampoo::testing::expect_error(
      [&] { shampoo::load_distributed_checkpoint(*trainer.optimizer, dir); },
      {"written for a model with 1 parameters, this optimizer has 7"});
  shampoo::testing::remove_tree(dir);
}

}  // namespace
