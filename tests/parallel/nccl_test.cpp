// The distributed pieces over NCCL on CUDA tensors (skipped without a GPU): DistributedShampoo's
// Distributor, the GradientSynchronizer and full sharding (FullyShardedDataParallel). One GPU runs
// world 1 (every collective still goes through NCCL: the AllGather is issued at any world size);
// two or more GPUs run one rank per GPU as threads of this process.
#include <c10/core/DeviceGuard.h>
#include <shampoo/shampoo.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "parallel/communication/process_group.h"
#include "support/test_support.h"

namespace {

using shampoo::DistributedOptions;
using shampoo::DistributedShampoo;
using shampoo::FullyShardedDataParallel;
using shampoo::FullyShardedOptions;
using shampoo::GradientSynchronizer;
using shampoo::ShampooOptions;
using shampoo::testing::all_close;
using shampoo::testing::bit_equal;
using shampoo::testing::Dataset;
using shampoo::testing::run_ranks;
using shampoo::testing::snapshot;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

int64_t gpus() { return torch::cuda::is_available() ? torch::cuda::device_count() : 0; }

/// One rank per GPU, at most four.
int ranks_on_gpus() { return static_cast<int>(std::min<int64_t>(gpus(), 4)); }

/// Runs fn(rank, group, device) on `world` ranks as threads, rank r on GPU r (its current device),
/// with NCCL for CUDA tensors.
void run_ranks_on_gpus(int world,
                       const std::function<void(int, const Group&, const at::Device&)>& fn) {
  run_ranks(
      world,
      [&](int rank, const Group& group) {
        const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(rank));
        c10::DeviceGuard guard(device);
        fn(rank, group, device);
      },
      std::chrono::seconds(120), /*with_nccl=*/true);
}

/// Parameters of several shapes (blocked, odd-sized, 1-D, 3-D) on `device`.
std::vector<at::Tensor> make_params(const at::Device& device) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  std::vector<at::Tensor> params;
  for (const auto& shape :
       std::vector<std::vector<int64_t>>{{9, 7}, {13}, {4, 3, 5}, {20, 11}, {6}, {3, 17}}) {
    params.push_back(at::randn(shape, gen).to(device).requires_grad_());
  }
  return params;
}

ShampooOptions options() {
  return ShampooOptions::reference_defaults(0.02)
      .betas({0.9, 0.99})
      .epsilon(1e-6)
      .precondition_frequency(2)
      .max_preconditioner_dim(8)
      .grafting(shampoo::AdamGraftingConfig{0.99, 1e-8})
      .momentum(0.9);
}

constexpr int kSteps = 5;

/// One process without a process group, on `device`: parameters after every step.
std::vector<std::vector<at::Tensor>> single_process(const at::Device& device) {
  auto params = make_params(device);
  DistributedShampoo opt(params, options());
  std::vector<std::vector<at::Tensor>> trajectory;
  for (int step = 1; step <= kSteps; ++step) {
    shampoo::testing::set_random_grads(params, 700 + step);
    opt.step();
    trajectory.push_back(snapshot(params));
  }
  return trajectory;
}

TEST(NcclDistributedShampoo, World1OverNcclEqualsNoProcessGroup) {
  if (gpus() < 1) GTEST_SKIP() << "no CUDA device";
  const auto expected = single_process(at::Device(at::kCUDA, 0));
  run_ranks_on_gpus(1, [&](int, const Group& group, const at::Device& device) {
    ASSERT_TRUE(shampoo::detail::has_cuda_backend(*group));
    auto params = make_params(device);
    DistributedShampoo opt(params, options(), DistributedOptions().process_group(group));
    for (int step = 1; step <= kSteps; ++step) {
      shampoo::testing::set_random_grads(params, 700 + step);
      opt.step();
      ASSERT_EQ(opt.stats().collectives_last_step, 1);
      ASSERT_TRUE(bit_equal(snapshot(params), expected[step - 1])) << "step " << step;
    }
  });
}

