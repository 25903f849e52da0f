// Data-parallel DistributedShampoo on c10d/Gloo, ranks as threads of one process: equal to a
// single process bit for bit in float32, one AllGather per step however many groups, lossy
// communication within tolerance, subgroups, uneven ownership, clear errors instead of hangs.
#include <shampoo/shampoo.h>
#include <torch/serialize.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

#include "support/test_support.h"

namespace {

using shampoo::DistributedOptions;
using shampoo::DistributedShampoo;
using shampoo::ShampooOptions;
using shampoo::testing::bit_equal;
using shampoo::testing::run_ranks;
using shampoo::testing::snapshot;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

/// Parameters of several shapes: blocked, odd-sized, 1-D, 3-D.
std::vector<at::Tensor> make_params(uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<at::Tensor> params;
  for (const auto& shape : std::vector<std::vector<int64_t>>{
           {9, 7}, {13}, {4, 3, 5}, {20, 11}, {6}, {5, 5}, {3, 17}, {1, 8}}) {
    params.push_back(at::randn(shape, gen).requires_grad_());
  }
  return params;
}

void set_grads(const std::vector<at::Tensor>& params, int step) {
  shampoo::testing::set_random_grads(params, 900 + step);
}

/// Two groups with different floats (one virtual group when merged).
std::vector<torch::optim::OptimizerParamGroup> make_groups(const std::vector<at::Tensor>& params,
                                                           const ShampooOptions& base) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  const auto half = static_cast<long>(params.size() / 2);
  groups.emplace_back(std::vector<at::Tensor>(params.begin(), params.begin() + half),
                      std::make_unique<ShampooOptions>(base));
  groups.emplace_back(std::vector<at::Tensor>(params.begin() + half, params.end()),
                      std::make_unique<ShampooOptions>(ShampooOptions(base).lr(base.lr() * 0.5)));
  return groups;
}

/// The single-process trajectory: parameters after every step.
std::vector<std::vector<at::Tensor>> single_process(const ShampooOptions& base, int steps) {
  auto params = make_params(1);
  DistributedShampoo opt(make_groups(params, base), base);
  std::vector<std::vector<at::Tensor>> trajectory;
  for (int step = 1; step <= steps; ++step) {
    set_grads(params, step);
    opt.step();
    trajectory.push_back(snapshot(params));
  }
  return trajectory;
}

struct DistributedCase {
  std::string name;
  ShampooOptions options = ShampooOptions::reference_defaults();
};

std::vector<DistributedCase> cases() {
  const auto base = ShampooOptions::reference_defaults(0.02)
                        .betas({0.9, 0.99})
                        .epsilon(1e-6)
                        .precondition_frequency(2)
                        .max_preconditioner_dim(8);
  return {
      {"root_inverse", base},
      {"adam_grafting_decoupled_momentum", ShampooOptions(base)
                                               .grafting(shampoo::AdamGraftingConfig{0.99, 1e-8})
                                               .weight_decay(1e-3)
                                               .momentum(0.9)},
      {"l2_nesterov_sgd_grafting", ShampooOptions(base)
                                       .grafting(shampoo::SGDGraftingConfig{})
                                       .weight_decay(1e-2)
                                       .weight_decay_type(shampoo::WeightDecayType::kL2)
                                       .momentum(0.5)
                                       .use_nesterov(true)},
      {"eigenvalue_corrected",
       ShampooOptions(base).preconditioner(shampoo::EigenvalueCorrectedShampooConfig{})},
      {"coupled_newton", ShampooOptions(base).preconditioner(shampoo::RootInvShampooConfig{
                             .solver = shampoo::RootSolver::kCoupledNewton})},
      {"newton_db", ShampooOptions(base).preconditioner(
                        shampoo::RootInvShampooConfig{.solver = shampoo::RootSolver::kNewtonDB})},
      // Newton–Schulz computes roots that are powers of two: the 3-D weight gets 1/8.
      {"newton_schulz", ShampooOptions(base)
                            .preconditioner(shampoo::RootInvShampooConfig{
                                .solver = shampoo::RootSolver::kNewtonSchulz})
                            .inverse_exponent_override({{3, {{shampoo::kAllDims, 0.125}}}})},
      {"eigendecomposed",
       ShampooOptions(base).preconditioner(shampoo::EigendecomposedShampooConfig{})},
      {"eigendecomposed_qr_grafting",
       ShampooOptions(base)
           .grafting(shampoo::AdamGraftingConfig{0.99, 1e-8})
           .preconditioner(shampoo::EigendecomposedShampooConfig{
               .eigenbasis_method = shampoo::EigenbasisMethod::kQR})},
      {"eigendecomposed_pseudo_inverse",
       ShampooOptions(base).epsilon(0.0).preconditioner(shampoo::EigendecomposedShampooConfig{
           .rank_deficient_stability = shampoo::PseudoInverseConfig{.rank_rtol = 1e-5}})},
      {"root_inverse_pseudo_inverse",
       ShampooOptions(base).epsilon(0.0).preconditioner(shampoo::RootInvShampooConfig{
           .rank_deficient_stability = shampoo::PseudoInverseConfig{.rank_rtol = 1e-5}})},
  };
}

