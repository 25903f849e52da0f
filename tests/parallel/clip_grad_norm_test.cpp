// shampoo::clip_grad_norm_(optimizer, max_norm), the documented clipping call: under gradient
// sharding (ZeRO-2) it clips by the global norm, as LibTorch's clip_grad_norm_ does on the full
// averaged gradients of data parallelism (bit for bit), where LibTorch's own function, seeing
// only a rank's gradients, clips each rank by its own norm; with one process and with data
// parallelism it is LibTorch's; with full sharding it is the wrapper's.
#include <shampoo/shampoo.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>

#include <mutex>
#include <string>
#include <vector>

#include "parallel/sharding_runs.h"
#include "support/test_support.h"

namespace {

using shampoo::testing::bit_equal;
using shampoo::testing::classification_loss;
using shampoo::testing::run_ranks;
using shampoo::testing::ShardingKind;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

constexpr double kMaxNorm = 0.05;  // small: every step clips

/// Ten steps of `run` with clipping by `clip` between synchronize() and step().
std::vector<at::Tensor> train(shampoo::testing::TrainingRun& run, int rank,
                              const std::function<double(torch::optim::Optimizer&)>& clip,
                              std::vector<double>& norms) {
  const auto data = shampoo::testing::sharding_batch(rank, 2);
  for (int step = 0; step < 10; ++step) {
    run.optimizer->zero_grad();
    classification_loss(run.model, data, /*backward=*/true);
    run.sync->synchronize();
    norms.push_back(clip(*run.optimizer));
    run.optimizer->step();
  }
  return shampoo::testing::snapshot(run.model->parameters());
}

TEST(ClipGradNorm, UnderGradientShardingEqualsLibTorchsOnTheFullGradients) {
  for (const auto kind : {ShardingKind::kShardedAdam, ShardingKind::kShampooRootInverse}) {
    run_ranks(2, [&](int rank, const Group& group) {
      const auto libtorch = [](torch::optim::Optimizer& optimizer) {
        std::vector<at::Tensor> params;
        for (const auto& g : optimizer.param_groups()) {
          params.insert(params.end(), g.params().begin(), g.params().end());
        }
        return torch::nn::utils::clip_grad_norm_(params, kMaxNorm);
      };
      const auto ours = [](torch::optim::Optimizer& optimizer) {
        return shampoo::clip_grad_norm_(optimizer, kMaxNorm);
      };
      std::vector<double> expected_norms, norms, per_rank_norms;
      auto plain = shampoo::testing::make_run(kind, group, /*sharded=*/false, 256);
      const auto expected = train(plain, rank, libtorch, expected_norms);
      auto sharded = shampoo::testing::make_run(kind, group, /*sharded=*/true, 256);
      const auto actual = train(sharded, rank, ours, norms);
      EXPECT_TRUE(bit_equal(actual, expected)) << shampoo::testing::kind_name(kind);
      EXPECT_EQ(norms, expected_norms);
      EXPECT_GT(expected_norms.front(), kMaxNorm);
      // Data parallelism without sharding: the same call, the same result.
      auto replicated = shampoo::testing::make_run(kind, group, /*sharded=*/false, 256);
      std::vector<double> replicated_norms;
      EXPECT_TRUE(bit_equal(train(replicated, rank, ours, replicated_norms), expected));
      // LibTorch's function under sharding sees this rank's gradients only: another norm.
      auto trap = shampoo::testing::make_run(kind, group, /*sharded=*/true, 256);
      train(trap, rank, libtorch, per_rank_norms);
      EXPECT_NE(per_rank_norms.front(), expected_norms.front());
    });
  }
}

TEST(ClipGradNorm, OneProcessIsLibTorchsAndInBackwardIsAClearError) {
  auto model = shampoo::testing::make_mlp(6, 10, 3, /*seed=*/5);
  auto copy = shampoo::testing::make_mlp(6, 10, 3, /*seed=*/5);
  shampoo::DistributedShampoo shampoo_opt(model->parameters(), shampoo::ShampooOptions::reference_defaults(0.01));
  const auto data = shampoo::testing::make_blobs(32, 6, 3, /*seed=*/1);
  classification_loss(model, data, true);
  classification_loss(copy, data, true);
  const double norm = shampoo::clip_grad_norm_(shampoo_opt, kMaxNorm);
  const double expected = torch::nn::utils::clip_grad_norm_(copy->parameters(), kMaxNorm);
  EXPECT_EQ(norm, expected);
  std::vector<at::Tensor> grads, expected_grads;
  for (const auto& p : model->parameters()) grads.push_back(p.grad());
  for (const auto& p : copy->parameters()) expected_grads.push_back(p.grad());
  EXPECT_TRUE(bit_equal(grads, expected_grads));
  auto in_backward = shampoo::apply_optimizer_in_backward(
      model->parameters(), [](std::vector<at::Tensor> p) {
        return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(0.01));
      });
  shampoo::testing::expect_error([&] { shampoo::clip_grad_norm_(in_backward, 1.0); },
                                 {"InBackwardOptimizer", "during backward"});
}

}  // namespace
