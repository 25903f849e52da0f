// Full sharding (FullyShardedDataParallel, ZeRO-3): training a fully sharded model equals plain
// data parallelism (GradientSynchronizer) bit for bit at world 2, for Adam and Shampoo, lossless
// and local-shard, with the step overlapped in backward and after it; within float32 tolerance at
// world 3 (padded row chunks); gradient accumulation; what a rank holds; clear errors; the roots
// of a rank's blocks batched in one call per shape bucket after backward.
#include <shampoo/shampoo.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "parallel/communication/collectives.h"
#include "parallel/sharding_runs.h"
#include "support/test_support.h"

namespace {

using shampoo::FullyShardedDataParallel;
using shampoo::FullyShardedOptions;
using shampoo::ShardedStepMode;
using shampoo::ShardedUnit;
using shampoo::testing::all_close;
using shampoo::testing::bit_equal;
using shampoo::testing::Dataset;
using shampoo::testing::expect_error;
using shampoo::testing::make_mlp;
using shampoo::testing::run_ranks;
using shampoo::testing::sharding_batch;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

constexpr std::chrono::seconds kTimeout{60};

enum class Optim { kAdam, kShampoo, kEigenvalueCorrected };

std::string optim_name(Optim optim) {
  switch (optim) {
    case Optim::kAdam:
      return "adam";
    case Optim::kShampoo:
      return "shampoo";
    case Optim::kEigenvalueCorrected:
      return "eigenvalue_corrected";
  }
  return "?";
}

/// One process's optimizer over `params` (the data-parallel run steps every parameter on every
/// rank; the fully sharded run steps what the rank owns).
shampoo::GroupOptimizerFactory factory_of(Optim optim) {
  if (optim == Optim::kAdam) {
    return shampoo::group_optimizer_factory<torch::optim::Adam>(
        torch::optim::AdamOptions(0.01).weight_decay(0.01));
  }
  return shampoo::group_optimizer_factory<shampoo::DistributedShampoo>(
      shampoo::testing::sharding_shampoo_options(optim == Optim::kEigenvalueCorrected));
}

at::Tensor loss_of(const at::Tensor& logits, const Dataset& data) {
  // In float32 also when the units compute in a lower precision (a no-op otherwise).
  return torch::nn::functional::cross_entropy(logits.to(at::kFloat), data.labels);
}

/// Plain data parallelism: every rank holds and steps everything.
struct DataParallelRun {
  torch::nn::Sequential model = make_mlp(6, 10, 3, /*seed=*/5);
  std::unique_ptr<shampoo::GradientSynchronizer> sync;
  std::unique_ptr<torch::optim::Optimizer> optimizer;

  DataParallelRun(Optim optim, const Group& group)
      : sync(std::make_unique<shampoo::GradientSynchronizer>(model->parameters(), group)),
        optimizer(factory_of(optim)(torch::optim::OptimizerParamGroup(model->parameters()))) {}

  float step(const Dataset& data) {
    optimizer->zero_grad();
    auto loss = loss_of(model->forward(data.inputs), data);
    loss.backward();
    sync->synchronize();
    optimizer->step();
    return loss.item<float>();
  }
};

/// The same model fully sharded, one unit per Linear layer.
struct ShardedRun {
  torch::nn::Sequential model = make_mlp(6, 10, 3, /*seed=*/5);
  std::unique_ptr<FullyShardedDataParallel> fsdp;

  ShardedRun(Optim optim, const Group& group, FullyShardedOptions options)
      : fsdp(std::make_unique<FullyShardedDataParallel>(shampoo::sequential_units(model),
                                                        factory_of(optim), group, options)) {}

  float step(const Dataset& data) {
    auto loss = loss_of(shampoo::forward_sequential(*fsdp, model, data.inputs), data);
    loss.backward();  // with overlap_step the steps run here, on the worker
    return loss.item<float>();
  }