class WorldEqualsSingle
    : public ::testing::TestWithParam<std::tuple<DistributedCase, int, int64_t>> {};

TEST_P(WorldEqualsSingle, BitForBitInFloat32) {
  const auto [c, world, trainers] = GetParam();
  if (trainers != -1 && world % trainers != 0) GTEST_SKIP();
  constexpr int kSteps = 6;
  const auto expected = single_process(c.options, kSteps);
  std::mutex mutex;
  int64_t owned_total = 0, blocks = 0;
  run_ranks(world, [&](int rank, const Group& group) {
    auto params = make_params(1);
    DistributedShampoo opt(
        make_groups(params, c.options), c.options,
        DistributedOptions().process_group(group).num_trainers_per_group(trainers));
    for (int step = 1; step <= kSteps; ++step) {
      set_grads(params, step);
      opt.step();
      ASSERT_TRUE(bit_equal(snapshot(params), expected[step - 1]))
          << c.name << " rank " << rank << " step " << step;
      ASSERT_EQ(opt.stats().collectives_last_step, 1);
    }
    std::lock_guard<std::mutex> lock(mutex);
    owned_total += opt.stats().owned_blocks;
    blocks = opt.stats().total_blocks;
  });
  // Every block is computed by exactly one rank of each trainer group.
  const int64_t copies = trainers == -1 ? 1 : world / trainers;
  EXPECT_EQ(owned_total, blocks * copies);
}

INSTANTIATE_TEST_SUITE_P(Worlds, WorldEqualsSingle,
                         ::testing::Combine(::testing::ValuesIn(cases()), ::testing::Values(2, 4),
                                            ::testing::Values(int64_t{-1})),
                         [](const auto& info) {
                           return std::get<0>(info.param).name + "_world" +
                                  std::to_string(std::get<1>(info.param));
                         });

// Packed symmetric storage (the default) distributed over two ranks ≡ dense storage in one
// process, bit for bit, for every Kronecker family of cases().
class PackedWorldEqualsDenseSingle : public ::testing::TestWithParam<DistributedCase> {};

