// Full sharding used with a LibTorch user's habits: a learning rate changed every iteration with
// the step overlapped in backward equals the same run without overlap bit for bit; zero_grad()
// at the top of the loop works; parameters of any row count train at any world size; an lr set on
// the rank's optimizers directly is taken over into optimizer() (and so into checkpoints).
#include <ATen/CPUGeneratorImpl.h>
#include <shampoo/shampoo.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/serialize.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "parallel/communication/collectives.h"
#include "parallel/data_parallel/grad_ready_hooks.h"
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

shampoo::GroupOptimizerFactory shampoo_factory() {
  // Roots every step: the step is long, so a race with the code after backward would show.
  return shampoo::group_optimizer_factory<shampoo::DistributedShampoo>(
      shampoo::testing::sharding_shampoo_options(false).precondition_frequency(1));
}

shampoo::GroupOptimizerFactory adam_factory() {
  return shampoo::group_optimizer_factory<torch::optim::Adam>(torch::optim::AdamOptions(0.01));
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
           const shampoo::GroupOptimizerFactory& factory = shampoo_factory())
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
            auto adam = adam_factory()(torch::optim::OptimizerParamGroup(plain));
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

// ----- optimizer(): the model's optimizer as LibTorch code holds one -----

/// The optimizer of the param-group tests: LibTorch's Adam, or DistributedShampoo (roots every
/// second step).
enum class Kind { kAdam, kShampoo };

shampoo::ShampooOptions group_shampoo_options() {
  return shampoo::testing::sharding_shampoo_options(false).precondition_frequency(2);
}

/// `kind`'s options with this lr and weight decay.
std::unique_ptr<torch::optim::OptimizerOptions> options_of(Kind kind, double lr,
                                                           double weight_decay = 0.0) {
  if (kind == Kind::kAdam) {
    return std::make_unique<torch::optim::AdamOptions>(
        torch::optim::AdamOptions(lr).weight_decay(weight_decay));
  }
  return std::make_unique<shampoo::ShampooOptions>(
      shampoo::ShampooOptions(group_shampoo_options()).lr(lr).weight_decay(weight_decay));
}

/// One process's optimizer of `kind` over `params`, or over `groups`.
std::unique_ptr<torch::optim::Optimizer> optimizer_of(
    Kind kind, std::vector<torch::optim::OptimizerParamGroup> groups) {
  if (kind == Kind::kAdam) {
    return std::make_unique<torch::optim::Adam>(std::move(groups), torch::optim::AdamOptions(0.01));
  }
  return std::make_unique<shampoo::DistributedShampoo>(std::move(groups), group_shampoo_options());
}

shampoo::GroupOptimizerFactory factory_of(Kind kind) {
  return [kind](torch::optim::OptimizerParamGroup group) {
    std::vector<torch::optim::OptimizerParamGroup> one;
    one.push_back(std::move(group));
    return optimizer_of(kind, std::move(one));
  };
}

std::vector<at::Tensor> bias_params(torch::nn::Sequential& model) {
  std::vector<at::Tensor> out;
  for (const auto& item : model->named_parameters()) {
    if (item.key().find("bias") != std::string::npos) out.push_back(item.value());
  }
  return out;
}

/// The biases' group: lr 0.03, no weight decay.
torch::optim::OptimizerParamGroup bias_group(Kind kind, torch::nn::Sequential& model) {
  return {bias_params(model), options_of(kind, 0.03)};
}