  std::vector<at::Tensor> full_values() {
    std::vector<at::Tensor> out;
    for (const auto& p : model->parameters()) out.push_back(fsdp->full_value(p));
    return out;
  }
};

float sharded_step(ShardedRun& run, const Dataset& data, bool overlap) {
  const float loss = run.step(data);
  if (!overlap) run.fsdp->step();
  return loss;
}

using Case = std::tuple<Optim, ShardedStepMode, bool>;

class FullySharded : public ::testing::TestWithParam<Case> {};

TEST_P(FullySharded, EqualsDataParallelismBitForBitAtWorld2) {
  const auto [optim, mode, overlap] = GetParam();
  run_ranks(
      2,
      [&, optim = optim, mode = mode, overlap = overlap](int rank, const Group& group) {
        const auto data = sharding_batch(rank, 2);
        DataParallelRun plain(optim, group);
        ShardedRun sharded(optim, group,
                           FullyShardedOptions().step_mode(mode).overlap_step(overlap));
        for (int step = 0; step < 20; ++step) {
          const float expected = plain.step(data);
          const float actual = sharded_step(sharded, data, overlap);
          ASSERT_EQ(actual, expected) << "rank " << rank << " step " << step;
        }
        EXPECT_TRUE(bit_equal(sharded.full_values(), plain.model->parameters())) << "rank " << rank;
        EXPECT_EQ(sharded.fsdp->stats().steps_taken, 20);
        EXPECT_EQ(sharded.fsdp->stats().backward_passes, 20);
      },
      kTimeout);
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const auto [optim, mode, overlap] = info.param;
  return optim_name(optim) + (mode == ShardedStepMode::kLossless ? "_lossless" : "_local") +
         (overlap ? "_overlap" : "_after_backward");
}

INSTANTIATE_TEST_SUITE_P(Lossless, FullySharded,
                         ::testing::Combine(::testing::Values(Optim::kAdam, Optim::kShampoo,
                                                              Optim::kEigenvalueCorrected),
                                            ::testing::Values(ShardedStepMode::kLossless),
                                            ::testing::Bool()),
                         case_name);
// Local shards equal data parallelism for elementwise optimizers only.
INSTANTIATE_TEST_SUITE_P(LocalShard, FullySharded,
                         ::testing::Combine(::testing::Values(Optim::kAdam),
                                            ::testing::Values(ShardedStepMode::kLocalShard),
                                            ::testing::Bool()),
                         case_name);

/// Eight 16x16 layers without biases: at world 2 each rank owns four weights of one shape.
torch::nn::Sequential square_layers() {
  torch::manual_seed(3);
  torch::nn::Sequential model;
  for (int i = 0; i < 8; ++i) {
    model->push_back(torch::nn::Linear(torch::nn::LinearOptions(16, 16).bias(false)));
  }
  return model;
}

/// Root computations and batched calls of the first step on this rank (roots every step).
std::pair<int64_t, int64_t> first_step_roots(const Group& group, int rank, bool overlap) {
  auto model = square_layers();
  FullyShardedDataParallel fsdp(
      shampoo::sequential_units(model),
      shampoo::group_optimizer_factory<shampoo::DistributedShampoo>(
          shampoo::testing::sharding_shampoo_options(false).precondition_frequency(1)),
      group, FullyShardedOptions().overlap_step(overlap));
  torch::manual_seed(10 + rank);
  const auto input = torch::randn({12, 16});
  shampoo::forward_sequential(fsdp, model, input).square().sum().backward();
  if (!overlap) fsdp.step();
  const auto optimizers = fsdp.optimizers();
  EXPECT_EQ(optimizers.size(), 1u);
  const auto stats = dynamic_cast<shampoo::DistributedShampoo&>(*optimizers.at(0)).stats();
  return {stats.amortized_computations, stats.amortized_batched_calls};
}

// After backward every block of the rank is preconditioned in one step: the root computations of
// its four 16x16 blocks (one per block) are one batched call (one shape bucket), not one call
// per parameter. With the step overlapped in backward each unit steps as its gradients arrive:
// one call per unit.
TEST(FullyShardedOneOptimizerPerRank, RootsAreOneBatchedCallPerShapeBucketAfterBackward) {
  run_ranks(
      2,
      [&](int rank, const Group& group) {
        const auto [after_computations, after_calls] = first_step_roots(group, rank, false);
        EXPECT_EQ(after_computations, 4) << "rank " << rank;
        EXPECT_EQ(after_calls, 1) << "rank " << rank;
        const auto [overlap_computations, overlap_calls] = first_step_roots(group, rank, true);
        EXPECT_EQ(overlap_computations, 4) << "rank " << rank;
        EXPECT_EQ(overlap_calls, 4) << "rank " << rank;
      },
      kTimeout);
}

// World 3: rows split 4/4/2 and 1/1/1, and the average's summation order differs from Gloo's:
// Adam stays within float32 tolerance of data parallelism; Shampoo's roots amplify the last-bit
// differences of the gradients, so its loss is compared within 0.1 % (as the ZeRO-2 tests do).
TEST(FullyShardedWorld3, LosslessFollowsDataParallelism) {
  for (const auto optim : {Optim::kAdam, Optim::kShampoo}) {
    const bool adam = optim == Optim::kAdam;
    run_ranks(
        3,
        [&](int rank, const Group& group) {
          const auto all = shampoo::testing::make_blobs(96, 6, 3, /*seed=*/21);
          const Dataset data{all.inputs.narrow(0, rank * 32, 32),
                             all.labels.narrow(0, rank * 32, 32)};
          DataParallelRun plain(optim, group);
          ShardedRun sharded(optim, group, FullyShardedOptions());
          for (int step = 0; step < 10; ++step) {
            const float expected = plain.step(data);
            const float actual = sharded_step(sharded, data, true);
            EXPECT_NEAR(actual, expected, (adam ? 1e-5 : 1e-3) * std::abs(expected))
                << optim_name(optim) << " rank " << rank << " step " << step;
          }
          const auto values = sharded.full_values();
          const auto params = plain.model->parameters();
          for (size_t i = 0; i < params.size(); ++i) {
            if (adam) {
              EXPECT_TRUE(all_close(values[i], params[i], {1e-5, 1e-6})) << "parameter " << i;
            }
          }
        },
        kTimeout);
  }
}

// Hybrid sharding (FullyShardedOptions::replica_group) at 4 ranks: 2x2 (two shard groups of two,
// replicated) and 1x4 follow data parallelism at 4 within float32 summation noise (Shampoo's roots
// amplify the last bits: its loss within 0.1 %); 4x1 (one replica) is full sharding at 4, bit
// for bit. Lossless and local shards, overlapped and after backward.
TEST(FullyShardedHybrid, FollowsDataParallelismAtFourRanks) {
  for (const auto& [optim, mode, overlap] :
       std::vector<Case>{{Optim::kAdam, ShardedStepMode::kLossless, true},
                         {Optim::kAdam, ShardedStepMode::kLocalShard, false},
                         {Optim::kShampoo, ShardedStepMode::kLossless, true},
                         {Optim::kShampoo, ShardedStepMode::kLossless, false}}) {
    const bool adam = optim == Optim::kAdam;
    for (const int shard_size : {2, 1, 4}) {
      run_ranks(
          4,
          [&, optim = optim, mode = mode, overlap = overlap](int rank, const Group& group) {
            const auto data = sharding_batch(rank, 4);
            const auto hybrid = shampoo::make_hybrid_groups(group, shard_size);
            const auto options = FullyShardedOptions().step_mode(mode).overlap_step(overlap);
            DataParallelRun plain(optim, group);
            ShardedRun full(optim, group, options);
            ShardedRun sharded(optim, hybrid.shard,
                               FullyShardedOptions(options).replica_group(hybrid.replica));
            const auto where = optim_name(optim) + " " + std::to_string(shard_size) + "x" +
                               std::to_string(4 / shard_size) + " rank " + std::to_string(rank);
            for (int step = 0; step < 8; ++step) {
              const float expected = plain.step(data);
              const float fully = sharded_step(full, data, overlap);
              const float actual = sharded_step(sharded, data, overlap);
              EXPECT_NEAR(actual, expected, (adam ? 1e-5 : 1e-3) * std::abs(expected))
                  << where << " step " << step;
              if (shard_size == 4) {
                EXPECT_EQ(actual, fully) << where << " step " << step;
              }
            }
            const auto values = sharded.full_values();
            const auto params = plain.model->parameters();
            for (size_t i = 0; i < params.size() && adam; ++i) {
              EXPECT_TRUE(all_close(values[i], params[i], {1e-5, 1e-6}))
                  << where << " parameter " << i;
            }
            if (shard_size == 4) {
              EXPECT_TRUE(bit_equal(values, full.full_values())) << where;
            }
          },
          kTimeout);
    }
  }
}

// Hybrid 2x2 with the state split across the replicas (split_across_replicas): each parameter is
// stepped by one rank of the four, its gradient reduced to that replica and its new value
// broadcast, so the ranks hold the state of half as many parameters as replicated hybrid, whose
// results it equals bit for bit (Adam and Shampoo, overlapped and after backward). A whole-run
// checkpoint (every replica saves its own state) resumes it bit for bit; a checkpoint written by
// one replica is refused.
TEST(FullyShardedHybrid, SplitAcrossReplicasEqualsReplicatedBitForBit) {
  const auto dir = shampoo::testing::temp_path("hybrid_split");
  for (const auto& [optim, overlap] : std::vector<std::pair<Optim, bool>>{
           {Optim::kAdam, true}, {Optim::kShampoo, true}, {Optim::kShampoo, false}}) {
    shampoo::testing::remove_tree(dir);
    run_ranks(
        4,
        [&, optim = optim, overlap = overlap](int rank, const Group& group) {
          const auto data = sharding_batch(rank, 4);
          const auto hybrid = shampoo::make_hybrid_groups(group, 2);
          const auto options =
              FullyShardedOptions().overlap_step(overlap).replica_group(hybrid.replica);
          ShardedRun replicated(optim, hybrid.shard, options);
          ShardedRun split(optim, hybrid.shard,
                           FullyShardedOptions(options).split_across_replicas(true));
          const auto where = optim_name(optim) + (overlap ? " overlap" : " after backward") +
                             " rank " + std::to_string(rank);
          for (int step = 0; step < 6; ++step) {
            const float expected = sharded_step(replicated, data, overlap);
            EXPECT_EQ(sharded_step(split, data, overlap), expected) << where << " step " << step;
            if (step == 2) {
              shampoo::save_training_checkpoint(
                  dir, {split.model.ptr().get(), &split.fsdp->optimizer()}, group);
            }
          }
          const auto split_values = split.full_values();
          EXPECT_TRUE(bit_equal(split_values, replicated.full_values())) << where;
          // Every parameter is stepped by one rank of the four (replicated: by two).
          const auto count = [](ShardedRun& run) {
            int64_t n = 0;
            for (auto* optimizer : run.fsdp->optimizers()) {
              for (const auto& g : optimizer->param_groups()) n += g.params().size();
            }
            return n;
          };
          const auto counts =
              shampoo::detail::gather_int64(*group, {count(split), count(replicated)});
          int64_t split_total = 0, replicated_total = 0;
          for (const auto& row : counts) {
            split_total += row[0];
            replicated_total += row[1];
          }
          const auto params = static_cast<int64_t>(split.model->parameters().size());
          EXPECT_EQ(split_total, params) << where;
          EXPECT_EQ(replicated_total, 2 * params) << where;
          expect_error([&] { shampoo::save_distributed_state(*split.fsdp, dir + "_one"); },
                       {"split across the replicas", "save_training_checkpoint"});
          if (!overlap) {  // clipping needs every gradient's norm, which no replica has alone
            split.step(data);
            expect_error([&] { split.fsdp->clip_grad_norm_(1.0); },
                         {"clip_grad_norm_", "split_across_replicas", "not supported yet"});
            split.fsdp->skip_step();
            split.step(data);
            split.fsdp->step();  // the next iteration runs
          }
          // Resumed from step 3 (the checkpoint after it), the run is the same.
          ShardedRun resumed(optim, hybrid.shard,
                             FullyShardedOptions(options).split_across_replicas(true));
          EXPECT_TRUE(shampoo::load_training_checkpoint(
              dir, {resumed.model.ptr().get(), &resumed.fsdp->optimizer()}, group));
          for (int step = 3; step < 6; ++step) sharded_step(resumed, data, overlap);
          EXPECT_TRUE(bit_equal(resumed.full_values(), split_values)) << where;
        },
        kTimeout);
  }
  shampoo::testing::remove_tree(dir);
}

// A hybrid 2x2 checkpoint (replica 0 writes, replica 1 waits) resumes fully sharded at 2 and in
// one process: the parameters as saved, bit for bit, and the next steps as the hybrid run's within
// float32 summation noise (the average's order differs with the layout). A whole-run checkpoint
// of the same run (save_training_checkpoint) resumes it at 2x2 bit for bit.
TEST(FullyShardedHybrid, ACheckpointResumesFullyShardedAtTwoAndInOneProcess) {
  const auto dir = shampoo::testing::temp_path("hybrid_checkpoint");
  shampoo::testing::remove_tree(dir);
  std::mutex mutex;
  std::vector<at::Tensor> saved, continued;
  run_ranks(
      4,
      [&](int rank, const Group& group) {
        const auto hybrid = shampoo::make_hybrid_groups(group, 2);
        ShardedRun run(Optim::kAdam, hybrid.shard,
                       FullyShardedOptions().replica_group(hybrid.replica));
        const auto data = sharding_batch(rank, 4);
        for (int step = 0; step < 3; ++step) run.step(data);
        shampoo::save_distributed_state(*run.fsdp, dir);
        // A whole-run checkpoint too (every rank's generators; the shards from replica 0).
        shampoo::save_training_checkpoint(dir + "_run",
                                          {run.model.ptr().get(), &run.fsdp->optimizer()}, group);
        auto values = run.full_values();
        for (int step = 0; step < 2; ++step) run.step(data);
        auto after = run.full_values();
        if (rank == 0) {
          std::lock_guard<std::mutex> lock(mutex);
          saved = values;
          continued = after;
        }
      },
      kTimeout);
  // The whole-run checkpoint resumes the hybrid run as if uninterrupted, bit for bit.
  run_ranks(
      4,
      [&](int rank, const Group& group) {
        const auto hybrid = shampoo::make_hybrid_groups(group, 2);
        ShardedRun run(Optim::kAdam, hybrid.shard,
                       FullyShardedOptions().replica_group(hybrid.replica));
        EXPECT_TRUE(shampoo::load_training_checkpoint(
            dir + "_run", {run.model.ptr().get(), &run.fsdp->optimizer()}, group));
        EXPECT_TRUE(bit_equal(run.full_values(), saved)) << "rank " << rank;
        const auto data = sharding_batch(rank, 4);
        for (int step = 0; step < 2; ++step) run.step(data);
        EXPECT_TRUE(bit_equal(run.full_values(), continued)) << "rank " << rank;
      },
      kTimeout);
  for (const int world : {2, 1}) {
    run_ranks(
        world,
        [&](int rank, const Group& group) {
          ShardedRun run(Optim::kAdam, group, FullyShardedOptions());
          shampoo::load_distributed_state(*run.fsdp, dir);
          EXPECT_TRUE(bit_equal(run.full_values(), saved)) << "world " << world;
          const auto data = sharding_batch(rank, world);  // the hybrid run's global batch
          for (int step = 0; step < 2; ++step) run.step(data);
          const auto values = run.full_values();
          for (size_t i = 0; i < values.size(); ++i) {
            EXPECT_TRUE(all_close(values[i], continued[i], {1e-5, 1e-6}))
                << "world " << world << " parameter " << i;
          }
        },
        kTimeout);
  }
  shampoo::testing::remove_tree(dir);
  shampoo::testing::remove_tree(dir + "_run");
}

// Gradient accumulation: the reduced gradients of two micro-batches are summed and the step runs
// on the second; equal (to float32 summation order) to data parallelism over the same micro-batches
// with NoSync.
TEST(FullyShardedAccumulation, TwoMicroBatchesFollowDataParallelism) {
  for (const bool overlap : {true, false}) {
    run_ranks(
        2,
        [&](int rank, const Group& group) {
          const auto data = sharding_batch(rank, 2);
          const Dataset first{data.inputs.narrow(0, 0, 24), data.labels.narrow(0, 0, 24)};
          const Dataset second{data.inputs.narrow(0, 24, 24), data.labels.narrow(0, 24, 24)};
          DataParallelRun plain(Optim::kAdam, group);
          ShardedRun sharded(Optim::kAdam, group,
                             FullyShardedOptions().accumulation_steps(2).overlap_step(overlap));
          for (int step = 0; step < 5; ++step) {
            plain.optimizer->zero_grad();
            {
              shampoo::GradientSynchronizer::NoSync no_sync(*plain.sync);
              loss_of(plain.model->forward(first.inputs), first).backward();
            }
            loss_of(plain.model->forward(second.inputs), second).backward();
            plain.sync->synchronize();
            plain.optimizer->step();

            sharded.step(first);
            EXPECT_EQ(sharded.fsdp->stats().steps_taken, step);
            if (!overlap) {
              expect_error([&] { sharded.fsdp->step(); },
                           {"accumulation_steps is 2", "1 backward pass(es)"});
            }
            sharded_step(sharded, second, overlap);
            EXPECT_EQ(sharded.fsdp->stats().steps_taken, step + 1);
          }
          const auto values = sharded.full_values();
          const auto params = plain.model->parameters();
          for (size_t i = 0; i < params.size(); ++i) {
            EXPECT_TRUE(all_close(values[i], params[i], {1e-5, 1e-6}))
                << "parameter " << i << " overlap " << overlap;
          }
        },
        kTimeout);
  }
}

// Checkpoints: saved fully sharded at world 4, resumed at 4 (bit for bit the uninterrupted run),
// at 2 and at 1 (the same global batch; within float32 summation-order noise).
void train_sharded(Optim optim, int world, int steps, const std::string& load_from,
                   const std::string& save_to, std::vector<at::Tensor>& final_values) {
  std::mutex mutex;
  run_ranks(
      world,
      [&](int rank, const Group& group) {
        ShardedRun run(optim, group, FullyShardedOptions());
        if (!load_from.empty()) shampoo::load_distributed_state(*run.fsdp, load_from);
        const auto data = sharding_batch(rank, world);
        for (int step = 0; step < steps; ++step) sharded_step(run, data, true);
        if (!save_to.empty()) shampoo::save_distributed_state(*run.fsdp, save_to);
        auto values = run.full_values();
        if (rank != 0) return;
        std::lock_guard<std::mutex> lock(mutex);
        final_values = values;
      },
      kTimeout);
}

TEST(FullyShardedCheckpoint, ResumesAtAnotherWorldSize) {
  for (const auto optim : {Optim::kAdam, Optim::kShampoo}) {
    const auto dir = shampoo::testing::temp_path("fsdp_checkpoint_" + optim_name(optim));
    std::vector<at::Tensor> saved, uninterrupted, resumed;
    train_sharded(optim, 4, 6, "", "", uninterrupted);
    train_sharded(optim, 4, 3, "", dir, saved);
    train_sharded(optim, 4, 3, dir, "", resumed);
    EXPECT_TRUE(bit_equal(resumed, uninterrupted)) << optim_name(optim);
    for (const int world : {2, 1}) {
      train_sharded(optim, world, 3, dir, "", resumed);
      for (size_t i = 0; i < resumed.size(); ++i) {
        EXPECT_TRUE(all_close(resumed[i], uninterrupted[i],
                              optim == Optim::kAdam ? shampoo::testing::Tolerance{1e-5, 1e-6}
                                                    : shampoo::testing::Tolerance{1e-3, 1e-4}))
            << optim_name(optim) << " world " << world << " parameter " << i;
        EXPECT_FALSE(bit_equal(resumed[i], saved[i])) << "the resumed run trained";
      }
    }
    shampoo::testing::remove_tree(dir);
  }
}

TEST(FullyShardedCheckpoint, ACheckpointOfAnotherModelOrModeIsAClearError) {
  const auto dir = shampoo::testing::temp_path("fsdp_checkpoint_other");
  std::vector<at::Tensor> ignored;
  train_sharded(Optim::kAdam, 2, 1, "", dir, ignored);
  run_ranks(
      2,
      [&](int, const Group& group) {
        auto wider = make_mlp(6, 12, 3, 5);
        FullyShardedDataParallel other(shampoo::sequential_units(wider), factory_of(Optim::kAdam),
                                       group);
        expect_error([&] { shampoo::load_distributed_state(other, dir); },
                     {"unit 0 ('0')", "parameter 0 has shape [10, 6] there and [12, 6] here"});
        ShardedRun shampoo_run(Optim::kShampoo, group, FullyShardedOptions());
        expect_error([&] { shampoo::load_distributed_state(*shampoo_run.fsdp, dir); },
                     {"was stepped by Adam there and by DistributedShampoo here"});
        ShardedRun local(Optim::kAdam, group,
                         FullyShardedOptions().step_mode(ShardedStepMode::kLocalShard));
        expect_error([&] { shampoo::save_distributed_state(*local.fsdp, dir + "_local"); },
                     {"checkpoints need step_mode kLossless"});
      },
      kTimeout);
  shampoo::testing::remove_tree(dir);
}

// A rank that stops in the middle of a step (after its forward, before its backward) makes the
// others fail with an error that says so, within the process group's timeout: killed (its
// connections close) or hung (alive, silent past the timeout). The checkpoint saved before that
// step is intact. Full sharding at 2 ranks, and hybrid 2x2 at 4 (the last rank stops: its shard
// group fails in a gather or reduction, the other replica in the all-reduce across replicas).
TEST(FullyShardedFaults, ARankThatStopsMidStepFailsTheOtherAndKeepsTheCheckpoint) {
  for (const int world : {2, 4}) {
    for (const bool hung : {false, true}) {
      const auto dir = shampoo::testing::temp_path("fsdp_fault");
      const std::chrono::seconds timeout{2};
      std::mutex mutex;
      std::vector<at::Tensor> saved_values;
      const auto where =
          std::string(world == 4 ? "hybrid 2x2 " : "full ") + (hung ? "hung" : "killed");
      run_ranks(
          world,
          [&](int rank, const Group& group) {
            auto shard_group = group;
            auto options = FullyShardedOptions();
            if (world == 4) {
              const auto hybrid = shampoo::make_hybrid_groups(group, 2);
              shard_group = hybrid.shard;
              options.replica_group(hybrid.replica);
            }
            ShardedRun run(Optim::kShampoo, shard_group, options);
            const auto data = sharding_batch(rank, world);
            for (int step = 0; step < 2; ++step) sharded_step(run, data, true);
            shampoo::save_distributed_state(*run.fsdp, dir);
            auto values = run.full_values();
            if (rank == world - 1) {
              shampoo::forward_sequential(*run.fsdp, run.model, data.inputs);
              if (hung) std::this_thread::sleep_for(2 * timeout);
              return;  // gone: its process groups close
            }
            if (rank == 0) {
              std::lock_guard<std::mutex> lock(mutex);
              saved_values = values;
            }
            const auto start = std::chrono::steady_clock::now();
            expect_error([&] { sharded_step(run, data, true); },
                         {"FullyShardedDataParallel: ",
                          "failed on rank " + std::to_string(run.fsdp->process_group()->getRank()),
                          "did another rank stop"});
            EXPECT_LT(std::chrono::steady_clock::now() - start, timeout + std::chrono::seconds(3))
                << where << " rank " << rank;
          },
          timeout);
      std::vector<at::Tensor> loaded;
      train_sharded(Optim::kShampoo, 1, 0, dir, "", loaded);
      EXPECT_TRUE(bit_equal(loaded, saved_values)) << where;
      shampoo::testing::remove_tree(dir);
    }
  }
}

// Mixed precision: the units gather and compute in bfloat16, while the shards, the optimizer's
// state and its step stay float32 (the stepped values are not rounded to bfloat16); a float32
// policy changes nothing, bit for bit.
TEST(FullyShardedMixedPrecision, ComputesInBf16AndStepsInFloat32) {
  run_ranks(
      2,
      [&](int rank, const Group& group) {
        const auto data = sharding_batch(rank, 2);
        ShardedRun plain(Optim::kAdam, group, FullyShardedOptions());
        ShardedRun float32(Optim::kAdam, group,
                           FullyShardedOptions().param_dtype(at::kFloat).reduce_dtype(at::kFloat));
        ShardedRun mixed(Optim::kAdam, group,
                         FullyShardedOptions().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat));
        ShardedRun mixed_reduce(Optim::kAdam, group,
                                FullyShardedOptions().param_dtype(at::kBFloat16));
        {
          torch::NoGradGuard no_grad;
          auto first = mixed.model->ptr(0)->as<torch::nn::Linear>();
          const auto out = mixed.fsdp->forward(0, [&] {
            EXPECT_EQ(first->weight.scalar_type(), at::kBFloat16);
            return first->forward(data.inputs.to(at::kBFloat16));
          });
          EXPECT_EQ(out.scalar_type(), at::kBFloat16);
        }
        float first_loss = 0;
        float losses[4] = {0, 0, 0, 0};
        for (int step = 0; step < 20; ++step) {
          losses[0] = sharded_step(plain, data, true);
          losses[1] = sharded_step(float32, data, true);
          losses[2] = sharded_step(mixed, data, true);
          losses[3] = sharded_step(mixed_reduce, data, true);
          if (step == 0) first_loss = losses[0];
          ASSERT_EQ(losses[1], losses[0]) << "step " << step;
        }
        EXPECT_LT(losses[0], 0.7 * first_loss);
        EXPECT_NEAR(losses[2], losses[0], 0.03 * losses[0]);
        EXPECT_NEAR(losses[3], losses[0], 0.03 * losses[0]);
        for (const auto& p : mixed.model->parameters()) {
          EXPECT_EQ(p.scalar_type(), at::kFloat);  // at rest, the parameter's own dtype
          const auto value = mixed.fsdp->full_value(p);
          EXPECT_EQ(value.scalar_type(), at::kFloat);
          EXPECT_FALSE(at::equal(value, value.to(at::kBFloat16).to(at::kFloat)));
        }
        expect_error(
            [&] {
              ShardedRun bad(Optim::kAdam, group, FullyShardedOptions().param_dtype(at::kInt));
            },
            {"param_dtype: got Int, expected a floating-point dtype"});
      },
      kTimeout);
}