TEST(NcclDistributedShampoo, OneRankPerGpuMatchesSingleProcess) {
  const int world = ranks_on_gpus();
  if (world < 2) GTEST_SKIP() << "needs 2 GPUs, found " << gpus();
  const auto expected = single_process(at::Device(at::kCUDA, 0));
  run_ranks_on_gpus(world, [&](int rank, const Group& group, const at::Device& device) {
    auto params = make_params(device);
    DistributedShampoo opt(params, options(), DistributedOptions().process_group(group));
    for (int step = 1; step <= kSteps; ++step) {
      shampoo::testing::set_random_grads(params, 700 + step);
      opt.step();
      // Ranks own different stacks of blocks, and cuBLAS/cuSOLVER may pick other kernels
      // for other batch sizes: float32 tolerance, not bits.
      for (size_t i = 0; i < params.size(); ++i) {
        ASSERT_TRUE(all_close(params[i].detach().cpu(), expected[step - 1][i].cpu()))
            << "rank " << rank << " step " << step << " param " << i;
      }
    }
  });
}

TEST(NcclGradientSynchronizer, AveragesGradientsAcrossRanks) {
  const int world = ranks_on_gpus();
  if (world < 1) GTEST_SKIP() << "no CUDA device";
  // Rank r's gradient of parameter i: a fixed random tensor times (r + 1); the average over the
  // ranks is that tensor times (world + 1) / 2.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  std::vector<at::Tensor> base;
  for (const auto& p : make_params(at::kCPU)) base.push_back(at::randn(p.sizes(), gen));
  run_ranks_on_gpus(world, [&](int rank, const Group& group, const at::Device& device) {
    auto params = make_params(device);
    GradientSynchronizer sync(params, group,
                              shampoo::GradientSynchronizerOptions().bucket_cap_bytes(256));
    // Gradients through autograd, so the synchronizer's hooks launch buckets in backward.
    at::Tensor loss = at::zeros({}, params[0].options().requires_grad(false));
    for (size_t i = 0; i < params.size(); ++i) {
      loss = loss + (params[i] * base[i].to(device) * static_cast<double>(rank + 1)).sum();
    }
    loss.backward();
    sync.synchronize();
    for (size_t i = 0; i < params.size(); ++i) {
      ASSERT_TRUE(params[i].grad().defined()) << "param " << i;
      ASSERT_TRUE(params[i].grad().is_cuda()) << "param " << i;
      const auto expected = base[i] * (static_cast<double>(world + 1) / 2.0);
      ASSERT_TRUE(all_close(params[i].grad().cpu(), expected)) << "rank " << rank << " param " << i;
    }
  });
}

// Full sharding over NCCL. Every rank is given the whole batch, so that at world 1 and 2 the
// averaged gradient is the one-process gradient exactly (g + g = 2g and 2g / 2 = g in float32):
// the parameters after every step must then equal those of the model trained in one process,
// without a process group, bit for bit (as fully_sharded_test promises against data parallelism
// on the CPU).

constexpr int kShardedSteps = 6;  // roots at steps 2, 4 and 6 (precondition_frequency 2)

enum class ShardedOptimizer { kShampoo, kAdam };

std::string optimizer_name(ShardedOptimizer which) {
  return which == ShardedOptimizer::kShampoo ? "shampoo" : "adam";
}

/// The one-process optimizer over `params`, and the factory of the fully sharded run.
shampoo::GroupOptimizerFactory factory_of(ShardedOptimizer which) {
  if (which == ShardedOptimizer::kAdam) {
    return shampoo::group_optimizer_factory<torch::optim::Adam>(
        torch::optim::AdamOptions(0.01).weight_decay(0.01));
  }
  return shampoo::group_optimizer_factory<DistributedShampoo>(options());
}

/// make_mlp(6, 20, 3) on `device`: weights of 20x6, 20x20 and 3x20, which max_preconditioner_dim
/// 8 splits into blocks of several shapes (and factors of 3, 4, 6 and 8 rows), and three biases.
torch::nn::Sequential mlp_on(const at::Device& device) {
  auto model = shampoo::testing::make_mlp(6, 20, 3, /*seed=*/5);
  model->to(device);
  return model;
}

