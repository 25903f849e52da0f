// ShardedOptimizer (ZeRO-1 / OSS): equal to the unsharded optimizer bit for bit at world 2 and 4,
// state split across the ranks, checkpoints per rank, clear errors.
#include <shampoo/shampoo.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <filesystem>
#include <mutex>

#include "support/test_support.h"

namespace {

using shampoo::OptimizerFactory;
using shampoo::ShardedOptimizer;
using shampoo::testing::bit_equal;
using shampoo::testing::run_ranks;
using shampoo::testing::snapshot;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

std::vector<at::Tensor> make_params() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  std::vector<at::Tensor> params;
  for (const auto& shape :
       std::vector<std::vector<int64_t>>{{64, 32}, {32}, {16, 16}, {7}, {3, 5, 2}, {128}, {9, 9}}) {
    params.push_back(at::randn(shape, gen).requires_grad_());
  }
  return params;
}

void set_grads(const std::vector<at::Tensor>& params, int step) {
  shampoo::testing::set_random_grads(params, 40 + step);
}

struct Case {
  std::string name;
  OptimizerFactory factory;
};

std::vector<Case> cases() {
  return {{"adam",
           [](std::vector<torch::Tensor> p) {
             return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(0.01));
           }},
          {"adamw",
           [](std::vector<torch::Tensor> p) {
             return std::make_unique<torch::optim::AdamW>(
                 p, torch::optim::AdamWOptions(0.01).weight_decay(0.1));
           }},
          {"sgd_momentum", [](std::vector<torch::Tensor> p) {
             return std::make_unique<torch::optim::SGD>(
                 p, torch::optim::SGDOptions(0.1).momentum(0.9));
           }}};
}

class Sharded : public ::testing::TestWithParam<std::tuple<Case, int>> {};

TEST_P(Sharded, EqualsUnshardedBitForBit) {
  const auto [c, world] = GetParam();
  auto reference = make_params();
  auto unsharded = c.factory(reference);
  std::vector<std::vector<at::Tensor>> trajectory;
  for (int step = 1; step <= 5; ++step) {
    set_grads(reference, step);
    unsharded->step();
    trajectory.push_back(snapshot(reference));
  }
  const int64_t total_state = shampoo::optimizer_state_bytes(*unsharded);
  std::mutex mutex;
  std::vector<int64_t> state(world);
  run_ranks(world, [&](int rank, const Group& group) {
    auto params = make_params();
    ShardedOptimizer sharded(params, c.factory, group);
    for (int step = 1; step <= 5; ++step) {
      set_grads(params, step);
      sharded.step();
      ASSERT_TRUE(bit_equal(snapshot(params), trajectory[step - 1]))
          << "rank " << rank << " step " << step;
    }
    std::lock_guard<std::mutex> lock(mutex);
    state[rank] = sharded.state_bytes();
  });
  int64_t sum = 0;
  for (const auto s : state) {
    sum += s;
    EXPECT_LT(s, total_state);  // every rank holds only part of the state
  }
  EXPECT_EQ(sum, total_state);
}

INSTANTIATE_TEST_SUITE_P(Optimizers, Sharded,
                         ::testing::Combine(::testing::ValuesIn(cases()), ::testing::Values(2, 4)),
                         [](const auto& info) {
                           return std::get<0>(info.param).name + "_world" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(ShardedCheckpoint, ResumeEqualsUninterrupted) {
  const auto factory = cases()[0].factory;
  auto reference = make_params();
  auto unsharded = factory(reference);
  for (int step = 1; step <= 6; ++step) {
    set_grads(reference, step);
    unsharded->step();
  }
  const auto prefix = shampoo::testing::temp_path("sharded");
  run_ranks(2, [&](int rank, const Group& group) {
    const auto path = prefix + std::to_string(rank) + ".pt";
    auto params = make_params();
    std::vector<at::Tensor> saved;
    {
      ShardedOptimizer opt(params, factory, group);
      for (int step = 1; step <= 3; ++step) {
        set_grads(params, step);
        opt.step();
      }
      torch::save(opt, path);
      saved = snapshot(params);
    }
    auto resumed = make_params();
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < resumed.size(); ++i) resumed[i].copy_(saved[i]);
    }
    ShardedOptimizer opt(resumed, factory, group);
    torch::load(opt, path);
    for (int step = 4; step <= 6; ++step) {
      set_grads(resumed, step);
      opt.step();
    }
    EXPECT_TRUE(bit_equal(snapshot(resumed), snapshot(reference))) << "rank " << rank;
    std::filesystem::remove(path);
  });
}

class ShardedAnyWorld : public ::testing::TestWithParam<Case> {};