/// Weights (lr 0.01, weight decay 0.1) and biases (bias_group) of make_mlp's model; `biases`
/// false leaves the biases out (added later).
std::vector<torch::optim::OptimizerParamGroup> mlp_groups(Kind kind, torch::nn::Sequential& model,
                                                          bool biases = true) {
  std::vector<at::Tensor> weights;
  for (const auto& item : model->named_parameters()) {
    if (item.key().find("bias") == std::string::npos) weights.push_back(item.value());
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(weights, options_of(kind, 0.01, 0.1));
  if (biases) groups.push_back(bias_group(kind, model));
  return groups;
}

/// A LibTorch loop over `optimizer` (generic code: the base class): a StepLR, the biases added
/// through the base class at iteration 3 when `late_biases`, `backward` running forward and
/// backward, `after_backward` what comes between backward and the step (data parallelism's
/// synchronize).
void generic_loop(Kind kind, torch::nn::Sequential& model, torch::optim::Optimizer& optimizer,
                  bool late_biases, int steps, const std::function<void()>& backward,
                  const std::function<void()>& after_backward) {
  torch::optim::StepLR scheduler(optimizer, 2, 0.5);
  for (int step = 0; step < steps; ++step) {
    if (late_biases && step == 3) optimizer.add_param_group(bias_group(kind, model));
    optimizer.zero_grad();
    backward();
    after_backward();
    optimizer.step();
    scheduler.step();
  }
}

/// Data parallelism with one process's optimizer over the same groups.
std::vector<at::Tensor> data_parallel_reference(Kind kind, const Group& group, const Dataset& data,
                                                bool late_biases, int steps) {
  auto model = make_mlp(6, 10, 3, /*seed=*/5);
  shampoo::GradientSynchronizer sync(model->parameters(), group);
  auto optimizer = optimizer_of(kind, mlp_groups(kind, model, !late_biases));
  generic_loop(
      kind, model, *optimizer, late_biases, steps,
      [&] { loss_of(model->forward(data.inputs), data).backward(); }, [&] { sync.synchronize(); });
  return shampoo::testing::snapshot(model->parameters());
}

// The user's param groups (their own lr and weight decay), a scheduler on optimizer() and a
// group added late through the base class equal the same under data parallelism bit for bit, for
// LibTorch's Adam and for Shampoo; each rank has one optimizer over the parameters it owns, and
// Shampoo merges its groups into one virtual group.
TEST(FullyShardedOptimizer, UserGroupsAndASchedulerEqualDataParallelismBitForBit) {
  for (const auto kind : {Kind::kAdam, Kind::kShampoo}) {
    for (const bool overlap : {true, false}) {
      for (const bool late_biases : {false, true}) {
        run_ranks(
            2,
            [&](int rank, const Group& group) {
              const auto data = sharding_batch(rank, 2);
              const auto expected = data_parallel_reference(kind, group, data, late_biases, 6);
              auto model = make_mlp(6, 10, 3, /*seed=*/5);
              FullyShardedDataParallel fsdp(shampoo::sequential_units(model),
                                            mlp_groups(kind, model, !late_biases), factory_of(kind),
                                            group, FullyShardedOptions().overlap_step(overlap));
              torch::optim::Optimizer& base = fsdp.optimizer();
              generic_loop(
                  kind, model, base, late_biases, 6,
                  [&] {
                    loss_of(shampoo::forward_sequential(fsdp, model, data.inputs), data).backward();
                  },
                  [] {});
              const auto where = std::string(kind == Kind::kAdam ? "adam" : "shampoo") +
                                 " overlap " + std::to_string(overlap) + " late biases " +
                                 std::to_string(late_biases) + " rank " + std::to_string(rank);
              std::vector<at::Tensor> values;
              for (const auto& p : model->parameters()) values.push_back(fsdp.full_value(p));
              EXPECT_TRUE(bit_equal(values, expected)) << where;
              EXPECT_EQ(base.state().size(), model->parameters().size());
              const auto& entry = dynamic_cast<const shampoo::ShardedParamState&>(
                  *base.state().at(model->parameters()[0].unsafeGetTensorImpl()));
              EXPECT_EQ(entry.step(), 6);
              EXPECT_EQ(entry.owner(), fsdp.owner_of(model->parameters()[0]));
              // One optimizer on this rank, over every parameter it owns, in the two groups.
              const auto optimizers = fsdp.optimizers();
              ASSERT_EQ(optimizers.size(), 1u) << where;
              EXPECT_EQ(optimizers[0]->param_groups().size(), 2u) << where;
              size_t owned = 0;
              for (const auto& p : model->parameters()) {
                const bool mine = fsdp.owner_of(p) == rank;
                owned += mine ? 1 : 0;
                EXPECT_EQ(fsdp.optimizer_of(p), mine ? optimizers[0] : nullptr) << where;
              }
              size_t held = 0;
              for (const auto& g : optimizers[0]->param_groups()) held += g.params().size();
              EXPECT_EQ(held, owned) << where;
              if (auto* shampoo = dynamic_cast<shampoo::DistributedShampoo*>(optimizers[0])) {
                EXPECT_EQ(shampoo->stats().virtual_groups, 1) << where;
              } else {
                EXPECT_EQ(kind, Kind::kAdam) << where;
              }
              // The same through the optimizer the user holds, without a cast.
              const auto stats = shampoo::shampoo_stats(base);
              EXPECT_EQ(stats.virtual_groups, kind == Kind::kShampoo ? 1 : 0) << where;
              const auto summary = shampoo::shampoo_memory_summary(base);
              EXPECT_EQ(summary.state_total(), stats.state_bytes) << where;
              EXPECT_EQ(stats.state_bytes > 0, kind == Kind::kShampoo) << where;
            },
            kTimeout);
      }
    }
  }
}

// The factory is called with this rank's share of the first group and that group's options, so
// a first group whose structural options differ from the factory's defaults (a smaller
// max_preconditioner_dim, which blocks the weights otherwise) trains as data parallelism does with
// the same groups, bit for bit. Before, the factory built its optimizer with its own defaults and
// the group's options came after: the first step failed ("structural option
// max_preconditioner_dim ... its value at construction").
TEST(FullyShardedOptimizer, TheFactoryBuildsFromTheFirstGroupsOptions) {
  run_ranks(
      2,
      [&](int rank, const Group& group) {
        const auto data = sharding_batch(rank, 2);
        const auto groups_of = [](torch::nn::Sequential& model) {
          auto groups = mlp_groups(Kind::kShampoo, model);
          auto& first = static_cast<shampoo::ShampooOptions&>(groups[0].options());
          first.max_preconditioner_dim(4);
          return groups;
        };
        auto plain = make_mlp(6, 10, 3, /*seed=*/5);
        shampoo::GradientSynchronizer sync(plain->parameters(), group);
        auto reference = optimizer_of(Kind::kShampoo, groups_of(plain));
        auto model = make_mlp(6, 10, 3, /*seed=*/5);
        FullyShardedDataParallel fsdp(shampoo::sequential_units(model), groups_of(model),
                                      factory_of(Kind::kShampoo), group);
        for (int step = 0; step < 4; ++step) {
          reference->zero_grad();
          loss_of(plain->forward(data.inputs), data).backward();
          sync.synchronize();
          reference->step();
          loss_of(shampoo::forward_sequential(fsdp, model, data.inputs), data).backward();
        }
        std::vector<at::Tensor> values;
        for (const auto& p : model->parameters()) values.push_back(fsdp.full_value(p));
        EXPECT_TRUE(bit_equal(values, shampoo::testing::snapshot(plain->parameters())))
            << "rank " << rank;
        for (auto* optimizer : fsdp.optimizers()) {
          const auto& options =
              static_cast<const shampoo::ShampooOptions&>(optimizer->param_groups()[0].options());
          EXPECT_EQ(options.max_preconditioner_dim(), 4);
        }
      },
      kTimeout);
}

// The rank's one LibTorch optimizer steps a unit's parameters on the worker while backward goes
// on with the other units, whose parameters autograd is giving gradients. It must not step a
// parameter that has a gradient but is not the unit's: here the first layer's weight keeps its
// unreduced gradient for 300 ms (a callback that runs before the wrapper's), while the worker
// steps the second layer; the result equals one process's Adam bit for bit (a double step of the
// weight would not).
TEST(FullyShardedOptimizer, AUnitsStepLeavesTheGradientsOfOtherUnitsAlone) {
  run_ranks(
      1,
      [&](int, const Group& group) {
        const auto data = sharding_batch(0, 1);
        auto reference = make_mlp(6, 10, 3, /*seed=*/5);
        torch::optim::Adam adam(reference->parameters(), torch::optim::AdamOptions(0.01));
        auto model = make_mlp(6, 10, 3, /*seed=*/5);
        const auto first_weight = model->parameters()[0];
        const auto handle = shampoo::detail::add_grad_ready_callback(
            first_weight,
            [](const at::Tensor&) { std::this_thread::sleep_for(std::chrono::milliseconds(300)); });
        {
          FullyShardedDataParallel fsdp(shampoo::sequential_units(model), factory_of(Kind::kAdam),
                                        group, FullyShardedOptions().overlap_step(true));
          for (int step = 0; step < 3; ++step) {
            adam.zero_grad();
            loss_of(reference->forward(data.inputs), data).backward();
            adam.step();
            loss_of(shampoo::forward_sequential(fsdp, model, data.inputs), data).backward();
          }
          std::vector<at::Tensor> values;
          for (const auto& p : model->parameters()) values.push_back(fsdp.full_value(p));
          EXPECT_TRUE(bit_equal(values, reference->parameters()));
        }
        shampoo::detail::remove_grad_ready_callback(first_weight, handle);
      },
      kTimeout);
}

TEST(FullyShardedOptimizer, ErrorsNameWhatTheUserCalledAndWhatToDo) {
  run_ranks(
      1,
      [&](int, const Group& group) {
        auto model = make_mlp(6, 10, 3, /*seed=*/5);
        FullyShardedDataParallel fsdp(shampoo::sequential_units(model), adam_factory(), group);
        const auto clip = [&] { fsdp.clip_grad_norm_(1.0); };
        shampoo::testing::expect_error(clip, {"clip_grad_norm_", "overlap_step(false)"});
        try {
          clip();
        } catch (const c10::Error& e) {
          const std::string message = e.what_without_backtrace();
          EXPECT_EQ(message.find("reduced_gradients"), std::string::npos) << message;
          EXPECT_EQ(message.find("GradScaler"), std::string::npos) << message;
        }
        shampoo::GradScaler scaler(shampoo::GradScalerOptions().process_group(group));
        shampoo::testing::expect_error([&] { scaler.unscale_(fsdp.optimizer()); },
                                       {"GradScaler::unscale_", "overlap_step(false)"});
        shampoo::testing::expect_error([&] { scaler.unscale_(fsdp); },
                                       {"GradScaler::unscale_", "overlap_step(false)"});
        // The scaler's hooks are an internal object's, the same through the model and its
        // optimizer(); called on the model itself they are an error, not a step.
        auto& through_optimizer = dynamic_cast<shampoo::ScaledStepping&>(fsdp.optimizer());
        EXPECT_EQ(&through_optimizer.scaling_target(), &fsdp.scaling_target());
        EXPECT_NE(&fsdp.scaling_target(), static_cast<shampoo::ScaledStepping*>(&fsdp));
        shampoo::testing::expect_error([&] { fsdp.scaled_step(); }, {"GradScaler::step"});
        shampoo::testing::expect_error(
            [&] { torch::save(fsdp.optimizer(), shampoo::testing::temp_path("x.pt")); },
            {"torch::save(optimizer)", "save_distributed_checkpoint"});
        shampoo::testing::expect_error(
            [&] {
              fsdp.optimizer().add_param_group(
                  torch::optim::OptimizerParamGroup({at::ones({2}).requires_grad_()}));
              fsdp.optimizer().step();
              loss_of(shampoo::forward_sequential(fsdp, model, sharding_batch(0, 1).inputs),
                      sharding_batch(0, 1));
            },
            {"param group 1", "no unit's parameter"});
      },
      kTimeout);
}

// A disabled GradScaler is a no-op in every mode (torch.amp's is): with the step overlapped in
// backward, scaler.step() does nothing, and the run equals the same run without a scaler.
TEST(FullyShardedOptimizer, ADisabledGradScalerIsANoOp) {
  for (const bool overlap : {true, false}) {
    run_ranks(
        2,
        [&](int rank, const Group& group) {
          const auto data = sharding_batch(rank, 2);
          std::vector<std::vector<at::Tensor>> results;
          for (const bool with_scaler : {false, true}) {
            auto model = make_mlp(6, 10, 3, /*seed=*/5);
            FullyShardedDataParallel fsdp(shampoo::sequential_units(model), adam_factory(), group,
                                          FullyShardedOptions().overlap_step(overlap));
            shampoo::GradScaler scaler(
                shampoo::GradScalerOptions().enabled(false).process_group(group));
            for (int step = 0; step < 4; ++step) {
              auto loss = loss_of(shampoo::forward_sequential(fsdp, model, data.inputs), data);
              if (with_scaler) {
                scaler.scale(loss).backward();
                scaler.unscale_(fsdp);
                scaler.step(fsdp);
                scaler.unscale_(fsdp.optimizer());
                scaler.update();
              } else {
                loss.backward();
                if (!overlap) fsdp.step();
              }
            }
            std::vector<at::Tensor> values;
            for (const auto& p : model->parameters()) values.push_back(fsdp.full_value(p));
            results.push_back(values);
          }
          EXPECT_TRUE(bit_equal(results[1], results[0])) << "overlap " << overlap;
        },
        kTimeout);
  }
}

/// The full values of `model`'s parameters (every rank gathers them), kept in `out` by rank 0.
void keep_rank0_values(FullyShardedDataParallel& fsdp, torch::nn::Module& model, int rank,
                       std::mutex& mutex, std::vector<at::Tensor>& out) {
  std::vector<at::Tensor> values;
  for (const auto& p : model.parameters()) values.push_back(fsdp.full_value(p));
  std::lock_guard<std::mutex> lock(mutex);
  if (rank == 0) out = values;
}

// A checkpoint saved in the middle of a gradient accumulation (after an odd number of backward
// passes with accumulation_steps 2) resumes to the uninterrupted run, at the same and at another
// world size.
TEST(FullyShardedMidAccumulation, ACheckpointResumesAsUninterrupted) {
  const auto dir = shampoo::testing::temp_path("fsdp_mid_accumulation");
  const auto run = [&](int world, int passes, bool load, bool save, std::vector<at::Tensor>& out) {
    std::mutex mutex;
    run_ranks(
        world,
        [&](int rank, const Group& group) {
          const auto all = sharding_batch(0, 1);
          auto model = make_mlp(6, 10, 3, /*seed=*/5);
          FullyShardedDataParallel fsdp(shampoo::sequential_units(model), shampoo_factory(), group,
                                        FullyShardedOptions().accumulation_steps(2));
          if (load) shampoo::load_distributed_checkpoint(fsdp.optimizer(), dir);
          for (int pass = fsdp.stats().backward_passes; pass < passes; ++pass) {
            // The same micro-batches whatever the world: pass p's 24 points, split by rank.
            const int per_rank = 24 / world;
            const auto begin = (pass % 4) * 24 + rank * per_rank;
            const Dataset micro{all.inputs.narrow(0, begin, per_rank),
                                all.labels.narrow(0, begin, per_rank)};
            loss_of(shampoo::forward_sequential(fsdp, model, micro.inputs), micro).backward();
          }
          if (save) shampoo::save_distributed_checkpoint(fsdp.optimizer(), dir);
          keep_rank0_values(fsdp, *model, rank, mutex, out);
        },
        kTimeout);
  };
  std::vector<at::Tensor> uninterrupted, saved, resumed;
  run(2, 8, false, false, uninterrupted);
  run(2, 5, false, true, saved);  // 5 passes: the third step's first micro-batch accumulated
  run(2, 8, true, false, resumed);
  EXPECT_TRUE(bit_equal(resumed, uninterrupted)) << "resumed at world 2";
  run(1, 8, true, false, resumed);
  for (size_t i = 0; i < resumed.size(); ++i) {
    EXPECT_TRUE(all_close(resumed[i], uninterrupted[i], {1e-3, 1e-4})) << "world 1, " << i;
  }
  shampoo::testing::remove_tree(dir);
}

// A parameter that never has a gradient (registered on a unit, unused by its forward) and one that
// first has a gradient after the save, with lossless full sharding: the checkpoint holds their
// optimizer state as every other's, and the run resumed at world 2 equals the uninterrupted one
// bit for bit (at world 3 within rounding: the gradients are averaged over other splits).
TEST(FullyShardedCheckpoints, ParametersWithoutGradientsResume) {
  const auto dir = shampoo::testing::temp_path("fsdp_gradient_free");
  constexpr int kSave = 3;
  const auto run = [&](int world, int from, int to, bool load, bool save,
                       std::vector<at::Tensor>& out) {
    std::mutex mutex;
    run_ranks(
        world,
        [&](int rank, const Group& group) {
          auto model = make_mlp(6, 10, 3, /*seed=*/5);
          auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
          model[0]->register_parameter("never", at::randn({4, 5}, gen));
          model[2]->register_parameter("later", at::randn({3}, gen));
          auto later = model[2]->named_parameters(false)["later"];
          FullyShardedDataParallel fsdp(
              shampoo::sequential_units(model), shampoo_factory(), group,
              FullyShardedOptions().overlap_step(false).reshard_after_forward(false));
          if (load) shampoo::load_distributed_checkpoint(fsdp.optimizer(), dir);
          for (int step = from; step < to; ++step) {
            const auto data = sharding_batch(rank, world);
            fsdp.optimizer().zero_grad();
            auto loss = loss_of(shampoo::forward_sequential(fsdp, model, data.inputs), data);
            // "later" enters the loss from step kSave + 1 on (its unit's forward ran and kept
            // the gathered value: reshard_after_forward off); no gradient before.
            if (step > kSave) loss = loss + later.square().sum() * 0.01;
            loss.backward();
            fsdp.optimizer().step();
          }
          if (save) shampoo::save_distributed_checkpoint(fsdp.optimizer(), dir);
          keep_rank0_values(fsdp, *model, rank, mutex, out);
        },
        kTimeout);
  };
  std::vector<at::Tensor> initial, uninterrupted, saved, resumed;
  run(2, 0, 0, false, false, initial);
  run(2, 0, 6, false, false, uninterrupted);
  run(2, 0, kSave, false, true, saved);
  run(2, kSave, 6, true, false, resumed);
  ASSERT_EQ(uninterrupted.size(), 8u);  // [0] weight, bias, never; [2] weight, bias, later; [4] ..
  EXPECT_TRUE(at::equal(uninterrupted[2], initial[2]));   // "never" never moved
  EXPECT_FALSE(at::equal(uninterrupted[5], initial[5]));  // "later" did, after the save
  EXPECT_TRUE(bit_equal(resumed, uninterrupted)) << "resumed at world 2";
  run(3, kSave, 6, true, false, resumed);
  for (size_t i = 0; i < resumed.size(); ++i) {
    EXPECT_TRUE(all_close(resumed[i], uninterrupted[i], {1e-3, 1e-4})) << "world 3, " << i;
  }
  shampoo::testing::remove_tree(dir);
}

// An lr set on the rank's optimizers directly (optimizers(), as a scheduler attached to them sets
// it) is taken over into optimizer()'s groups, so that a checkpoint saves the lr that steps (as
// LibTorch's optimizer saves the lr set on it): the resumed run equals the uninterrupted one.
// Before, optimizer() kept the old lr and the resumed run stepped with it.
TEST(FullyShardedOptions, AnLrSetOnTheOptimizersDirectlyIsWhatACheckpointSaves) {
  const auto dir = shampoo::testing::temp_path("fsdp_direct_lr");
  const auto run = [&](bool load, bool save, std::vector<at::Tensor>& out) {
    std::mutex mutex;
    run_ranks(
        2,
        [&](int rank, const Group& group) {
          const auto data = wide_batch(rank);
          auto model = make_mlp(128, 32, 3, /*seed=*/5);
          FullyShardedDataParallel fsdp(shampoo::sequential_units(model), adam_factory(), group);
          if (load) shampoo::load_distributed_checkpoint(fsdp.optimizer(), dir);
          for (int step = load ? 2 : 0; step < 4; ++step) {
            if (step == 2 && !load) {
              for (auto* optimizer : fsdp.optimizers()) {
                optimizer->param_groups()[0].options().set_lr(0.001);
              }
              if (save) {
                shampoo::save_distributed_checkpoint(fsdp.optimizer(), dir);
                EXPECT_EQ(fsdp.optimizer().param_groups()[0].options().get_lr(), 0.001);
                break;
              }
            }
            fsdp.optimizer().zero_grad();
            loss_of(shampoo::forward_sequential(fsdp, model, data.inputs), data).backward();
            fsdp.optimizer().step();
          }
          keep_rank0_values(fsdp, *model, rank, mutex, out);
        },
        kTimeout);
  };
  std::vector<at::Tensor> uninterrupted, saved, resumed;
  run(false, false, uninterrupted);
  run(false, true, saved);
  run(true, false, resumed);
  EXPECT_TRUE(bit_equal(resumed, uninterrupted));
  shampoo::testing::remove_tree(dir);
}

// The lr set on optimizers() must be one lr for the whole group: set on some of the units'
// optimizers and not others, to different values, or on both optimizer() and optimizers(), it is
// an error naming both sides, and nothing changed.
TEST(FullyShardedOptions, AnLrSetOnSomeOptimizersOrOnBothSidesIsAClearError) {
  run_ranks(
      1,
      [&](int rank, const Group& group) {
        const auto data = wide_batch(rank);
        auto model = make_mlp(128, 32, 3, /*seed=*/5);
        FullyShardedDataParallel fsdp(
            shampoo::sequential_units(model), adam_factory(), group,
            FullyShardedOptions().step_mode(ShardedStepMode::kLocalShard).overlap_step(false));
        const auto iteration = [&] {
          loss_of(shampoo::forward_sequential(fsdp, model, data.inputs), data).backward();
          fsdp.step();
        };
        iteration();
        auto optimizers = fsdp.optimizers();
        ASSERT_GE(optimizers.size(), 2u);
        const auto lr_of = [](torch::optim::Optimizer* optimizer) {
          return optimizer->param_groups()[0].options().get_lr();
        };
        optimizers[0]->param_groups()[0].options().set_lr(0.5);
        shampoo::testing::expect_error(iteration, {"param group 0", "was set on 1 of the",
                                                   "optimizers()", "set it on optimizer()"});
        optimizers[1]->param_groups()[0].options().set_lr(0.25);
        for (size_t i = 2; i < optimizers.size(); ++i) {
          optimizers[i]->param_groups()[0].options().set_lr(0.5);
        }
        shampoo::testing::expect_error(iteration, {"different values", "0.5", "0.25"});
        for (auto* optimizer : optimizers) optimizer->param_groups()[0].options().set_lr(0.5);
        fsdp.optimizer().param_groups()[0].options().set_lr(0.125);
        shampoo::testing::expect_error(iteration, {"both on optimizer()", "0.125", "0.5"});
        EXPECT_EQ(lr_of(optimizers[0]), 0.5) << "nothing changed";
        fsdp.optimizer().param_groups()[0].options().set_lr(0.01);  // as pushed last
        iteration();
        EXPECT_EQ(fsdp.optimizer().param_groups()[0].options().get_lr(), 0.5) << "taken over";
        for (auto* optimizer : optimizers) EXPECT_EQ(lr_of(optimizer), 0.5);
      },
      kTimeout);
}

// With more ranks than parameters, a rank that owns none holds an optimizer over no parameters
// too, so that an lr set through optimizers() on every rank reaches optimizer() on every rank
// (before, that rank had no optimizer to set, and its optimizer() kept the old lr).
TEST(FullyShardedOptions, ARankThatOwnsNoParameterTakesOverTheLrToo) {
  run_ranks(
      3,
      [&](int rank, const Group& group) {
        const auto data = wide_batch(rank % 2);
        torch::nn::Sequential model(torch::nn::Linear(128, 3));  // two parameters, three ranks
        FullyShardedDataParallel fsdp(shampoo::sequential_units(model), adam_factory(), group);
        const auto iteration = [&] {
          fsdp.optimizer().zero_grad();
          loss_of(shampoo::forward_sequential(fsdp, model, data.inputs), data).backward();
          fsdp.optimizer().step();
        };
        iteration();
        int owned = 0;
        for (const auto& p : model->parameters()) owned += fsdp.owner_of(p) == rank ? 1 : 0;
        const auto counts = shampoo::detail::gather_int64(*group, {owned});
        EXPECT_TRUE(counts[0][0] == 0 || counts[1][0] == 0 || counts[2][0] == 0)
            << "one rank owns no parameter";
        ASSERT_EQ(fsdp.optimizers().size(), 1u) << "rank " << rank << " owns " << owned;
        for (auto* optimizer : fsdp.optimizers()) {
          optimizer->param_groups()[0].options().set_lr(0.002);
        }
        iteration();
        EXPECT_EQ(fsdp.optimizer().param_groups()[0].options().get_lr(), 0.002)
            << "rank " << rank << " owns " << owned;
      },
      kTimeout);
}

/// LibTorch's Adam whose step throws while `fail` is set (one rank's optimizer error).
class FailingAdam : public torch::optim::Adam {
 public:
  FailingAdam(std::vector<at::Tensor> params, const bool* fail)
      : torch::optim::Adam(std::move(params), torch::optim::AdamOptions(0.01)), fail_(fail) {}
  torch::Tensor step(LossClosure closure = nullptr) override {
    TORCH_CHECK(!*fail_, "injected optimizer failure");
    return torch::optim::Adam::step(std::move(closure));
  }

 private:
  const bool* fail_;
};

// Hybrid 2x2, the step overlapped in backward: an optimizer's error on one rank of one replica
// fails the iteration on every rank of both replicas, with nothing changed anywhere (the steps of
// the pass undone from their copies), so the replicas stay equal (a replica that stepped while
// the other undid would part them). The state split across the replicas or not. (After backward
// the ranks keep no copies: the error then says that the other ranks' state advanced.)
TEST(FullyShardedHybridFailures, OneReplicasOptimizerErrorFailsEveryReplica) {
  for (const bool split : {false, true}) {
    for (const bool overlap : {true}) {
      run_ranks(
          4,
          [&](int rank, const Group& group) {
            const auto data = sharding_batch(rank, 4);
            const auto hybrid = shampoo::make_hybrid_groups(group, 2);
            bool fail = false;
            auto model = make_mlp(6, 10, 3, /*seed=*/5);
            FullyShardedDataParallel fsdp(
                shampoo::sequential_units(model),
                [&fail, rank](torch::optim::OptimizerParamGroup group)
                    -> std::unique_ptr<torch::optim::Optimizer> {
                  static const bool never = false;
                  return std::make_unique<FailingAdam>(group.params(), rank == 3 ? &fail : &never);
                },
                hybrid.shard,
                FullyShardedOptions()
                    .overlap_step(overlap)
                    .replica_group(hybrid.replica)
                    .split_across_replicas(split));
            const auto iterate = [&] {
              loss_of(shampoo::forward_sequential(fsdp, model, data.inputs), data).backward();
              if (!overlap) fsdp.step();
            };
            const auto where = std::string(split ? "split" : "replicated") +
                               (overlap ? " overlap" : " after backward") + " rank " +
                               std::to_string(rank);
            iterate();
            std::vector<at::Tensor> before;
            for (const auto& p : model->parameters()) before.push_back(fsdp.full_value(p));
            fail = true;
            shampoo::testing::expect_error(iterate, {"FullyShardedDataParallel: ", "fail"});
            fail = false;
            std::vector<at::Tensor> after;
            for (const auto& p : model->parameters()) after.push_back(fsdp.full_value(p));
            EXPECT_TRUE(bit_equal(after, before)) << where;
            iterate();  // the next iteration runs, and the replicas stay equal
            const auto mine = fsdp.full_value(model->parameters()[0]);
            const auto sums = shampoo::detail::gather_int64(
                *hybrid.replica, {static_cast<int64_t>(mine.sum().item<double>() * 1e6)});
            EXPECT_EQ(sums[0][0], sums[1][0]) << where;
          },
          kTimeout);
    }
  }
}

// A non-finite gradient on one rank, without a GradScaler: every rank fails the iteration with
// a clear error, nothing changes (the units stepped earlier in the same backward are undone),
// and the next iteration works, as with data parallelism. Poisoned either in the loss (every
// gradient of rank 1) or in the middle layer's weight alone (after the last layer stepped).
TEST(FullyShardedNonFinite, OneRanksBadGradientFailsEveryRankAndChangesNothing) {
  for (const bool overlap : {true, false}) {
    for (const bool middle_only : {false, true}) {
      std::vector<std::vector<at::Tensor>> finals(2);
      for (const bool poison : {false, true}) {
        std::mutex mutex;
        run_ranks(
            2,
            [&](int rank, const Group& group) {
              const auto data = sharding_batch(rank, 2);
              auto model = make_mlp(6, 10, 3, /*seed=*/5);
              FullyShardedDataParallel fsdp(shampoo::sequential_units(model), shampoo_factory(),
                                            group, FullyShardedOptions().overlap_step(overlap));
              const auto values = [&] {
                std::vector<at::Tensor> out;
                for (const auto& p : model->parameters()) out.push_back(fsdp.full_value(p));
                return out;
              };
              for (int step = 0; step < 6; ++step) {
                const bool bad = step == 3;
                if (bad && !poison) continue;  // the reference skips that batch
                const auto before = bad ? values() : std::vector<at::Tensor>{};
                // The model's forward unit by unit; the middle layer's weight gets a hook that
                // makes its gradient NaN (registered while the unit is gathered).
                at::Tensor x = data.inputs;
                auto middle = model->ptr(2)->as<torch::nn::Linear>()->weight;
                int64_t handle = -1;
                size_t i = 0;
                for (auto& module : *model) {
                  const size_t index = i++;
                  if (module.ptr()->parameters().empty()) {
                    x = module.forward(x);
                    continue;
                  }
                  x = fsdp.forward(fsdp.unit_index(std::to_string(index)), [&]() -> at::Tensor {
                    if (index == 2 && bad && rank == 1 && middle_only) {
                      handle = middle.register_hook([](const at::Tensor& g) {
                        return g * std::numeric_limits<float>::quiet_NaN();
                      });
                    }
                    return module.forward(x);
                  });
                }
                auto loss = loss_of(x, data);
                if (bad && rank == 1 && !middle_only) {
                  loss = loss * std::numeric_limits<float>::infinity();
                }
                const auto iteration = [&] {
                  loss.backward();
                  if (!overlap) fsdp.optimizer().step();
                };
                if (!bad) {
                  iteration();
                  continue;
                }
                shampoo::testing::expect_error(
                    iteration, {"failed on rank(s)", "no unit was stepped in this iteration"});
                if (handle >= 0) middle.remove_hook(handle);
                EXPECT_TRUE(bit_equal(values(), before))
                    << "overlap " << overlap << " middle " << middle_only << " rank " << rank;
              }
              auto out = values();
              std::lock_guard<std::mutex> lock(mutex);
              if (rank == 0) finals[poison ? 1 : 0] = out;
            },
            kTimeout);
      }
      EXPECT_TRUE(bit_equal(finals[1], finals[0]))
          << "overlap " << overlap << " middle " << middle_only
          << ": the iteration after the failure trains as if the bad batch was skipped";
    }
  }
}

// Under hybrid sharding a failure names global ranks and the shard group: global rank 3's loss is
// inf, every rank's averaged gradients are then non-finite (they are all-reduced across the
// replicas), and each rank's error names the owners that found them by their global ranks (before,
// "rank(s) 0, 1" in every replica, ranks of the shard group).
TEST(FullyShardedHybridFailures, ErrorsNameGlobalRanksAndTheShardGroup) {
  for (const bool overlap : {true, false}) {
    run_ranks(
        4,
        [&](int rank, const Group& group) {
          const auto hybrid = shampoo::make_hybrid_groups(group, 2);
          auto model = make_mlp(6, 10, 3, /*seed=*/5);
          FullyShardedDataParallel fsdp(
              shampoo::sequential_units(model), adam_factory(), hybrid.shard,
              FullyShardedOptions().overlap_step(overlap).replica_group(hybrid.replica));
          const auto data = sharding_batch(rank, 4);
          auto loss = loss_of(shampoo::forward_sequential(fsdp, model, data.inputs), data);
          if (rank == 3) loss = loss * std::numeric_limits<float>::infinity();
          const int replica = rank / 2;
          std::string message;
          try {
            loss.backward();
            if (!overlap) fsdp.optimizer().step();
          } catch (const c10::Error& e) {
            message = e.what_without_backtrace();
          }
          // The owners in this rank's shard group, by global rank: 2r and 2r + 1 for ranks 0 and
          // 1 of shard group r.
          std::smatch found;
          ASSERT_TRUE(std::regex_search(
              message, found,
              std::regex("failed on global rank\\(s\\) ([0-9, ]+) \\(rank\\(s\\) ([0-9, ]+) of "
                         "shard group ([0-9])\\)")))
              << message;
          EXPECT_EQ(found[3].str(), std::to_string(replica)) << message;
          const auto global = found[1].str();
          const auto local = found[2].str();
          EXPECT_TRUE((local == "0" && global == std::to_string(2 * replica)) ||
                      (local == "1" && global == std::to_string(2 * replica + 1)) ||
                      (local == "0, 1" && global == std::to_string(2 * replica) + ", " +
                                                        std::to_string(2 * replica + 1)))
              << message;
          EXPECT_TRUE(message.find("holds inf or NaN") != std::string::npos ||
                      message.find("the error there says why") != std::string::npos)
              << message;
        },
        kTimeout);
  }
}

// ----- tied weights: an embedding that is also the output projection -----

/// A language model whose output projection is its embedding's weight: embedding (16 x 8), a
/// tanh layer (8 x 8), logits = h · Wᵀ.
struct TiedModel {
  torch::nn::Embedding embedding{torch::nn::EmbeddingOptions(16, 8)};
  torch::nn::Linear body{torch::nn::LinearOptions(8, 8)};
  TiedModel() {
    at::NoGradGuard no_grad;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
    for (auto* p : {&embedding->weight, &body->weight, &body->bias}) {
      p->copy_(at::randn(p->sizes(), gen) * 0.5);
    }
  }
  std::vector<at::Tensor> params() const { return {embedding->weight, body->weight, body->bias}; }
};

/// 12 tokens and their targets per rank.
std::pair<at::Tensor, at::Tensor> tokens_of(int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(40 + rank);
  return {at::randint(16, {12}, gen), at::randint(16, {12}, gen)};
}

// The layout that works for a tied embedding and head: one unit holds the weight and runs twice
// per forward (as the embedding, then as the projection); it equals data parallelism over the
// plain model bit for bit.
TEST(FullyShardedTiedWeights, OneUnitRunTwicePerForwardEqualsDataParallelism) {
  for (const bool overlap : {true, false}) {
    run_ranks(
        2,
        [&](int rank, const Group& group) {
          const auto [ids, targets] = tokens_of(rank);
          TiedModel plain;
          shampoo::GradientSynchronizer sync(plain.params(), group);
          auto adam = adam_factory()(torch::optim::OptimizerParamGroup(plain.params()));
          TiedModel sharded;
          FullyShardedDataParallel fsdp(
              {{"tied", {sharded.embedding->weight}},
               {"body", {sharded.body->weight, sharded.body->bias}}},
              adam_factory(), group, FullyShardedOptions().overlap_step(overlap));
          for (int step = 0; step < 4; ++step) {
            adam->zero_grad();
            auto h = at::tanh(plain.body->forward(plain.embedding->forward(ids)));
            torch::nn::functional::cross_entropy(h.matmul(plain.embedding->weight.t()), targets)
                .backward();
            sync.synchronize();
            adam->step();

            fsdp.optimizer().zero_grad();
            auto x = fsdp.forward(0, [&] { return sharded.embedding->forward(ids); });
            x = fsdp.forward(1, [&] { return at::tanh(sharded.body->forward(x)); });
            auto logits = fsdp.forward(0, [&] { return x.matmul(sharded.embedding->weight.t()); });
            torch::nn::functional::cross_entropy(logits, targets).backward();
            fsdp.optimizer().step();
          }
          std::vector<at::Tensor> values;
          for (const auto& p : sharded.params()) values.push_back(fsdp.full_value(p));
          EXPECT_TRUE(bit_equal(values, shampoo::testing::snapshot(plain.params())))
              << "overlap " << overlap << " rank " << rank;
        },
        kTimeout);
  }
}

// The tied weight in two units is an error at construction that names both units and the
// layout that works; a unit's forward that uses another unit's (released) weight is an error
// that says what happened (it was ATen's "size mismatch ... vec (0)" alone).
TEST(FullyShardedTiedWeights, OtherLayoutsAreErrorsThatSayWhatWorks) {
  run_ranks(
      2,
      [&](int rank, const Group& group) {
        TiedModel model;
        shampoo::testing::expect_error(
            [&] {
              FullyShardedDataParallel fsdp({{"embedding", {model.embedding->weight}},
                                             {"body", {model.body->weight, model.body->bias}},
                                             {"head", {model.embedding->weight}}},
                                            adam_factory(), group);
            },
            {"parameter 0 of unit 2 ('head') is also parameter 0 of unit 0 ('embedding')",
             "goes into one unit whose forward runs for each of them", "Tied weights"});
        FullyShardedDataParallel fsdp(
            {{"embedding", {model.embedding->weight}}, {"body", {model.body->weight}},
             {"head", {model.body->bias}}},
            adam_factory(), group);
        const auto [ids, targets] = tokens_of(rank);
        auto x = fsdp.forward(0, [&] { return model.embedding->forward(ids); });
        x = fsdp.forward(1, [&] { return at::tanh(at::matmul(x, model.body->weight.t())); });
        shampoo::testing::expect_error(
            [&] {
              fsdp.forward(2, [&] {
                return x.matmul(model.embedding->weight.t()) + model.body->bias[0];
              });
            },
            {"the forward of unit 'head' failed", "the parameters of the other units ('embedding', "
             "'body') were released", "Tied weights"});
        // The unit was released again: the next iteration runs.
        EXPECT_EQ(model.body->bias.numel(), 0);
      },
      kTimeout);
}

// torch::save(model) under full sharding writes the [0]-shaped tensors the module holds between
// iterations; save_full_model writes the whole model, which the unsharded model loads with
// torch::load, in the parameters' own dtype also when the units compute in bfloat16.
TEST(FullyShardedExport, SaveFullModelIsLoadableByTheUnshardedModel) {
  for (const bool mixed : {false, true}) {
    const auto path = shampoo::testing::temp_path("fsdp_full_model.pt");
    std::mutex mutex;
    std::vector<at::Tensor> expected;
    run_ranks(
        2,
        [&](int rank, const Group& group) {
          const auto data = sharding_batch(rank, 2);
          auto model = make_mlp(6, 10, 3, /*seed=*/5);
          auto options = FullyShardedOptions();
          if (mixed) options.param_dtype(at::kBFloat16).reduce_dtype(at::kFloat);
          FullyShardedDataParallel fsdp(shampoo::sequential_units(model), adam_factory(), group,
                                        options);
          for (int step = 0; step < 3; ++step) {
            loss_of(shampoo::forward_sequential(fsdp, model, data.inputs).to(at::kFloat), data)
                .backward();
          }
          shampoo::save_full_model(fsdp, *model, path);
          for (const auto& p : model->parameters()) EXPECT_EQ(p.numel(), 0);  // released again
          std::vector<at::Tensor> values;
          for (const auto& p : model->parameters()) values.push_back(fsdp.full_value(p));
          std::lock_guard<std::mutex> lock(mutex);
          if (rank == 0) expected = values;
        },
        kTimeout);
    auto plain = make_mlp(6, 10, 3, /*seed=*/77);
    torch::load(plain, path);
    EXPECT_TRUE(bit_equal(shampoo::testing::snapshot(plain->parameters()), expected))
        << "mixed " << mixed;
    for (const auto& p : plain->parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
    std::remove(path.c_str());
  }
}


// Under hybrid sharding every rank calls save_full_model, as the full-sharding snippet shows: one
// rank of the job writes (before, rank 0 of each shard group wrote the same temporary file, and
// ranks failed with "cannot rename ... model.pt.tmp" or renamed another's half-written file),
// every rank of both replicas returns once the file is whole, and a failed write is an error on
// every rank of every replica.
TEST(FullyShardedExport, HybridSaveFullModelHasOneWriterAndEveryRankLearnsTheOutcome) {
  const auto dir = std::filesystem::path(shampoo::testing::temp_path("hybrid_full_model"));
  shampoo::testing::remove_tree(dir);
  std::filesystem::create_directories(dir);
  const auto path = dir / "model.pt";
  std::mutex mutex;
  std::vector<at::Tensor> expected;
  run_ranks(
      4,
      [&](int rank, const Group& group) {
        const auto hybrid = shampoo::make_hybrid_groups(group, 2);
        auto model = make_mlp(64, 384, 8, /*seed=*/5);
        FullyShardedDataParallel fsdp(shampoo::sequential_units(model), adam_factory(),
                                      hybrid.shard,
                                      FullyShardedOptions().replica_group(hybrid.replica));
        const auto all = shampoo::testing::make_blobs(64, 64, 8, /*seed=*/3);
        const Dataset data{all.inputs.narrow(0, rank * 16, 16), all.labels.narrow(0, rank * 16, 16)};
        for (int save = 0; save < 30; ++save) {
          if (save % 10 == 0) {
            loss_of(shampoo::forward_sequential(fsdp, model, data.inputs), data).backward();
          }
          shampoo::detail::gather_int64(*group, {1});  // every rank at the save at once
          shampoo::save_full_model(fsdp, *model, path);
          // Once it returned, the file is whole on every rank (a later save replaces it by a
          // rename, so a reader sees one whole file or the other).
          auto plain = make_mlp(64, 384, 8, /*seed=*/77);
          torch::load(plain, path.string());
          for (const auto& p : plain->parameters()) ASSERT_TRUE(p.isfinite().all().item<bool>());
        }
        std::vector<at::Tensor> values;
        for (const auto& p : model->parameters()) values.push_back(fsdp.full_value(p));
        if (rank == 0) {
          std::lock_guard<std::mutex> lock(mutex);
          expected = values;
        }
        // A write that fails is an error on every rank of both replicas.
        shampoo::testing::expect_error(
            [&] { shampoo::save_full_model(fsdp, *model, dir / "missing" / "model.pt"); },
            {"save_full_model", "model.pt"});
      },
      kTimeout);
  auto plain = make_mlp(64, 384, 8, /*seed=*/77);
  torch::load(plain, path.string());
  EXPECT_TRUE(bit_equal(shampoo::testing::snapshot(plain->parameters()), expected));
  // Nothing but the file is left in the folder (no temporary of a second writer).
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  EXPECT_EQ(names, std::vector<std::string>{"model.pt"});
  shampoo::testing::remove_tree(dir);
}

}  // namespace
