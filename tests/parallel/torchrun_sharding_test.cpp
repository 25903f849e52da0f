// Gradient sharding (ZeRO-2) in real processes: a GoogleTest program launched by torchrun
// (CTest: --nproc-per-node 2 and 4, Gloo over loopback). Every rank joins through
// init_process_group_from_env and trains each optimizer kind unsharded and sharded side by side
// (parallel/sharding_runs.h): bit for bit equal at world 2; at world 4 the reduced gradients are
// within float32 rounding of the all-reduced ones (how many bit-identical is printed). Hybrid
// sharding's layouts against data parallelism, in the same processes.
#include <gtest/gtest.h>
#include <shampoo/shampoo.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>

#include <chrono>
#include <cmath>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "parallel/communication/collectives.h"
#include "parallel/sharding_runs.h"

namespace {

c10::intrusive_ptr<c10d::ProcessGroup>& process_group() {
  static c10::intrusive_ptr<c10d::ProcessGroup> group;
  return group;
}

using shampoo::testing::ShardingKind;

class TorchrunSharding : public ::testing::TestWithParam<ShardingKind> {};

TEST_P(TorchrunSharding, EqualsUnshardedDataParallelism) {
  const auto& group = process_group();
  const int rank = group->getRank();
  const int world = group->getSize();
  shampoo::testing::GradientAgreement agreement;
  shampoo::testing::check_sharded_equals_unsharded(GetParam(), rank, world, group, agreement);
  // Every rank's count, summed on every rank.
  const auto all = shampoo::detail::gather_int64(*group, {agreement.elements, agreement.bit_equal});
  int64_t elements = 0, same = 0;
  for (const auto& r : all) {
    elements += r[0];
    same += r[1];
  }
  if (rank == 0 && elements > 0) {
    std::cout << shampoo::testing::kind_name(GetParam()) << " world " << world << ": " << same
              << " of " << elements
              << " reduced gradient elements bit-identical to the all-reduced ones\n";
  }
  if (world == 2) {
    EXPECT_EQ(same, elements);
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, TorchrunSharding,
                         ::testing::Values(ShardingKind::kShampooRootInverse,
                                           ShardingKind::kShampooEigenvalueCorrected,
                                           ShardingKind::kShardedAdam,
                                           ShardingKind::kInBackwardShampoo),
                         [](const auto& info) { return shampoo::testing::kind_name(info.param); });

// Hybrid sharding in real processes: every layout of shard groups that divides the world (at 4:
// 2x2, 1x4, 4x1; at 2: 1x2, 2x1) trains Adam as plain data parallelism does, within float32
// summation noise; one shard group of every rank equals full sharding over the world bit for bit.
TEST(TorchrunHybrid, EveryLayoutFollowsDataParallelism) {
  const auto& group = process_group();
  const int rank = group->getRank();
  const int world = group->getSize();
  const auto data = shampoo::testing::sharding_batch(rank, world);
  const auto loss_of = [&](const at::Tensor& logits) {
    return torch::nn::functional::cross_entropy(logits, data.labels);
  };
  const auto adam =
      shampoo::group_optimizer_factory<torch::optim::Adam>(torch::optim::AdamOptions(0.01));
  auto plain = shampoo::testing::make_mlp(6, 10, 3, /*seed=*/5);
  shampoo::GradientSynchronizer sync(plain->parameters(), group);
  auto plain_adam = adam(torch::optim::OptimizerParamGroup(plain->parameters()));
  std::vector<torch::nn::Sequential> models;
  std::vector<std::unique_ptr<shampoo::FullyShardedDataParallel>> layouts;
  std::vector<int> sizes;
  for (int size = 1; size <= world; ++size) {
    if (world % size != 0) continue;
    const auto hybrid = shampoo::make_hybrid_groups(group, size);
    models.push_back(shampoo::testing::make_mlp(6, 10, 3, /*seed=*/5));
    layouts.push_back(std::make_unique<shampoo::FullyShardedDataParallel>(
        shampoo::sequential_units(models.back()), adam, hybrid.shard,
        shampoo::FullyShardedOptions().replica_group(hybrid.replica)));
    sizes.push_back(size);
  }
  auto full_model = shampoo::testing::make_mlp(6, 10, 3, /*seed=*/5);
  shampoo::FullyShardedDataParallel full(shampoo::sequential_units(full_model), adam, group);
  for (int step = 0; step < 6; ++step) {
    plain_adam->zero_grad();
    const float expected = loss_of(plain->forward(data.inputs)).item<float>();
    loss_of(plain->forward(data.inputs)).backward();
    sync.synchronize();
    plain_adam->step();
    auto full_loss = loss_of(shampoo::forward_sequential(full, full_model, data.inputs));
    full_loss.backward();
    for (size_t k = 0; k < layouts.size(); ++k) {
      auto loss = loss_of(shampoo::forward_sequential(*layouts[k], models[k], data.inputs));
      loss.backward();
      const auto where = std::to_string(sizes[k]) + "x" + std::to_string(world / sizes[k]) +
                         " rank " + std::to_string(rank) + " step " + std::to_string(step);
      EXPECT_NEAR(loss.item<float>(), expected, 1e-5 * std::abs(expected)) << where;
      if (sizes[k] == world) {
        EXPECT_EQ(loss.item<float>(), full_loss.item<float>()) << where;
      }
    }
  }
  const auto reference = plain->parameters();
  for (size_t k = 0; k < layouts.size(); ++k) {
    const auto params = models[k]->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      const auto value = layouts[k]->full_value(params[i]);
      EXPECT_TRUE(shampoo::testing::all_close(value, reference[i], {1e-5, 1e-6}))
          << sizes[k] << "x" << world / sizes[k] << " parameter " << i;
      if (sizes[k] == world) {
        EXPECT_TRUE(
            shampoo::testing::bit_equal(value, full.full_value(full_model->parameters()[i])))
            << "one shard group, parameter " << i;
      }
    }
  }
  // Every rank is past its last subgroup collective before any drops its groups.
  shampoo::detail::gather_int64(*group, {1});
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  process_group() = shampoo::init_process_group_from_env(std::chrono::seconds(120));
  // Only rank 0 prints gtest's progress; every rank's failures still fail its exit code.
  if (process_group()->getRank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int result = RUN_ALL_TESTS();
  process_group().reset();
  return result;
}
