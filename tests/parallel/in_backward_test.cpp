// Optimizer-in-backward: steps during backward equal ordinary steps bit for bit (LibTorch's
// optimizers and DistributedShampoo, single process and data-parallel), gradients are released,
// per-parameter-set optimizers, accumulation, checkpoints, and misuse errors.
#include <shampoo/shampoo.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <filesystem>
#include <mutex>

#include "support/test_support.h"

namespace {

using shampoo::OptimizerFactory;
using shampoo::testing::bit_equal;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

struct FactoryCase {
  std::string name;
  OptimizerFactory factory;
};

shampoo::ShampooOptions shampoo_options() {
  return shampoo::ShampooOptions::reference_defaults(0.02)
      .epsilon(1e-6)
      .precondition_frequency(2)
      .grafting(shampoo::AdamGraftingConfig{})
      .momentum(0.5);
}

OptimizerFactory shampoo_factory(const shampoo::ShampooOptions& options) {
  return [options](std::vector<torch::Tensor> p) {
    return std::make_unique<shampoo::DistributedShampoo>(p, options);
  };
}

std::vector<FactoryCase> factories() {
  return {
      {"sgd_momentum",
       [](std::vector<torch::Tensor> p) {
         return std::make_unique<torch::optim::SGD>(
             p, torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(1e-3));
       }},
      {"adam",
       [](std::vector<torch::Tensor> p) {
         return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(0.01));
       }},
      {"adamw",
       [](std::vector<torch::Tensor> p) {
         return std::make_unique<torch::optim::AdamW>(
             p, torch::optim::AdamWOptions(0.01).weight_decay(0.01));
       }},
      {"adagrad",
       [](std::vector<torch::Tensor> p) {
         return std::make_unique<torch::optim::Adagrad>(p, torch::optim::AdagradOptions(0.05));
       }},
      {"rmsprop",
       [](std::vector<torch::Tensor> p) {
         return std::make_unique<torch::optim::RMSprop>(p, torch::optim::RMSpropOptions(0.01));
       }},
      {"distributed_shampoo", shampoo_factory(shampoo_options())},
      {"distributed_shampoo_compact_int8",
       shampoo_factory(shampoo_options().compact_state(shampoo::CompactState::kInt8))},
      // The reference's newer settings (issue 58) in backward: corrected weight decay, trace
      // scaling.
      {"distributed_shampoo_corrected_decay_trace_scaling",
       shampoo_factory(shampoo_options()
                           .weight_decay(0.05)
                           .weight_decay_type(shampoo::WeightDecayType::kCorrected)
                           .use_trace_scaling(true))},
      {"eigendecomposed_shampoo",
       [](std::vector<torch::Tensor> p) {
         return std::make_unique<shampoo::DistributedShampoo>(
             p, shampoo::ShampooOptions::reference_defaults(0.02)
                    .epsilon(1e-6)
                    .precondition_frequency(2)
                    .preconditioner(shampoo::EigendecomposedShampooConfig{})
                    .momentum(0.5));
       }},
  };
}

std::vector<at::Tensor> values(torch::nn::Sequential& model) {
  std::vector<at::Tensor> out;
  for (const auto& p : model->parameters()) out.push_back(p.detach().clone());
  return out;
}

shampoo::testing::Dataset batch(int step) {
  return shampoo::testing::make_blobs(32, 6, 3, /*seed=*/50 + step);
}

class InBackward : public ::testing::TestWithParam<FactoryCase> {};