// The sharded GradScaler with a fully sharded model stepped after backward equals data
// parallelism with the same scaler, bit for bit at world 2: the same scale, growth and back-off,
// and a skipped step on both ranks when one rank's gradients hold inf. With the step overlapped in
// backward the scaler is refused, naming the option.
TEST(FullyShardedGradScaler, EqualsDataParallelismWithTheScaler) {
  run_ranks(
      2,
      [&](int rank, const Group& group) {
        const auto data = sharding_batch(rank, 2);
        DataParallelRun plain(Optim::kAdam, group);
        ShardedRun sharded(Optim::kAdam, group, FullyShardedOptions().overlap_step(false));
        const auto options =
            shampoo::GradScalerOptions().process_group(group).init_scale(1024.0).growth_interval(3);
        shampoo::GradScaler plain_scaler(options);
        shampoo::GradScaler sharded_scaler(options);
        const float inf = std::numeric_limits<float>::infinity();
        for (int step = 0; step < 10; ++step) {
          const bool poison = step == 4 && rank == 1;
          plain.optimizer->zero_grad();
          auto loss = loss_of(plain.model->forward(data.inputs), data);
          plain_scaler.scale(poison ? loss * inf : loss).backward();
          plain.sync->synchronize();
          plain_scaler.step(*plain.optimizer);
          plain_scaler.update();
          auto sharded_loss =
              loss_of(shampoo::forward_sequential(*sharded.fsdp, sharded.model, data.inputs), data);
          sharded_scaler.scale(poison ? sharded_loss * inf : sharded_loss).backward();
          sharded_scaler.step(*sharded.fsdp);
          sharded_scaler.update();
          ASSERT_EQ(sharded_scaler.get_scale(), plain_scaler.get_scale()) << "step " << step;
        }
        EXPECT_EQ(plain_scaler.skipped_steps(), 1);
        EXPECT_EQ(sharded_scaler.skipped_steps(), 1);
        EXPECT_EQ(sharded.fsdp->stats().steps_taken, 9);
        EXPECT_NE(sharded_scaler.get_scale(), 1024.0);  // backed off, grown
        EXPECT_TRUE(bit_equal(sharded.full_values(), plain.model->parameters())) << "rank " << rank;
        ShardedRun overlapped(Optim::kAdam, group, FullyShardedOptions());
        expect_error([&] { sharded_scaler.unscale_(*overlapped.fsdp); },
                     {"GradScaler::unscale_", "overlap_step(false)"});
      },
      kTimeout);
}

