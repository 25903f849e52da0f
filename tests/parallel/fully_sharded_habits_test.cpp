// Full sharding used with a LibTorch user's habits: a learning rate changed every iteration with
// the step overlapped in backward equals the same run without overlap bit for bit; zero_grad()
// at the top of the loop works; parameters of any row count train at any world size.
#include <ATen/CPUGeneratorImpl.h>
#include <shampoo/shampoo.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/schedulers/step_lr.h>

#include <memory>
#include <vector>

#include "parallel/sharding_runs.h"
#include "support/test_support.h"

namespace {

using shampoo::FullyShardedDataParallel;
using shampoo::FullyShardedOptions;
using shampoo::ShardedStepMode;
using shampoo::testing::all_close;
using shampoo::testing::bit_equal;
using shampoo::testing::Dataset;
using shampoo::testing::make_mlp;
using shampoo::testing::run_ranks;
using shampoo::testing::sharding_batch;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

constexpr std::chrono::seconds kTimeout{60};

shampoo::OptimizerFactory shampoo_factory() {
  return [](std::vector<torch::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
    // Roots every step: the step is long, so a race with the code after backward would show.
    return std::make_unique<shampoo::DistributedShampoo>(
        params, shampoo::testing::sharding_shampoo_options(false).precondition_frequency(1));
  };
}

shampoo::OptimizerFactory adam_factory() {
  return [](std::vector<torch::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
  };
}

at::Tensor loss_of(const at::Tensor& logits, const Dataset& data) {
  return torch::nn::functional::cross_entropy(logits, data.labels);
}

/// A batch of 48 points with 128 features per rank.
Dataset wide_batch(int rank) {
  const auto all = shampoo::testing::make_blobs(96, 128, 3, /*seed=*/9);
  return {all.inputs.narrow(0, rank * 48, 48), all.labels.narrow(0, rank * 48, 48)};
}

struct HabitRun {
  // The first layer's 128x128 factor keeps its root, the last step of backward, on the worker
  // for a while after backward returns.
  torch::nn::Sequential model = make_mlp(128, 32, 3, /*seed=*/5);
  std::unique_ptr<FullyShardedDataParallel> fsdp;

  HabitRun(const Group& group, bool overlap,
           const shampoo::OptimizerFactory& factory = shampoo_factory())
      : fsdp(std::make_unique<FullyShardedDataParallel>(
            shampoo::sequential_units(model), factory, group,
            FullyShardedOptions().overlap_step(overlap))) {}