TEST_P(InBackward, EqualsOrdinaryStepAndReleasesGradients) {
  const auto& c = GetParam();
  auto ordinary_model = shampoo::testing::make_mlp(6, 12, 3, 1);
  auto in_backward_model = shampoo::testing::make_mlp(6, 12, 3, 1);
  auto ordinary = c.factory(ordinary_model->parameters());
  auto in_backward =
      shampoo::apply_optimizer_in_backward(in_backward_model->parameters(), c.factory);
  for (int step = 1; step <= 6; ++step) {
    ordinary->zero_grad();
    shampoo::testing::classification_loss(ordinary_model, batch(step), true);
    ordinary->step();
    shampoo::testing::classification_loss(in_backward_model, batch(step), true);
    for (const auto& p : in_backward_model->parameters()) {
      ASSERT_FALSE(p.grad().defined()) << "gradient kept after its step";
    }
    ASSERT_TRUE(bit_equal(values(in_backward_model), values(ordinary_model)))
        << c.name << " step " << step;
  }
  EXPECT_EQ(in_backward.steps_taken(), 6);
}

INSTANTIATE_TEST_SUITE_P(Optimizers, InBackward, ::testing::ValuesIn(factories()),
                         [](const auto& info) { return info.param.name; });

TEST(InBackwardSets, DifferentOptimizersPerParameterSet) {
  auto ordinary_model = shampoo::testing::make_mlp(6, 12, 3, 2);
  auto model = shampoo::testing::make_mlp(6, 12, 3, 2);
  auto split = [](torch::nn::Sequential& m) {
    const auto p = m->parameters();  // weight, bias of three linear layers
    return std::vector<std::vector<at::Tensor>>{{p[0], p[1]}, {p[2], p[3]}, {p[4], p[5]}};
  };
  const std::vector<OptimizerFactory> makers{
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.02));
      },
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(0.04));
      },
      [](std::vector<torch::Tensor> p) {
        return std::make_unique<torch::optim::Adagrad>(p, torch::optim::AdagradOptions(0.006));
      }};
  std::vector<std::unique_ptr<torch::optim::Optimizer>> ordinary;
  const auto ordinary_sets = split(ordinary_model);
  const auto sets = split(model);
  shampoo::InBackwardOptimizer in_backward;
  for (size_t i = 0; i < 3; ++i) {
    ordinary.push_back(makers[i](ordinary_sets[i]));
    in_backward.add(sets[i], makers[i]);
  }
  ASSERT_EQ(in_backward.num_optimizers(), 3u);
  EXPECT_NE(dynamic_cast<torch::optim::Adam*>(&in_backward.optimizer(1)), nullptr);
  // A scheduler on one of them, mirrored on the ordinary run.
  torch::optim::StepLR ordinary_scheduler(*ordinary[1], 2, 0.5);
  torch::optim::StepLR scheduler(in_backward.optimizer(1), 2, 0.5);
  for (int step = 1; step <= 6; ++step) {
    for (auto& o : ordinary) o->zero_grad();
    shampoo::testing::classification_loss(ordinary_model, batch(step), true);
    for (auto& o : ordinary) o->step();
    shampoo::testing::classification_loss(model, batch(step), true);
    ordinary_scheduler.step();
    scheduler.step();
    ASSERT_TRUE(bit_equal(values(model), values(ordinary_model))) << "step " << step;
  }
  EXPECT_EQ(in_backward.optimizer(1).param_groups()[0].options().get_lr(), 0.04 * 0.25);
}

TEST(InBackwardAccumulation, EveryKthBackwardStepsOnTheSum) {
  for (const auto& c : {factories()[1], factories()[5]}) {
    auto ordinary_model = shampoo::testing::make_mlp(6, 12, 3, 3);
    auto model = shampoo::testing::make_mlp(6, 12, 3, 3);
    auto ordinary = c.factory(ordinary_model->parameters());
    auto in_backward = shampoo::apply_optimizer_in_backward(model->parameters(), c.factory);
    in_backward.set_accumulation_steps(3);
    for (int step = 1; step <= 4; ++step) {
      ordinary->zero_grad();
      for (int micro = 0; micro < 3; ++micro) {
        shampoo::testing::classification_loss(ordinary_model, batch(10 * step + micro), true);
        shampoo::testing::classification_loss(model, batch(10 * step + micro), true);
        const bool last = micro == 2;
        for (const auto& p : model->parameters()) {
          ASSERT_EQ(p.grad().defined(), !last) << "micro-batch " << micro;
        }
      }
      ordinary->step();
      ASSERT_TRUE(bit_equal(values(model), values(ordinary_model))) << c.name << " step " << step;
    }
    EXPECT_EQ(in_backward.backward_passes(), 12);
    EXPECT_EQ(in_backward.steps_taken(), 4);
  }
}