TEST_P(ShardedAnyWorld, SavedAtWorld2ResumesAtWorld1To4BitForBit) {
  const auto& c = GetParam();
  auto reference = make_params();
  auto unsharded = c.factory(reference);
  for (int step = 1; step <= 6; ++step) {
    set_grads(reference, step);
    unsharded->step();
  }
  const auto initial_lr = unsharded->param_groups()[0].options().get_lr();
  const std::filesystem::path dir = shampoo::testing::temp_path("sharded_dir");
  std::vector<at::Tensor> saved;
  std::mutex mutex;
  run_ranks(2, [&](int, const Group& group) {
    auto params = make_params();
    ShardedOptimizer opt(params, c.factory, group);
    for (int step = 1; step <= 3; ++step) {
      set_grads(params, step);
      opt.step();
    }
    opt.local_optimizer().param_groups()[0].options().set_lr(initial_lr * 0.5);  // a scheduler
    shampoo::save_distributed_checkpoint(opt, dir);
    std::lock_guard<std::mutex> lock(mutex);
    saved = snapshot(params);
  });
  for (const int world : {1, 2, 4}) {
    run_ranks(world, [&](int rank, const Group& group) {
      auto params = make_params();
      {
        torch::NoGradGuard no_grad;
        for (size_t i = 0; i < params.size(); ++i) params[i].copy_(saved[i]);
      }
      ShardedOptimizer opt(params, c.factory, group);
      shampoo::load_distributed_checkpoint(opt, dir);
      auto& options = opt.local_optimizer().param_groups()[0].options();
      EXPECT_EQ(options.get_lr(), initial_lr * 0.5) << "the saved lr is restored";
      options.set_lr(initial_lr);
      for (int step = 4; step <= 6; ++step) {
        set_grads(params, step);
        opt.step();
      }
      EXPECT_TRUE(bit_equal(snapshot(params), snapshot(reference)))
          << c.name << " resumed at world " << world << " rank " << rank;
    });
  }
  shampoo::testing::remove_tree(dir);
}

INSTANTIATE_TEST_SUITE_P(Optimizers, ShardedAnyWorld, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

TEST(ShardedCheckpoint, WithoutTheLoadTheResumedRunDiffers) {
  // The test above can fail: resuming with fresh optimizer state ends elsewhere.
  const auto factory = cases()[0].factory;
  auto reference = make_params();
  auto unsharded = factory(reference);
  auto fresh_params = make_params();
  for (int step = 1; step <= 6; ++step) {
    set_grads(reference, step);
    unsharded->step();
    if (step == 3) {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < reference.size(); ++i) fresh_params[i].copy_(reference[i]);
    }
  }
  auto fresh = factory(fresh_params);
  for (int step = 4; step <= 6; ++step) {
    set_grads(fresh_params, step);
    fresh->step();
  }
  EXPECT_FALSE(bit_equal(snapshot(fresh_params), snapshot(reference)));
}

TEST(ShardedCheckpoint, UnknownLocalOptimizerAndOtherKindAreClearErrors) {
  const std::filesystem::path dir = shampoo::testing::temp_path("sharded_dir");
  run_ranks(2, [&](int, const Group& group) {
    auto params = make_params();
    ShardedOptimizer lbfgs(
        params,
        [](std::vector<torch::Tensor> p) { return std::make_unique<torch::optim::LBFGS>(p); },
        group);
    shampoo::testing::expect_error([&] { shampoo::save_distributed_checkpoint(lbfgs, dir); },
                                   {"SGD, Adam, AdamW, Adagrad or RMSprop"});
    ShardedOptimizer adam(params, cases()[0].factory, group);
    shampoo::save_distributed_checkpoint(adam, dir);
    shampoo::DistributedShampoo shampoo_opt(params, shampoo::ShampooOptions(0.01),
                                            shampoo::DistributedOptions().process_group(group));
    shampoo::testing::expect_error(
        [&] { shampoo::load_distributed_checkpoint(shampoo_opt, dir); },
        {"written by a ShardedOptimizer, this optimizer is a DistributedShampoo"});
  });
  shampoo::testing::remove_tree(dir);
}

TEST(ShardedErrors, DifferentParametersOnRanks) {
  std::mutex mutex;
  std::vector<std::string> messages(2);
  run_ranks(2, [&](int rank, const Group& group) {
    std::vector<at::Tensor> params{at::randn({4, rank == 0 ? 4 : 5}).requires_grad_()};
    try {
      ShardedOptimizer opt(params, cases()[0].factory, group);
    } catch (const c10::Error& e) {
      std::lock_guard<std::mutex> lock(mutex);
      messages[rank] = e.what_without_backtrace();
    }
  });
  for (const auto& m : messages)
    EXPECT_NE(m.find("every rank must pass the same"), std::string::npos) << m;
}

}  // namespace