TEST_P(PackedWorldEqualsDenseSingle, BitForBitInFloat32) {
  const auto& c = GetParam();
  ASSERT_TRUE(c.options.use_symmetric_packing());
  constexpr int kSteps = 5;
  const auto expected =
      single_process(ShampooOptions(c.options).use_symmetric_packing(false), kSteps);
  run_ranks(2, [&](int rank, const Group& group) {
    auto params = make_params(1);
    DistributedShampoo opt(make_groups(params, c.options), c.options,
                           DistributedOptions().process_group(group));
    for (int step = 1; step <= kSteps; ++step) {
      set_grads(params, step);
      opt.step();
      ASSERT_TRUE(bit_equal(snapshot(params), expected[step - 1]))
          << c.name << " rank " << rank << " step " << step;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Families, PackedWorldEqualsDenseSingle, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

// compact_state: the stochastic rounding's bits depend on the block and the step only, so two
// ranks still equal one process bit for bit.
TEST(CompactStateWorld, TwoRanksEqualOneProcessBitForBit) {
  for (const auto compact : {shampoo::CompactState::kBfloat16, shampoo::CompactState::kInt8}) {
    const auto options = ShampooOptions(cases()[1].options).momentum(0.5).compact_state(compact);
    constexpr int kSteps = 5;
    const auto expected = single_process(options, kSteps);
    run_ranks(2, [&](int rank, const Group& group) {
      auto params = make_params(1);
      DistributedShampoo opt(make_groups(params, options), options,
                             DistributedOptions().process_group(group));
      for (int step = 1; step <= kSteps; ++step) {
        set_grads(params, step);
        opt.step();
        ASSERT_TRUE(bit_equal(snapshot(params), expected[step - 1]))
            << "compact " << static_cast<int>(compact) << " rank " << rank << " step " << step;
      }
    });
  }
}

INSTANTIATE_TEST_SUITE_P(TrainersPerGroup, WorldEqualsSingle,
                         ::testing::Combine(::testing::Values(cases()[1]), ::testing::Values(4),
                                            ::testing::Values(int64_t{1}, int64_t{2}, int64_t{-1})),
                         [](const auto& info) {
                           const auto trainers = std::get<2>(info.param);
                           return "trainers_" +
                                  (trainers == -1 ? std::string("all") : std::to_string(trainers));
                         });

class LossyCommunication : public ::testing::TestWithParam<at::ScalarType> {};

TEST_P(LossyCommunication, WithinTwiceBf16ToleranceAndRanksAgree) {
  const auto dtype = GetParam();
  const auto options = cases()[1].options;
  const auto expected = single_process(options, 4);
  std::mutex mutex;
  std::vector<std::vector<at::Tensor>> finals(2);
  run_ranks(2, [&](int rank, const Group& group) {
    auto params = make_params(1);
    DistributedShampoo opt(make_groups(params, options), options,
                           DistributedOptions().process_group(group).communication_dtype(dtype));
    for (int step = 1; step <= 4; ++step) {
      set_grads(params, step);
      opt.step();
    }
    std::lock_guard<std::mutex> lock(mutex);
    finals[rank] = snapshot(params);
  });
  const auto bf16 = shampoo::testing::tolerance_for(at::kBFloat16);
  for (size_t i = 0; i < finals[0].size(); ++i) {
    EXPECT_TRUE(bit_equal(finals[0][i], finals[1][i])) << "ranks disagree on parameter " << i;
    EXPECT_TRUE(shampoo::testing::all_close(finals[0][i], expected.back()[i],
                                            {2 * bf16.rtol, 2 * bf16.atol}))
        << "parameter " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, LossyCommunication, ::testing::Values(at::kBFloat16, at::kHalf));

TEST(Distributed, CommunicateParamsEqualsSingle) {
  const auto options = cases()[0].options;
  const auto expected = single_process(options, 4);
  run_ranks(2, [&](int, const Group& group) {
    auto params = make_params(1);
    DistributedShampoo opt(make_groups(params, options), options,
                           DistributedOptions().process_group(group).communicate_params(true));
    for (int step = 1; step <= 4; ++step) {
      set_grads(params, step);
      opt.step();
      ASSERT_TRUE(bit_equal(snapshot(params), expected[step - 1])) << "step " << step;
    }
  });
}

TEST(Distributed, MoreRanksThanBlocks) {
  const auto options = ShampooOptions::reference_defaults(0.05).epsilon(1e-6).grafting(shampoo::AdamGraftingConfig{});
  auto reference = at::randn({3, 4}).requires_grad_();
  const auto initial = reference.detach().clone();
  DistributedShampoo single({reference}, options);
  const auto grad = at::randn({3, 4});
  reference.mutable_grad() = grad;
  single.step();
  std::mutex mutex;
  int64_t owners = 0;
  run_ranks(4, [&](int, const Group& group) {
    auto p = initial.clone().requires_grad_();
    DistributedShampoo opt({p}, options, DistributedOptions().process_group(group));
    p.mutable_grad() = grad.clone();
    opt.step();
    EXPECT_TRUE(bit_equal(p.detach(), reference.detach()));
    std::lock_guard<std::mutex> lock(mutex);
    owners += opt.stats().owned_blocks;
  });
  EXPECT_EQ(owners, 1);  // one block, three ranks own nothing and still take part
}

TEST(Distributed, RankWithoutGradientsNeverHangs) {
  const auto options = ShampooOptions::reference_defaults(0.05).epsilon(1e-6);
  std::mutex mutex;
  std::vector<std::vector<at::Tensor>> finals(2);
  std::vector<std::vector<int64_t>> owned(2);
  run_ranks(2, [&](int rank, const Group& group) {
    auto params = make_params(3);
    const auto before = snapshot(params);
    DistributedShampoo opt(params, options, DistributedOptions().process_group(group));
    for (int step = 1; step <= 3; ++step) {
      if (rank == 0) set_grads(params, step);  // rank 1 never has gradients
      opt.step();
    }
    std::lock_guard<std::mutex> lock(mutex);
    finals[rank] = snapshot(params);
    // Which parameters changed: exactly those with at least one block owned by rank 0.
    for (size_t i = 0; i < params.size(); ++i) {
      if (!at::equal(finals[rank][i], before[i])) owned[rank].push_back(static_cast<int64_t>(i));
    }
  });
  EXPECT_TRUE(bit_equal(finals[0], finals[1]));  // ranks stay identical
  EXPECT_EQ(owned[0], owned[1]);
  EXPECT_FALSE(owned[0].empty());                     // rank 0's blocks moved
  EXPECT_LT(owned[0].size(), make_params(3).size());  // rank 1's blocks could not
}

TEST(Distributed, OneCollectivePerStepMergedOnePerVirtualGroupUnmerged) {
  for (const bool merge : {true, false}) {
    run_ranks(2, [&](int, const Group& group) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
      std::vector<at::Tensor> params;
      std::vector<torch::optim::OptimizerParamGroup> groups;
      for (int g = 0; g < 64; ++g) {
        params.push_back(at::randn({4, 3}, gen).requires_grad_());
        groups.emplace_back(std::vector<at::Tensor>{params.back()},
                            std::make_unique<ShampooOptions>(ShampooOptions::reference_defaults(0.001 * (g + 1))));
      }
      DistributedShampoo opt(groups, ShampooOptions::reference_defaults(),
                             DistributedOptions().process_group(group).merge_param_groups(merge));
      set_grads(params, 1);
      opt.step();
      EXPECT_EQ(opt.stats().virtual_groups, merge ? 1 : 64);
      EXPECT_EQ(opt.stats().collectives_last_step, merge ? 1 : 64);
      // Owners balance over all blocks, also when every group is its own unit.
      EXPECT_EQ(opt.stats().owned_blocks, 32);
    });
  }
}

TEST(Distributed, DifferentParametersOnRanksAreAnErrorNotAHang) {
  std::mutex mutex;
  std::vector<std::string> messages(2);
  const auto start = std::chrono::steady_clock::now();
  run_ranks(2, [&](int rank, const Group& group) {
    std::vector<at::Tensor> params{at::randn({4, rank == 0 ? 3 : 5}).requires_grad_()};
    try {
      DistributedShampoo opt(params, ShampooOptions::reference_defaults(), DistributedOptions().process_group(group));
    } catch (const c10::Error& e) {
      std::lock_guard<std::mutex> lock(mutex);
      messages[rank] = e.what_without_backtrace();
    }
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  for (const auto& m : messages) {
    EXPECT_NE(m.find("ranks registered different parameters"), std::string::npos) << m;
    EXPECT_NE(m.find("rank 1 has 1 parameters (20 elements)"), std::string::npos) << m;
  }
}

TEST(Distributed, EveryStructuralOptionIsInTheRanksFingerprint) {
  // Options that once were left out of the fingerprint: a rank that differs only in one of them
  // is found at construction, on every rank.
  const std::vector<std::function<ShampooOptions(ShampooOptions)>> changes{
      [](ShampooOptions o) { return o.use_nesterov(true); },
      [](ShampooOptions o) { return o.use_bias_correction(false); },
      [](ShampooOptions o) {
        return o.inverse_exponent_override({{2, {{0, 0.5}}}});
      },
      [](ShampooOptions o) { return o.num_tolerated_failed_amortized_computations(7); },
      [](ShampooOptions o) { return o.preconditioner(shampoo::RootInvShampooConfig{false}); },
  };
  for (size_t c = 0; c < changes.size(); ++c) {
    SCOPED_TRACE("change " + std::to_string(c));
    std::mutex mutex;
    std::vector<std::string> messages(2);
    run_ranks(2, [&](int rank, const Group& group) {
      std::vector<at::Tensor> params{at::randn({4, 3}).requires_grad_()};
      const auto options = rank == 0 ? ShampooOptions::reference_defaults() : changes[c](ShampooOptions::reference_defaults());
      try {
        DistributedShampoo opt(params, options, DistributedOptions().process_group(group));
      } catch (const c10::Error& e) {
        std::lock_guard<std::mutex> lock(mutex);
        messages[rank] = e.what_without_backtrace();
      }
    });
    for (const auto& m : messages) {
      EXPECT_NE(m.find("other shapes, dtypes or structural options"), std::string::npos) << m;
    }
  }
}

TEST(Distributed, FloatOptionsThatDifferBetweenRanksAreAnErrorThatChangesNothing) {
  // An lr scheduled on one rank only (or from a rank's own metric) set the ranks apart silently:
  // each owner stepped its blocks with its own lr. The agreement before the update now carries
  // fingerprints of the float options, so the step is an error on every rank and changes nothing;
  // set alike again, the run goes on as if it had never happened.
  const auto options = cases()[0].options;
  const auto expected = single_process(options, 3);
  run_ranks(2, [&](int rank, const Group& group) {
    auto params = make_params(1);
    DistributedShampoo opt(make_groups(params, options), options,
                           DistributedOptions().process_group(group));
    set_grads(params, 1);
    opt.step();
    const auto after_first = snapshot(params);
    auto& lr_group = opt.param_groups()[0].options();
    auto& wd_group = static_cast<ShampooOptions&>(opt.param_groups()[1].options());
    const double lr = lr_group.get_lr();
    const double wd = wd_group.weight_decay();
    const std::vector<std::pair<std::function<void()>, std::string>> apart{
        {[&] { lr_group.set_lr(lr * 0.5); }, "the param groups' lrs differ between the ranks"},
        {[&] { wd_group.weight_decay(wd + 1e-3); },
         "the param groups' float options other than the lr differ between the ranks"},
    };
    for (const auto& [set_apart, says] : apart) {
      if (rank == 1) set_apart();
      set_grads(params, 2);
      shampoo::testing::expect_error([&] { opt.step(); },
                                     {says, "rank(s) 1 differ from rank 0", "Nothing changed"});
      EXPECT_TRUE(bit_equal(snapshot(params), after_first)) << "rank " << rank;
      EXPECT_EQ(opt.group_step(0), 1);
      lr_group.set_lr(lr);
      wd_group.weight_decay(wd);
    }
    for (int step = 2; step <= 3; ++step) {
      set_grads(params, step);
      opt.step();
    }
    EXPECT_TRUE(bit_equal(snapshot(params), expected.back())) << "rank " << rank;
  });
}

TEST(Distributed, EveryDistributedOptionThatShapesTheCollectivesMustAgree) {
  // A rank whose DistributedOptions differ in a field that changes what it sends (the buffer's
  // dtype, the trainer groups, updates or parameters, merged units, owners, the agreement before
  // the update) would send collectives the others do not expect: Gloo then ends the process, or
  // the ranks wait forever, or the owners differ and parameters go wrong silently. It is an error
  // at construction on every rank instead, naming the field and both values.
  struct Change {
    std::string field;
    std::function<DistributedOptions(DistributedOptions)> change;
    std::string values;
  };
  const std::vector<Change> changes{
      {"communication_dtype",
       [](DistributedOptions o) { return o.communication_dtype(at::kBFloat16); },
       "rank 1 has BFloat16, rank 0 has Float"},
      {"num_trainers_per_group", [](DistributedOptions o) { return o.num_trainers_per_group(1); },
       "rank 1 has 1, rank 0 has -1"},
      {"communicate_params", [](DistributedOptions o) { return o.communicate_params(true); },
       "rank 1 has true, rank 0 has false"},
      {"merge_param_groups", [](DistributedOptions o) { return o.merge_param_groups(false); },
       "rank 1 has false, rank 0 has true"},
      {"shard_by_parameter", [](DistributedOptions o) { return o.shard_by_parameter(true); },
       "rank 1 has true, rank 0 has false"},
      {"agree_before_update", [](DistributedOptions o) { return o.agree_before_update(false); },
       "rank 1 has false, rank 0 has true"},
  };
  for (const auto& c : changes) {
    SCOPED_TRACE(c.field);
    std::mutex mutex;
    std::vector<std::string> messages(2);
    run_ranks(2, [&](int rank, const Group& group) {
      auto params = make_params(1);
      const auto base = DistributedOptions().process_group(group);
      try {
        DistributedShampoo opt(make_groups(params, ShampooOptions::reference_defaults()),
                               ShampooOptions::reference_defaults(),
                               rank == 0 ? base : c.change(base));
        set_grads(params, 1);
        opt.step();
      } catch (const c10::Error& e) {
        std::lock_guard<std::mutex> lock(mutex);
        messages[rank] = e.what_without_backtrace();
      }
    });
    for (const auto& m : messages) {
      EXPECT_NE(m.find("DistributedOptions." + c.field + " differs between the ranks: " + c.values),
                std::string::npos)
          << m;
    }
  }
  // Options that change nothing in the collectives may differ (the undo copy in backward).
  run_ranks(2, [&](int rank, const Group& group) {
    auto params = make_params(1);
    DistributedShampoo opt(params, ShampooOptions::reference_defaults(),
                           DistributedOptions().process_group(group).undo_in_backward(rank == 0));
    set_grads(params, 1);
    EXPECT_NO_THROW(opt.step());
  });
}

/// Rank 1 stops taking part after construction: it exits (its sockets close) or hangs (alive,
/// never calling step(), until rank 0 has its answer). Rank 0's step must fail with a clear error
/// naming the cause, never wait forever. The property is the error, not a race: the bound on the
/// wait follows the configured timeout with room for a loaded machine (CTest runs these tests
/// alone: tests/distributor/CMakeLists.txt), and a test whose error never comes still fails.
void expect_live_rank_fails(bool hang, std::chrono::milliseconds timeout, const std::string& what,
                            std::chrono::milliseconds at_most) {
  std::string message;
  std::chrono::steady_clock::duration waited{};
  std::promise<void> answered;
  auto answer = answered.get_future().share();
  run_ranks(
      2,
      [&](int rank, const Group& group) {
        auto params = make_params(1);
        DistributedShampoo opt(params, ShampooOptions::reference_defaults(), DistributedOptions().process_group(group));
        if (rank == 1) {
          // Hung: alive until rank 0 has failed (bounded, so a broken test cannot hang forever).
          if (hang) answer.wait_for(4 * at_most);
          return;
        }
        set_grads(params, 1);
        const auto start = std::chrono::steady_clock::now();
        try {
          opt.step();
        } catch (const std::exception& e) {
          message = e.what();
        }
        waited = std::chrono::steady_clock::now() - start;
        answered.set_value();
      },
      timeout);
  // The step's first collective fails: the agreement before the update (the default), or the
  // AllGather without it; both say why.
  EXPECT_NE(message.find("failed on rank 0 (another rank died, hung, or called step() a "
                         "different number of times)"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find(what), std::string::npos) << message;
  EXPECT_LT(waited, at_most);
}

TEST(Distributed, DeadRankMakesTheOthersFail) {
  // The peer's sockets close: "Connection reset by peer" or "Connection closed by peer", before
  // the configured timeout would have fired (so the closed peer is what was detected).
  const std::chrono::milliseconds timeout = std::chrono::seconds(30);
  expect_live_rank_fails(/*hang=*/false, timeout, "by peer", timeout);
}

TEST(Distributed, HungRankMakesTheOthersTimeOut) {
  // The peer stays alive and silent: only the configured timeout can end the wait.
  const std::chrono::milliseconds timeout = std::chrono::seconds(3);
  expect_live_rank_fails(/*hang=*/true, timeout, "imed out",
                         3 * timeout + std::chrono::seconds(10));
}

TEST(Distributed, CheckpointsResumeAtTheSameWorldSize) {
  const auto options = cases()[1].options;
  const auto expected = single_process(options, 8);
  const auto dir = shampoo::testing::temp_path("ckpt");
  run_ranks(2, [&](int rank, const Group& group) {
    const auto path = dir + "_rank" + std::to_string(rank) + ".pt";
    std::vector<at::Tensor> saved;
    {
      auto params = make_params(1);
      DistributedShampoo opt(make_groups(params, options), options,
                             DistributedOptions().process_group(group));
      for (int step = 1; step <= 4; ++step) {
        set_grads(params, step);
        opt.step();
      }
      torch::save(opt, path);
      saved = snapshot(params);
    }
    auto params = make_params(1);
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) params[i].copy_(saved[i]);
    }
    DistributedShampoo opt(make_groups(params, options), options,
                           DistributedOptions().process_group(group));
    torch::load(opt, path);
    for (int step = 5; step <= 8; ++step) {
      set_grads(params, step);
      opt.step();
    }
    EXPECT_TRUE(bit_equal(snapshot(params), expected.back())) << "rank " << rank;
  });
  // The same files at another world size: refused with a clear error.
  run_ranks(4, [&](int rank, const Group& group) {
    auto params = make_params(1);
    DistributedShampoo opt(make_groups(params, options), options,
                           DistributedOptions().process_group(group));
    try {
      torch::load(opt, dir + "_rank" + std::to_string(rank % 2) + ".pt");
      ADD_FAILURE() << "loading a world-2 checkpoint at world 4 should fail";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find("different world size"),
                std::string::npos);
    }
  });
  for (int rank = 0; rank < 2; ++rank) {
    std::filesystem::remove(dir + "_rank" + std::to_string(rank) + ".pt");
  }
}

}  // namespace