TEST(InBackwardAccumulation, NoStepScope) {
  auto model = shampoo::testing::make_mlp(6, 12, 3, 4);
  auto in_backward =
      shampoo::apply_optimizer_in_backward(model->parameters(), factories()[1].factory);
  const auto before = values(model);
  {
    shampoo::InBackwardOptimizer::NoStep no_step(in_backward);
    shampoo::testing::classification_loss(model, batch(1), true);
  }
  EXPECT_TRUE(bit_equal(values(model), before));
  EXPECT_TRUE(model->parameters()[0].grad().defined());  // kept for the next pass
  shampoo::testing::classification_loss(model, batch(2), true);
  EXPECT_FALSE(bit_equal(values(model)[0], before[0]));
  EXPECT_EQ(in_backward.steps_taken(), 1);
}

TEST(InBackwardCheckpoint, ResumeEqualsUninterrupted) {
  for (const auto& c : {factories()[1], factories()[5]}) {
    auto reference = shampoo::testing::make_mlp(6, 12, 3, 5);
    auto reference_opt = shampoo::apply_optimizer_in_backward(reference->parameters(), c.factory);
    for (int step = 1; step <= 6; ++step) {
      shampoo::testing::classification_loss(reference, batch(step), true);
    }
    auto first = shampoo::testing::make_mlp(6, 12, 3, 5);
    const auto path = shampoo::testing::temp_path(c.name + ".pt");
    std::vector<at::Tensor> saved;
    {
      auto opt = shampoo::apply_optimizer_in_backward(first->parameters(), c.factory);
      for (int step = 1; step <= 3; ++step) {
        shampoo::testing::classification_loss(first, batch(step), true);
      }
      torch::save(opt, path);
      saved = values(first);
    }
    auto resumed = shampoo::testing::make_mlp(6, 12, 3, 5);
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < saved.size(); ++i) resumed->parameters()[i].copy_(saved[i]);
    }
    auto opt = shampoo::apply_optimizer_in_backward(resumed->parameters(), c.factory);
    torch::load(opt, path);
    for (int step = 4; step <= 6; ++step) {
      shampoo::testing::classification_loss(resumed, batch(step), true);
    }
    EXPECT_TRUE(bit_equal(values(resumed), values(reference))) << c.name;
    std::filesystem::remove(path);
  }
}

/// A data-parallel in-backward run: a DistributedShampoo set and a replicated Adam set, the
/// gradient synchronizer attached when there is a process group.
struct DataParallelRun {
  torch::nn::Sequential model = shampoo::testing::make_mlp(6, 12, 3, 5);
  std::unique_ptr<shampoo::GradientSynchronizer> sync;
  shampoo::InBackwardOptimizer opt;

  DataParallelRun(const Group& group, const std::vector<at::Tensor>& start = {}) {
    if (!start.empty()) {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < start.size(); ++i) model->parameters()[i].copy_(start[i]);
    }
    auto params = model->parameters();
    opt.add({params[0], params[1]}, [group](std::vector<torch::Tensor> p) {
      return std::make_unique<shampoo::DistributedShampoo>(
          p,
          shampoo::ShampooOptions::reference_defaults(0.02)
              .epsilon(1e-6)
              .precondition_frequency(2)
              .grafting(shampoo::AdamGraftingConfig{}),
          shampoo::DistributedOptions().process_group(group));
    });
    opt.add({params.begin() + 2, params.end()}, factories()[1].factory);
    if (group) {
      sync = std::make_unique<shampoo::GradientSynchronizer>(model->parameters(), group);
      opt.attach(*sync);
    }
  }
  void train(int from, int to) {
    for (int step = from; step <= to; ++step) {
      shampoo::testing::classification_loss(model, batch(step), true);
    }
  }
};