// Clipping by global norm on the reduced gradients equals the synchronizer's (LibTorch's
// clip_grad_norm_ on the full averaged gradients), bit for bit at world 2, also while it clips.
TEST(FullyShardedClipping, EqualsDataParallelClipping) {
  run_ranks(
      2,
      [&](int rank, const Group& group) {
        const auto data = sharding_batch(rank, 2);
        DataParallelRun plain(Optim::kShampoo, group);
        ShardedRun sharded(Optim::kShampoo, group, FullyShardedOptions().overlap_step(false));
        int clipped = 0;
        for (int step = 0; step < 10; ++step) {
          plain.optimizer->zero_grad();
          loss_of(plain.model->forward(data.inputs), data).backward();
          plain.sync->synchronize();
          const double expected = plain.sync->clip_grad_norm_(0.1);
          plain.optimizer->step();
          loss_of(shampoo::forward_sequential(*sharded.fsdp, sharded.model, data.inputs), data)
              .backward();
          const double actual = sharded.fsdp->clip_grad_norm_(0.1);
          sharded.fsdp->step();
          ASSERT_EQ(actual, expected) << "step " << step;
          clipped += expected > 0.1;
        }
        EXPECT_GT(clipped, 0);
        EXPECT_TRUE(bit_equal(sharded.full_values(), plain.model->parameters())) << "rank " << rank;
        ShardedRun overlapped(Optim::kAdam, group, FullyShardedOptions());
        expect_error([&] { overlapped.fsdp->clip_grad_norm_(1.0); }, {"overlap_step(false)"});
      },
      kTimeout);
}