Dataset batch_on(const at::Device& device) {
  const auto data = shampoo::testing::make_blobs(96, 6, 3, /*seed=*/21);
  return {data.inputs.to(device), data.labels.to(device)};
}

at::Tensor loss_of(const at::Tensor& logits, const Dataset& data) {
  return torch::nn::functional::cross_entropy(logits, data.labels);
}

/// Root computations so far of the DistributedShampoo among `optimizers` (0 for none).
int64_t roots_of(const std::vector<torch::optim::Optimizer*>& optimizers) {
  int64_t roots = 0;
  for (auto* optimizer : optimizers) {
    if (auto* shampoo = dynamic_cast<DistributedShampoo*>(optimizer)) {
      roots += shampoo->stats().amortized_computations;
    }
  }
  return roots;
}

/// The model trained in one process on `device`: the loss and the parameters after every step.
struct OneProcessRun {
  std::vector<float> losses;
  std::vector<std::vector<at::Tensor>> params;
  int64_t roots = 0;
};

OneProcessRun one_process(ShardedOptimizer which, const at::Device& device) {
  auto model = mlp_on(device);
  auto optimizer = factory_of(which)(torch::optim::OptimizerParamGroup(model->parameters()));
  const auto data = batch_on(device);
  OneProcessRun run;
  for (int step = 0; step < kShardedSteps; ++step) {
    optimizer->zero_grad();
    auto loss = loss_of(model->forward(data.inputs), data);
    loss.backward();
    optimizer->step();
    run.losses.push_back(loss.item<float>());
    run.params.push_back(snapshot(model->parameters()));
  }
  run.roots = roots_of({optimizer.get()});
  return run;
}

/// The same model on `device`, fully sharded over `group` (one unit per Linear layer).
struct FullyShardedRun {
  torch::nn::Sequential model;
  std::unique_ptr<FullyShardedDataParallel> fsdp;

  FullyShardedRun(ShardedOptimizer which, const Group& group, const at::Device& device,
                  FullyShardedOptions fsdp_options)
      : model(mlp_on(device)),
        fsdp(std::make_unique<FullyShardedDataParallel>(shampoo::sequential_units(model),
                                                        factory_of(which), group, fsdp_options)) {}

  float step(const Dataset& data) {
    auto loss = loss_of(shampoo::forward_sequential(*fsdp, model, data.inputs), data);
    loss.backward();  // with overlap_step the units step here, on the worker
    if (!fsdp->options().overlap_step()) fsdp->step();
    return loss.item<float>();
  }

  /// Every parameter's full value (collective).
  std::vector<at::Tensor> full_values() {
    std::vector<at::Tensor> out;
    for (const auto& p : model->parameters()) out.push_back(fsdp->full_value(p));
    return out;
  }

  /// Whether every shard this rank keeps lives on `device`.
  ::testing::AssertionResult shards_on(const at::Device& device) {
    for (const auto& p : model->parameters()) {
      if (fsdp->shard_of(p).device() != device) {
        return ::testing::AssertionFailure() << "a shard is on " << fsdp->shard_of(p).device();
      }
    }
    return ::testing::AssertionSuccess();
  }
};

/// World 1, and 2 when there are two GPUs.
std::vector<int> sharded_worlds() {
  std::vector<int> worlds{1};
  if (gpus() >= 2) worlds.push_back(2);
  return worlds;
}