TEST(InBackwardCheckpoint, DataParallelSavedAtWorld2ResumesAtWorld1And4BitForBit) {
  // Every rank trains on the same batch, so the averaged gradient equals one process's at every
  // world size (sums of 2 or 4 equal values divided by 2 or 4 are exact) and the runs agree bit
  // for bit.
  DataParallelRun reference({});
  reference.train(1, 6);
  const std::filesystem::path dir = shampoo::testing::temp_path("in_backward_dir");
  std::vector<at::Tensor> saved;
  std::mutex mutex;
  shampoo::testing::run_ranks(2, [&](int, const Group& group) {
    DataParallelRun run(group);
    run.train(1, 3);
    shampoo::save_distributed_checkpoint(run.opt, dir);
    std::lock_guard<std::mutex> lock(mutex);
    saved = values(run.model);
  });
  for (const int world : {0, 1, 4}) {
    const auto resume = [&](int rank, const Group& group) {
      DataParallelRun run(group, saved);
      shampoo::load_distributed_checkpoint(run.opt, dir);
      EXPECT_EQ(run.opt.steps_taken(), 3);
      run.train(4, 6);
      EXPECT_TRUE(bit_equal(values(run.model), values(reference.model)))
          << "resumed at world " << world << " rank " << rank;
    };
    if (world == 0) {
      resume(0, {});
    } else {
      shampoo::testing::run_ranks(world, resume);
    }
  }
  shampoo::testing::remove_tree(dir);
}

// LibTorch's optimizers in backward under data parallelism have no process group of their own:
// a checkpoint saved without a group is written by rank 0 of the attached synchronizer's group,
// once. (Before, every rank wrote it as the rank 0 of a world of one, into the same files.)
TEST(InBackwardCheckpoint, LibTorchSetsUnderDataParallelismHaveOneWriter) {
  const std::filesystem::path dir = shampoo::testing::temp_path("in_backward_libtorch_dir");
  shampoo::testing::run_ranks(2, [&](int, const Group& group) {
    auto model = shampoo::testing::make_mlp(6, 12, 3, 5);
    shampoo::GradientSynchronizer sync(model->parameters(), group);
    auto opt = shampoo::apply_optimizer_in_backward(model->parameters(), factories()[1].factory);
    opt.attach(sync);
    for (int step = 1; step <= 2; ++step) {
      shampoo::testing::classification_loss(model, batch(step), true);
    }
    for (int save = 0; save < 10; ++save) shampoo::save_distributed_checkpoint(opt, dir);
    shampoo::load_distributed_checkpoint(opt, dir);
    EXPECT_EQ(shampoo::read_checkpoint_manifest(dir).world_size, 2);
  });
  shampoo::testing::remove_tree(dir);
}

void expect_error(const std::function<void()>& fn, const std::string& fragment) {
  try {
    fn();
    ADD_FAILURE() << "expected an error mentioning '" << fragment << "'";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find(fragment), std::string::npos)
        << e.what_without_backtrace();
  }
}

TEST(InBackwardMisuse, ClearErrors) {
  auto model = shampoo::testing::make_mlp(6, 12, 3, 6);
  auto params = model->parameters();
  auto opt = shampoo::apply_optimizer_in_backward({params[0], params[1]}, factories()[1].factory);
  expect_error([&] { opt.add({params[1]}, factories()[0].factory); }, "registered twice");
  expect_error(
      [&] {
        opt.add({params[2], params[2]}, factories()[0].factory);
      },
      "registered twice");
  expect_error([&] { opt.add({at::ones({3})}, factories()[0].factory); }, "does not require grad");
  expect_error([&] { opt.step(); }, "do not call step() by hand");
  auto& shampoo_opt = opt.add({params[4]}, factories()[5].factory);
  expect_error([&] { shampoo_opt.step(); }, "runs in backward");
}