// What a rank holds: its row chunks; no full parameters or gradients between steps; the module's
// parameters have no storage while sharded; lossless owners balance the parameters.
TEST(FullyShardedMemory, RanksHoldTheirChunksOnly) {
  run_ranks(
      2,
      [&](int rank, const Group& group) {
        const auto data = sharding_batch(rank, 2);
        ShardedRun run(Optim::kAdam, group, FullyShardedOptions());
        // Layers 6->10, 10->10, 10->3: rows 10, 10, 10 (5 per rank), 3 (2 and 1).
        const int64_t full = (60 + 10 + 100 + 10 + 30 + 3) * 4;
        const int64_t expected =
            rank == 0 ? (30 + 5 + 50 + 5 + 20 + 2) * 4 : (30 + 5 + 50 + 5 + 10 + 1) * 4;
        EXPECT_EQ(run.fsdp->stats().shard_bytes, expected);
        EXPECT_LT(run.fsdp->stats().shard_bytes, full);
        EXPECT_EQ(run.fsdp->stats().gathered_bytes, 0);
        for (const auto& p : run.model->parameters()) {
          EXPECT_EQ(p.numel(), 0);
          EXPECT_EQ(p.storage().nbytes(), 0u);
        }
        run.step(data);
        run.fsdp->wait();
        EXPECT_EQ(run.fsdp->stats().gathered_bytes, 0);
        EXPECT_EQ(run.fsdp->stats().gradient_bytes, 0);
        for (const auto& p : run.model->parameters()) EXPECT_FALSE(p.grad().defined());
        int owned_here = 0;
        for (const auto& p : run.model->parameters()) owned_here += run.fsdp->owner_of(p) == rank;
        EXPECT_GE(owned_here, 2);  // six parameters over two ranks, balanced by bytes
        // Without resharding after forward the units stay gathered until their backward.
        ShardedRun kept(Optim::kAdam, group, FullyShardedOptions().reshard_after_forward(false));
        auto logits = shampoo::forward_sequential(*kept.fsdp, kept.model, data.inputs);
        EXPECT_EQ(kept.fsdp->stats().gathered_bytes, full);
        loss_of(logits, data).backward();
        kept.fsdp->wait();
        EXPECT_EQ(kept.fsdp->stats().gathered_bytes, 0);
      },
      kTimeout);
}