/// Trains `which` fully sharded over NCCL at `world` (rank r on GPU r, each given the whole
/// batch) and compares the loss and every parameter after each step with the one-process run
/// on the same GPU, bit for bit. Comparisons use EXPECT, so that a rank that differs still
/// takes part in the other ranks' collectives.
void expect_fully_sharded_equals_one_process(ShardedOptimizer which, int world,
                                             const FullyShardedOptions& fsdp_options) {
  const auto what = optimizer_name(which) +
                    (fsdp_options.overlap_step() ? " overlapped" : " after backward") + " world " +
                    std::to_string(world);
  run_ranks_on_gpus(world, [&](int rank, const Group& group, const at::Device& device) {
    ASSERT_TRUE(shampoo::detail::has_cuda_backend(*group));
    const auto expected = one_process(which, device);
    FullyShardedRun run(which, group, device, fsdp_options);
    const auto data = batch_on(device);
    for (int step = 0; step < kShardedSteps; ++step) {
      const float loss = run.step(data);
      EXPECT_EQ(loss, expected.losses[step]) << what << " rank " << rank << " step " << step + 1;
      EXPECT_TRUE(bit_equal(run.full_values(), expected.params[step]))
          << what << " rank " << rank << " step " << step + 1;
    }
    EXPECT_TRUE(run.shards_on(device)) << what << " rank " << rank;
    EXPECT_EQ(run.fsdp->stats().steps_taken, kShardedSteps) << what;
    if (which == ShardedOptimizer::kShampoo && world == 1) {
      // The roots were computed, as many as in one process: the comparison covers them.
      EXPECT_GT(expected.roots, 0);
      EXPECT_EQ(roots_of(run.fsdp->optimizers()), expected.roots) << what;
    }
  });
}

TEST(NcclFullySharded, LosslessShampooEqualsOneProcessBitForBit) {
  if (gpus() < 1) GTEST_SKIP() << "no CUDA device";
  for (const int world : sharded_worlds()) {
    // The defaults: lossless, each unit stepped on the worker during backward.
    expect_fully_sharded_equals_one_process(ShardedOptimizer::kShampoo, world,
                                            FullyShardedOptions());
  }
}

TEST(NcclFullySharded, OverlapOffAndAdamAlsoMatch) {
  if (gpus() < 1) GTEST_SKIP() << "no CUDA device";
  for (const int world : sharded_worlds()) {
    expect_fully_sharded_equals_one_process(ShardedOptimizer::kShampoo, world,
                                            FullyShardedOptions().overlap_step(false));
    for (const bool overlap : {false, true}) {
      expect_fully_sharded_equals_one_process(ShardedOptimizer::kAdam, world,
                                              FullyShardedOptions().overlap_step(overlap));
    }
  }
}

// A checkpoint of CUDA shards and optimizer state, saved after 3 steps and loaded into a fresh
// wrapper, resumes the run as if uninterrupted, bit for bit.
TEST(NcclFullySharded, CheckpointResumesBitForBit) {
  if (gpus() < 1) GTEST_SKIP() << "no CUDA device";
  for (const int world : sharded_worlds()) {
    for (const auto which : {ShardedOptimizer::kShampoo, ShardedOptimizer::kAdam}) {
      const auto what = optimizer_name(which) + " world " + std::to_string(world);
      const auto dir = shampoo::testing::temp_path("nccl_fsdp_" + optimizer_name(which) + "_world" +
                                                   std::to_string(world));
      run_ranks_on_gpus(world, [&](int rank, const Group& group, const at::Device& device) {
        const auto data = batch_on(device);
        std::vector<at::Tensor> uninterrupted;
        {
          FullyShardedRun run(which, group, device, FullyShardedOptions());
          for (int step = 0; step < kShardedSteps; ++step) run.step(data);
          uninterrupted = run.full_values();
        }
        {
          FullyShardedRun run(which, group, device, FullyShardedOptions());
          for (int step = 0; step < kShardedSteps / 2; ++step) run.step(data);
          shampoo::save_distributed_state(*run.fsdp, dir);
        }
        FullyShardedRun resumed(which, group, device, FullyShardedOptions());
        shampoo::load_distributed_state(*resumed.fsdp, dir);
        EXPECT_EQ(resumed.fsdp->stats().steps_taken, kShardedSteps / 2) << what;
        EXPECT_TRUE(resumed.shards_on(device)) << what << " rank " << rank;
        for (int step = kShardedSteps / 2; step < kShardedSteps; ++step) resumed.step(data);
        EXPECT_TRUE(bit_equal(resumed.full_values(), uninterrupted)) << what << " rank " << rank;
      });
      shampoo::testing::remove_tree(dir);
    }
  }
}

}  // namespace
