// Full sharding with one optimizer per rank: the parameters a rank owns, across every unit and in
// the user's param groups, go to one optimizer. DistributedShampoo merges the groups into one
// virtual group, and after backward it computes the roots of all the rank's blocks in one batched
// call per shape bucket. Param groups with their own lr and weight decay, a scheduler through
// the base class and a group added late equal the same groups under data parallelism bit for bit.
#include <shampoo/shampoo.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/schedulers/step_lr.h>

#include <memory>
#include <string>
#include <vector>

#include "parallel/sharding_runs.h"
#include "support/test_support.h"

namespace {

using shampoo::DistributedShampoo;
using shampoo::FullyShardedDataParallel;
using shampoo::FullyShardedOptions;
using shampoo::ShampooOptions;
using shampoo::testing::bit_equal;
using shampoo::testing::Dataset;
using shampoo::testing::make_mlp;
using shampoo::testing::run_ranks;
using shampoo::testing::sharding_batch;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

constexpr std::chrono::seconds kTimeout{60};

ShampooOptions base_options() {
  return shampoo::testing::sharding_shampoo_options(false).precondition_frequency(2);
}

shampoo::OptimizerFactory shampoo_factory() {
  return [](std::vector<torch::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<DistributedShampoo>(params, base_options());
  };
}

bool is_bias(const std::string& name) { return name.find("bias") != std::string::npos; }

std::vector<at::Tensor> params_where(torch::nn::Sequential& model, bool biases) {
  std::vector<at::Tensor> out;
  for (const auto& item : model->named_parameters()) {
    if (is_bias(item.key()) == biases) out.push_back(item.value());
  }
  return out;
}

/// The biases' group: another lr, no weight decay.
torch::optim::OptimizerParamGroup bias_group(torch::nn::Sequential& model) {
  return {params_where(model, true),
          std::make_unique<ShampooOptions>(ShampooOptions(base_options()).lr(0.03))};
}

/// Weights (weight decay 0.1) and, unless `late`, the biases (bias_group).
std::vector<torch::optim::OptimizerParamGroup> groups_of(torch::nn::Sequential& model, bool late) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(
      params_where(model, false),
      std::make_unique<ShampooOptions>(ShampooOptions(base_options()).weight_decay(0.1)));
  if (!late) groups.push_back(bias_group(model));
  return groups;
}

at::Tensor loss_of(const at::Tensor& logits, const Dataset& data) {
  return torch::nn::functional::cross_entropy(logits, data.labels);
}

constexpr int kSteps = 8;
constexpr int kLateAt = 3;

/// Data parallelism with one DistributedShampoo over the same groups on every rank, a StepLR
/// through the base class, and the biases added through the base class at kLateAt when `late`.
std::vector<at::Tensor> data_parallel(const Group& group, const Dataset& data, bool late) {
  auto model = make_mlp(6, 10, 3, /*seed=*/5);
  shampoo::GradientSynchronizer sync(model->parameters(), group);
  DistributedShampoo shampoo(groups_of(model, late), base_options());
  torch::optim::Optimizer& base = shampoo;
  torch::optim::StepLR scheduler(base, 3, 0.5);
  for (int step = 0; step < kSteps; ++step) {
    if (late && step == kLateAt) base.add_param_group(bias_group(model));
    base.zero_grad();
    loss_of(model->forward(data.inputs), data).backward();
    sync.synchronize();
    base.step();
    scheduler.step();
  }
  return shampoo::testing::snapshot(model->parameters());
}

TEST(FullyShardedOneOptimizerPerRank, ShampooParamGroupsEqualDataParallelismBitForBit) {
  for (const bool overlap : {true, false}) {
    for (const bool late : {false, true}) {
      run_ranks(
          2,
          [&](int rank, const Group& group) {
            const auto data = sharding_batch(rank, 2);
            const auto expected = data_parallel(group, data, late);
            auto model = make_mlp(6, 10, 3, /*seed=*/5);
            FullyShardedDataParallel fsdp(shampoo::sequential_units(model), groups_of(model, late),
                                          shampoo_factory(), group,
                                          FullyShardedOptions().overlap_step(overlap));
            torch::optim::Optimizer& base = fsdp.optimizer();
            torch::optim::StepLR scheduler(base, 3, 0.5);
            for (int step = 0; step < kSteps; ++step) {
              if (late && step == kLateAt) base.add_param_group(bias_group(model));
              base.zero_grad();
              loss_of(shampoo::forward_sequential(fsdp, model, data.inputs), data).backward();
              base.step();
              scheduler.step();
            }
            const auto where = "overlap " + std::to_string(overlap) + " late " +
                               std::to_string(late) + " rank " + std::to_string(rank);
            std::vector<at::Tensor> values;
            for (const auto& p : model->parameters()) values.push_back(fsdp.full_value(p));
            EXPECT_TRUE(bit_equal(values, expected)) << where;
            // One optimizer on this rank, over every parameter it owns, in one virtual group.
            const auto optimizers = fsdp.optimizers();
            ASSERT_EQ(optimizers.size(), 1u) << where;
            auto* shampoo = dynamic_cast<DistributedShampoo*>(optimizers[0]);
            ASSERT_NE(shampoo, nullptr) << where;
            EXPECT_EQ(shampoo->param_groups().size(), 2u) << where;
            EXPECT_EQ(shampoo->stats().virtual_groups, 1) << where;
            size_t owned = 0;
            for (const auto& p : model->parameters()) {
              const bool mine = fsdp.owner_of(p) == rank;
              owned += mine ? 1 : 0;
              EXPECT_EQ(fsdp.optimizer_of(p), mine ? optimizers[0] : nullptr) << where;
            }
            EXPECT_EQ(shampoo->state().size(), owned) << where;
            EXPECT_GT(owned, 0u) << where;
          },
          kTimeout);
    }
  }
}

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
      [](std::vector<torch::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
        return std::make_unique<DistributedShampoo>(params,
                                                    base_options().precondition_frequency(1));
      },
      group, FullyShardedOptions().overlap_step(overlap));
  torch::manual_seed(10 + rank);
  const auto input = torch::randn({12, 16});
  shampoo::forward_sequential(fsdp, model, input).square().sum().backward();
  if (!overlap) fsdp.step();
  const auto optimizers = fsdp.optimizers();
  EXPECT_EQ(optimizers.size(), 1u);
  const auto stats = dynamic_cast<DistributedShampoo&>(*optimizers.at(0)).stats();
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

}  // namespace