// A unit's forward outside the wrapper finds parameters of shape [0] and fails (no crash).
TEST(FullyShardedErrors, ForwardOutsideTheWrapperFails) {
  run_ranks(
      1,
      [&](int, const Group& group) {
        ShardedRun run(Optim::kAdam, group, FullyShardedOptions());
        const auto data = sharding_batch(0, 1);
        EXPECT_THROW(run.model->forward(data.inputs), c10::Error);
      },
      kTimeout);
}

TEST(FullyShardedErrors, BadUnitsAreClearErrors) {
  run_ranks(
      1,
      [&](int, const Group& group) {
        auto model = make_mlp(6, 10, 3, 5);
        auto params = model->parameters();
        const auto make = [&](std::vector<ShardedUnit> units, FullyShardedOptions options = {}) {
          FullyShardedDataParallel fsdp(std::move(units), factory_of(Optim::kAdam), group, options);
        };
        expect_error(
            [&] {
              make({{"a", {params[0]}}, {"b", {params[1], params[0]}}});
            },
            {"parameter 1 of unit 1 ('b')", "also parameter 0 of unit 0", "belongs to one unit"});
        expect_error(
            [&] {
              make({{"a", {params[0], params[0]}}});
            },
            {"parameter 1 of unit 0 ('a')", "also parameter 0 of unit 0"});
        auto other = at::zeros({4}, at::kDouble).requires_grad_();
        expect_error(
            [&] {
              make({{"a", {params[0], other}}});
            },
            {"parameter 1 of unit 0 ('a')", "dtype double", "share one device and dtype"});
        expect_error([&] { make({{"a", {}}}); }, {"unit 0 ('a') has no parameters"});
        expect_error(
            [&] {
              make({{"a", {params[0]}}, {"a", {params[1]}}});
            },
            {"two units are named 'a'"});
        auto base = at::zeros({8}).requires_grad_();
        auto view = base.detach().narrow(0, 0, 4).requires_grad_();
        expect_error([&] { make({{"a", {view}}}); }, {"must own its storage"});
        expect_error(
            [&] {
              make({{"a", {params[0].detach()}}});
            },
            {"leaf tensor that requires grad"});
        expect_error(
            [&] {
              make({{"a", {params[0]}}}, FullyShardedOptions().accumulation_steps(0));
            },
            {"accumulation_steps: got 0"});
        expect_error(
            [&] {
              make({{"a", {params[0]}}}, FullyShardedOptions().offload_state_to_cpu(true));
            },
            {"offload_state_to_cpu", "not supported yet"});
      },
      kTimeout);
}

