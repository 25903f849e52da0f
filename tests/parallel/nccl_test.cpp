// The distributed pieces over NCCL on CUDA tensors (skipped without a GPU): DistributedShampoo's
// Distributor and the GradientSynchronizer. One GPU runs world 1 (every collective still goes
// through NCCL: the AllGather is issued at any world size); two or more GPUs run one rank per GPU
// as threads of this process.
#include <c10/core/DeviceGuard.h>
#include <shampoo/shampoo.h>
#include <torch/cuda.h>

#include <functional>

#include "parallel/process_group.h"
#include "support/test_support.h"

namespace {

using shampoo::DistributedOptions;
using shampoo::DistributedShampoo;
using shampoo::GradientSynchronizer;
using shampoo::ShampooOptions;
using shampoo::testing::all_close;
using shampoo::testing::bit_equal;
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

}  // namespace