  std::vector<at::Tensor> full_values() {
    std::vector<at::Tensor> out;
    for (const auto& p : model->parameters()) out.push_back(fsdp->full_value(p));
    return out;
  }
};

// A schedule applied right after backward, as a LibTorch loop does: with overlap the last units'
// steps were still running on the worker then, and took the next iteration's rate.
TEST(FullyShardedHabits, PerIterationLrScheduleWithOverlapEqualsWithoutBitForBit) {
  run_ranks(
      2,
      [&](int rank, const Group& group) {
        const auto data = wide_batch(rank);
        std::vector<std::vector<at::Tensor>> results;
        for (const bool overlap : {false, true}) {
          HabitRun run(group, overlap);
          std::vector<std::unique_ptr<torch::optim::StepLR>> schedulers;
          for (auto* optimizer : run.fsdp->optimizers()) {
            schedulers.push_back(std::make_unique<torch::optim::StepLR>(*optimizer, 1, 0.7));
          }
          for (int step = 0; step < 6; ++step) {
            loss_of(shampoo::forward_sequential(*run.fsdp, run.model, data.inputs), data)
                .backward();
            if (!overlap) run.fsdp->step();
            for (auto& scheduler : schedulers) scheduler->step();
            for (auto* optimizer : run.fsdp->optimizers()) {  // and set_lr on top of it
              auto& options = optimizer->param_groups()[0].options();
              options.set_lr(options.get_lr() * (step % 2 == 0 ? 1.5 : 0.5));
            }
          }
          results.push_back(run.full_values());
        }
        EXPECT_TRUE(bit_equal(results[1], results[0])) << "rank " << rank;
      },
      kTimeout);
}

// zero_grad() at the top of the loop, on the model and on every optimizer, as every loop does.
// Without the wait at the end of backward it met the last unit's step on the worker, which had
// set the parameters' gradients to views of the reduced ones ("Can't detach views in-place").
TEST(FullyShardedHabits, ZeroGradAtTheTopOfTheLoopWorks) {
  for (const bool adam : {true, false}) {
    run_ranks(
        2,
        [&](int rank, const Group& group) {
          const auto data = wide_batch(rank);
          std::vector<std::vector<at::Tensor>> results;
          for (const bool zero_grad : {false, true}) {
            HabitRun run(group, true, adam ? adam_factory() : shampoo_factory());
            for (int step = 0; step < (adam ? 30 : 6); ++step) {
              if (zero_grad) {
                for (auto* optimizer : run.fsdp->optimizers()) optimizer->zero_grad(false);
                run.model->zero_grad(/*set_to_none=*/false);
                for (auto* optimizer : run.fsdp->optimizers()) optimizer->zero_grad();
                run.model->zero_grad();
              }
              loss_of(shampoo::forward_sequential(*run.fsdp, run.model, data.inputs), data)
                  .backward();
            }
            results.push_back(run.full_values());
          }
          EXPECT_TRUE(bit_equal(results[1], results[0])) << "rank " << rank;
        },
        kTimeout);
  }
}

// Parameters with fewer rows than ranks (their chunk past the last row is empty on some ranks):
// rows 1..2·world at worlds 2, 3 and 4, lossless and local shards, train as data parallelism.
TEST(FullyShardedSmallParameters, AnyRowCountTrainsAtAnyWorldSize) {
  for (const int world : {2, 3, 4}) {
    for (const auto mode : {ShardedStepMode::kLossless, ShardedStepMode::kLocalShard}) {
      run_ranks(
          world,
          [&](int rank, const Group& group) {
            // One unit per row count: a [rows, 3] weight and a [rows] bias.
            const auto make = [&] {
              auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
              std::vector<at::Tensor> params;
              for (int64_t rows = 1; rows <= 2 * world; ++rows) {
                params.push_back(at::randn({rows, 3}, gen).requires_grad_());
                params.push_back(at::randn({rows}, gen).requires_grad_());
              }
              return params;
            };
            auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + rank);
            const auto x = at::randn({4, 3}, gen);
            const auto loss_of_unit = [&](const at::Tensor& w, const at::Tensor& b) {
              return (at::tanh(at::matmul(x, w.t()) + b)).pow(2).sum();
            };
            auto plain = make();
            shampoo::GradientSynchronizer sync(plain, group);
            auto adam = adam_factory()(plain);
            auto sharded = make();
            std::vector<shampoo::ShardedUnit> units;
            for (size_t i = 0; i < sharded.size(); i += 2) {
              units.push_back({std::to_string(i / 2), {sharded[i], sharded[i + 1]}});
            }
            FullyShardedDataParallel fsdp(units, adam_factory(), group,
                                          FullyShardedOptions().step_mode(mode));
            for (int step = 0; step < 3; ++step) {
              adam->zero_grad();
              at::Tensor loss = at::zeros({});
              for (size_t i = 0; i < plain.size(); i += 2) {
                loss = loss + loss_of_unit(plain[i], plain[i + 1]);
              }
              loss.backward();
              sync.synchronize();
              adam->step();
              at::Tensor sharded_loss = at::zeros({});
              for (size_t i = 0; i < sharded.size(); i += 2) {
                sharded_loss = sharded_loss + fsdp.forward(i / 2, [&] {
                  return loss_of_unit(sharded[i], sharded[i + 1]);
                });
              }
              sharded_loss.backward();
              EXPECT_NEAR(sharded_loss.item<float>(), loss.item<float>(),
                          1e-5 * std::abs(loss.item<float>()));
            }
            for (size_t i = 0; i < plain.size(); ++i) {
              EXPECT_TRUE(all_close(fsdp.full_value(sharded[i]), plain[i].detach(), {1e-5, 1e-6}))
                  << "world " << world << " parameter " << i << " rows " << plain[i].size(0);
            }
          },
          kTimeout);
    }
  }
}

}  // namespace