TEST(FullyShardedErrors, MisuseIsAClearError) {
  run_ranks(
      1,
      [&](int, const Group& group) {
        ShardedRun run(Optim::kAdam, group, FullyShardedOptions());
        expect_error([&] { run.fsdp->step(); }, {"overlap_step", "run during backward"});
        expect_error([&] { run.fsdp->unit_index("9"); }, {"no unit is named '9'", "'0', '2', '4'"});
        expect_error([&] { run.fsdp->forward(7, [] { return at::ones({1}); }); },
                     {"unit 7 does not exist (3 units)"});
        expect_error([&] { run.fsdp->owner_of(at::ones({2})); }, {"no unit's parameter"});
      },
      kTimeout);
}

// Units that differ across ranks are an error on every rank at construction, not a hang.
TEST(FullyShardedErrors, UnitsThatDifferAcrossRanksFailOnEveryRank) {
  for (const bool count_differs : {true, false}) {
    run_ranks(
        2,
        [&](int rank, const Group& group) {
          auto model = make_mlp(6, rank == 0 || count_differs ? 10 : 12, 3, 5);
          auto units = shampoo::sequential_units(model);
          if (count_differs && rank == 1) units.pop_back();
          expect_error(
              [&] { FullyShardedDataParallel fsdp(units, factory_of(Optim::kAdam), group); },
              count_differs ? std::vector<std::string>{"units differ across ranks",
                                                       "rank 0 has 3 units, rank 1 has 2"}
                            : std::vector<std::string>{"units differ across ranks", "unit 0 ('0')",
                                                       "on rank 1 than on rank 0"});
        },
        kTimeout);
  }
}