TEST(InBackwardDistributed, EqualsDistributedOrdinaryStep) {
  // DistributedShampoo and ShardedOptimizer step in phases (their one AllGather at the end of
  // backward); Adam steps whole, per bucket.
  enum class Which { kShampoo, kAdam, kShardedAdam };
  for (const auto which : {Which::kShampoo, Which::kAdam, Which::kShardedAdam}) {
    const bool shampoo_optimizer = which == Which::kShampoo;
    shampoo::testing::run_ranks(2, [&](int rank,
                                       const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
      const auto shard = shampoo::testing::make_blobs(64, 6, 3, 70 + rank);
      OptimizerFactory factory =
          [&](std::vector<torch::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
        if (shampoo_optimizer) {
          return std::make_unique<shampoo::DistributedShampoo>(
              p,
              shampoo::ShampooOptions::reference_defaults(0.02)
                  .epsilon(1e-6)
                  .precondition_frequency(2)
                  .grafting(shampoo::AdamGraftingConfig{}),
              shampoo::DistributedOptions().process_group(group));
        }
        if (which == Which::kShardedAdam) {
          return std::make_unique<shampoo::ShardedOptimizer>(
              p,
              shampoo::group_optimizer_factory<torch::optim::Adam>(torch::optim::AdamOptions(0.01)),
              group);
        }
        return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(0.01));
      };
      auto ordinary_model = shampoo::testing::make_mlp(6, 12, 3, 8);
      shampoo::GradientSynchronizer ordinary_sync(
          ordinary_model->parameters(), group,
          shampoo::GradientSynchronizerOptions().bucket_cap_bytes(256));
      auto ordinary = factory(ordinary_model->parameters());
      auto model = shampoo::testing::make_mlp(6, 12, 3, 8);
      shampoo::GradientSynchronizer sync(
          model->parameters(), group, shampoo::GradientSynchronizerOptions().bucket_cap_bytes(256));
      auto in_backward = shampoo::apply_optimizer_in_backward(model->parameters(), factory);
      in_backward.attach(sync);
      for (int step = 1; step <= 4; ++step) {
        ordinary->zero_grad();
        shampoo::testing::classification_loss(ordinary_model, shard, true);
        ordinary_sync.synchronize();
        ordinary->step();
        shampoo::testing::classification_loss(model, shard, true);  // steps inside backward
        for (const auto& p : model->parameters()) ASSERT_FALSE(p.grad().defined());
        ASSERT_TRUE(bit_equal(values(model), values(ordinary_model)))
            << static_cast<int>(which) << " rank " << rank << " step " << step;
      }
      EXPECT_GT(sync.buckets_started_in_backward(), 0);
    });
  }
}

// state(): an entry per parameter with the steps taken since it was added, through a move.
TEST(InBackwardState, EveryParameterHasAnEntryWithItsStepCount) {
  auto model = shampoo::testing::make_mlp(6, 10, 3, /*seed=*/5);
  auto params = model->parameters();
  auto moved =
      shampoo::apply_optimizer_in_backward({params[0], params[1]}, [](std::vector<at::Tensor> p) {
        return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(0.01));
      });
  shampoo::InBackwardOptimizer in_backward(std::move(moved));
  const auto data = shampoo::testing::make_blobs(32, 6, 3, /*seed=*/3);
  for (int step = 0; step < 2; ++step) shampoo::testing::classification_loss(model, data, true);
  in_backward.add({params[2], params[3]}, [](std::vector<at::Tensor> p) {
    return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(0.01));
  });
  shampoo::testing::classification_loss(model, data, true);
  auto& base = static_cast<torch::optim::Optimizer&>(in_backward);
  EXPECT_EQ(base.state().size(), 4u);
  const auto step_of = [&](const at::Tensor& p) {
    return dynamic_cast<const shampoo::ShardedParamState&>(
               *base.state().at(p.unsafeGetTensorImpl()))
        .step();
  };
  EXPECT_EQ(step_of(params[0]), 3);
  EXPECT_EQ(step_of(params[2]), 1);
}

}  // namespace