// Options that decide the collectives, set otherwise on one rank: before, Gloo ended the process
// ("collective mismatch") or the ranks waited on each other; now an error on every rank at
// construction naming the option and both values.
TEST(FullyShardedErrors, OptionsThatDecideTheCollectivesMustAgreeAcrossRanks) {
  struct Change {
    std::function<FullyShardedOptions(FullyShardedOptions)> change;
    std::string says;
  };
  const std::vector<Change> changes{
      {[](FullyShardedOptions o) { return o.step_mode(shampoo::ShardedStepMode::kLocalShard); },
       "FullyShardedOptions.step_mode differs between the ranks: rank 1 has kLocalShard, rank 0 "
       "has kLossless"},
      {[](FullyShardedOptions o) { return o.reshard_after_forward(false); },
       "FullyShardedOptions.reshard_after_forward differs between the ranks: rank 1 has false"},
      {[](FullyShardedOptions o) { return o.overlap_step(false); },
       "FullyShardedOptions.overlap_step differs between the ranks: rank 1 has false"},
      {[](FullyShardedOptions o) { return o.accumulation_steps(2); },
       "FullyShardedOptions.accumulation_steps differs between the ranks: rank 1 has 2, rank 0 "
       "has 1"},
      {[](FullyShardedOptions o) { return o.reduce_dtype(at::kBFloat16); },
       "FullyShardedOptions.reduce_dtype differs between the ranks: rank 1 has BFloat16, rank 0 "
       "has unset"},
      {[](FullyShardedOptions o) { return o.broadcast_parameters(false).undo_failed_steps(false); },
       "FullyShardedOptions.broadcast_parameters differs between the ranks: rank 1 has false, "
       "rank 0 has true; FullyShardedOptions.undo_failed_steps differs"},
  };
  for (const auto& c : changes) {
    SCOPED_TRACE(c.says);
    run_ranks(
        2,
        [&](int rank, const Group& group) {
          auto model = make_mlp(6, 10, 3, 5);
          const auto options = rank == 0 ? FullyShardedOptions() : c.change(FullyShardedOptions());
          expect_error(
              [&] {
                FullyShardedDataParallel fsdp(shampoo::sequential_units(model),
                                              factory_of(Optim::kAdam), group, options);
              },
              {"every rank must be constructed with the same options", c.says});
        },
        kTimeout);
  }
}

}  // namespace
