// Virtual parameter groups: groups that differ only in float hyperparameters run as one virtual
// group, bit for bit like running them separately; structural differences keep groups apart;
// live option changes (set_lr, schedulers) apply to their own group only.
#include <shampoo/shampoo.h>
#include <shampoo/virtual_group.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/serialize.h>

#include <filesystem>

#include "support/test_support.h"

namespace {

using shampoo::DistributedOptions;
using shampoo::DistributedShampoo;
using shampoo::ShampooOptions;
using shampoo::testing::bit_equal;
using shampoo::testing::snapshot;

constexpr int kGroups = 32;

/// 64 parameters of a few shapes (so stacks hold blocks of many groups), 2 per group.
std::vector<at::Tensor> make_params(uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const std::vector<std::vector<int64_t>> shapes{{6, 5}, {7}, {4, 3, 2}, {12, 9}};
  std::vector<at::Tensor> params;
  for (int i = 0; i < 2 * kGroups; ++i) {
    params.push_back(at::randn(shapes[i % shapes.size()], gen).requires_grad_());
  }
  return params;
}

/// Group g's options: every float hyperparameter varies with g, the structure does not.
ShampooOptions group_options(int g) {
  const double beta1s[] = {0.9, 0.0, 0.95, 0.5};
  const double beta2s[] = {0.99, 0.999, 1.0};
  return ShampooOptions::reference_defaults(0.01 * (1 + g % 5))
      .betas({beta1s[g % 4], beta2s[g % 3]})
      .beta3(g % 7 == 0 ? 0.8 : -1.0)
      .epsilon(1e-8 * (1 + g % 3))
      .weight_decay(g % 2 == 0 ? 0.0 : 1e-3 * (g % 6))
      .momentum(g % 3 == 0 ? 0.0 : 0.5 + 0.1 * (g % 4))
      .dampening(g % 5 == 0 ? 0.1 : 0.0)
      .precondition_frequency(3)
      .start_preconditioning_step(2)
      .max_preconditioner_dim(8)
      .grafting(shampoo::AdamGraftingConfig{0.99 + 0.001 * (g % 9), 1e-8 * (1 + g % 2)});
}

std::vector<torch::optim::OptimizerParamGroup> make_groups(const std::vector<at::Tensor>& params,
                                                           int count) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (int g = 0; g < count; ++g) {
    groups.emplace_back(std::vector<at::Tensor>{params[2 * g], params[2 * g + 1]},
                        std::make_unique<ShampooOptions>(group_options(g)));
  }
  return groups;
}

void set_grads(const std::vector<at::Tensor>& params, int step) {
  shampoo::testing::set_random_grads(params, 500 + step);
}

TEST(VirtualGroups, MergedEqualsUnmergedBitForBitWithLiveLearningRates) {
  auto merged_params = make_params(1);
  auto unmerged_params = make_params(1);
  DistributedShampoo merged(make_groups(merged_params, kGroups));
  DistributedShampoo unmerged(make_groups(unmerged_params, kGroups), ShampooOptions::reference_defaults(),
                              DistributedOptions().merge_param_groups(false));
  EXPECT_EQ(merged.stats().virtual_groups, 1);
  EXPECT_EQ(unmerged.stats().virtual_groups, kGroups);
  torch::optim::StepLR merged_scheduler(merged, /*step_size=*/8, /*gamma=*/0.5);
  torch::optim::StepLR unmerged_scheduler(unmerged, 8, 0.5);
  for (int step = 1; step <= 24; ++step) {
    if (step == 10) {
      merged.param_groups()[3].options().set_lr(0.123);
      unmerged.param_groups()[3].options().set_lr(0.123);
    }
    set_grads(merged_params, step);
    set_grads(unmerged_params, step);
    merged.step();
    unmerged.step();
    merged_scheduler.step();
    unmerged_scheduler.step();
    ASSERT_TRUE(bit_equal(snapshot(merged_params), snapshot(unmerged_params))) << "step " << step;
  }
  EXPECT_GT(merged.stats().amortized_computations, 0);
  EXPECT_EQ(merged.stats().amortized_computations, unmerged.stats().amortized_computations);
}

// Roots are computed per stack of equal block shapes, in one batched call per dim: merged groups
// share the calls, whatever the number of blocks or groups.
TEST(VirtualGroups, RootsAreOneBatchedCallPerStackAndDim) {
  for (const bool merge : {true, false}) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
    std::vector<at::Tensor> params;
    for (int i = 0; i < 6; ++i) params.push_back(at::randn({8, 6}, gen).requires_grad_());
    std::vector<torch::optim::OptimizerParamGroup> groups;
    for (int g = 0; g < 3; ++g) {
      groups.emplace_back(std::vector<at::Tensor>{params[2 * g], params[2 * g + 1]},
                          std::make_unique<ShampooOptions>(ShampooOptions::reference_defaults(
                                                               0.01 * (g + 1))
                                                               .precondition_frequency(1)
                                                               .start_preconditioning_step(1)
                                                               .max_preconditioner_dim(8)));
    }
    DistributedShampoo opt(std::move(groups), ShampooOptions::reference_defaults(),
                           DistributedOptions().merge_param_groups(merge));
    set_grads(params, 1);
    opt.step();
    // 6 blocks of [8, 6] (kept 2-D: 48 > max_preconditioner_dim), each an amortized computation
    // of both its factors: one stack, so one batched call per dim, or 2 per group unmerged.
    EXPECT_EQ(opt.stats().amortized_computations, 6) << "merge " << merge;
    EXPECT_EQ(opt.stats().amortized_batched_calls, merge ? 2 : 6) << "merge " << merge;
  }
}

TEST(VirtualGroups, MergedEqualsUnmergedBitForBitWithEveryRootSolver) {
  for (const auto solver : {shampoo::RootSolver::kCoupledNewton, shampoo::RootSolver::kNewtonDB,
                            shampoo::RootSolver::kNewtonSchulz}) {
    auto merged_params = make_params(5);
    auto unmerged_params = make_params(5);
    auto with_solver = [&](const std::vector<at::Tensor>& params) {
      auto groups = make_groups(params, 8);
      for (auto& g : groups) {
        static_cast<ShampooOptions&>(g.options())
            .preconditioner(shampoo::RootInvShampooConfig{.solver = solver});
      }
      return groups;
    };
    DistributedShampoo merged(with_solver(merged_params));
    DistributedShampoo unmerged(with_solver(unmerged_params), ShampooOptions::reference_defaults(),
                                DistributedOptions().merge_param_groups(false));
    ASSERT_EQ(merged.stats().virtual_groups, 1);
    for (int step = 1; step <= 9; ++step) {
      set_grads(merged_params, step);
      set_grads(unmerged_params, step);
      merged.step();
      unmerged.step();
      ASSERT_TRUE(bit_equal(snapshot(merged_params), snapshot(unmerged_params)))
          << "solver " << static_cast<int>(solver) << " step " << step;
    }
    EXPECT_GT(merged.stats().amortized_computations, merged.stats().root_solver_fallbacks);
  }
}

TEST(VirtualGroups, MergedEqualsUnmergedBitForBitWithEigendecomposedFamilies) {
  const std::vector<std::pair<shampoo::PreconditionerConfig, double>> configs{
      {shampoo::EigendecomposedShampooConfig{}, 1e-6},
      {shampoo::EigendecomposedShampooConfig{.eigenbasis_method = shampoo::EigenbasisMethod::kQR},
       1e-6},
      {shampoo::EigendecomposedShampooConfig{.rank_deficient_stability =
                                                 shampoo::PseudoInverseConfig{.rank_rtol = 1e-5}},
       0.0},
      {shampoo::RootInvShampooConfig{.rank_deficient_stability =
                                         shampoo::PseudoInverseConfig{.rank_rtol = 1e-5}},
       0.0}};
  for (const auto& [config, epsilon] : configs) {
    auto merged_params = make_params(5);
    auto unmerged_params = make_params(5);
    const auto initial = snapshot(merged_params);
    auto with_config = [&](const std::vector<at::Tensor>& params) {
      auto groups = make_groups(params, 8);
      for (auto& g : groups) {
        static_cast<ShampooOptions&>(g.options()).epsilon(epsilon).preconditioner(config);
      }
      return groups;
    };
    DistributedShampoo merged(with_config(merged_params));
    DistributedShampoo unmerged(with_config(unmerged_params), ShampooOptions::reference_defaults(),
                                DistributedOptions().merge_param_groups(false));
    ASSERT_EQ(merged.stats().virtual_groups, 1);
    for (int step = 1; step <= 9; ++step) {
      set_grads(merged_params, step);
      set_grads(unmerged_params, step);
      merged.step();
      unmerged.step();
      ASSERT_TRUE(bit_equal(snapshot(merged_params), snapshot(unmerged_params)))
          << "config " << config.index() << " step " << step;
    }
    EXPECT_GT(merged.stats().amortized_computations, 0);
    EXPECT_FALSE(merged_params[0].detach().equal(initial[0]));
  }
}

TEST(VirtualGroups, SetLrChangesOnlyItsGroup) {
  auto a = make_params(2);
  auto b = make_params(2);
  DistributedShampoo first(make_groups(a, 4));
  DistributedShampoo second(make_groups(b, 4));
  second.param_groups()[2].options().set_lr(0.5);
  set_grads(a, 1);
  set_grads(b, 1);
  first.step();
  second.step();
  for (int i = 0; i < 8; ++i) {
    const bool in_group_2 = i / 2 == 2;
    EXPECT_EQ(bit_equal(a[i].detach(), b[i].detach()), !in_group_2) << "parameter " << i;
  }
}

TEST(VirtualGroups, StructuralDifferencesAreNotMerged) {
  auto params = make_params(3);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{params[0]},
                      std::make_unique<ShampooOptions>(group_options(0)));
  groups.emplace_back(std::vector<at::Tensor>{params[1]},
                      std::make_unique<ShampooOptions>(group_options(1)));  // floats differ
  groups.emplace_back(std::vector<at::Tensor>{params[2]},
                      std::make_unique<ShampooOptions>(group_options(2).precondition_frequency(5)));
  groups.emplace_back(
      std::vector<at::Tensor>{params[3]},
      std::make_unique<ShampooOptions>(group_options(3).grafting(shampoo::SGDGraftingConfig{})));
  groups.emplace_back(std::vector<at::Tensor>{params[4]},
                      std::make_unique<ShampooOptions>(
                          group_options(4).weight_decay_type(shampoo::WeightDecayType::kL2)));
  groups.emplace_back(std::vector<at::Tensor>{params[5]},
                      std::make_unique<ShampooOptions>(group_options(5).use_nesterov(true)));
  groups.emplace_back(std::vector<at::Tensor>{params[6]},
                      std::make_unique<ShampooOptions>(group_options(6).preconditioner(
                          shampoo::EigenvalueCorrectedShampooConfig{})));
  groups.emplace_back(
      std::vector<at::Tensor>{params[7]},
      std::make_unique<ShampooOptions>(group_options(7).factor_matrix_dtype(at::kDouble)));
  DistributedShampoo opt(groups);
  EXPECT_EQ(opt.stats().virtual_groups, 7);  // groups 0 and 1 merge, every other one is alone
}

TEST(VirtualGroups, GroupAddedLaterKeepsItsOwnStepCount) {
  auto merged_params = make_params(4);
  auto unmerged_params = make_params(4);
  auto merged_groups = make_groups(merged_params, kGroups);
  auto unmerged_groups = make_groups(unmerged_params, kGroups);
  DistributedShampoo merged(std::vector<torch::optim::OptimizerParamGroup>(
      merged_groups.begin(), merged_groups.begin() + 8));
  DistributedShampoo unmerged(std::vector<torch::optim::OptimizerParamGroup>(
                                  unmerged_groups.begin(), unmerged_groups.begin() + 8),
                              ShampooOptions::reference_defaults(), DistributedOptions().merge_param_groups(false));
  std::vector<at::Tensor> merged_active(merged_params.begin(), merged_params.begin() + 16);
  std::vector<at::Tensor> unmerged_active(unmerged_params.begin(), unmerged_params.begin() + 16);
  for (int step = 1; step <= 12; ++step) {
    if (step == 6) {
      // Same structure as the first groups: it joins their virtual group, with its own steps.
      merged.add_param_group(merged_groups[8]);
      unmerged.add_param_group(unmerged_groups[8]);
      for (int i = 16; i < 18; ++i) {
        merged_active.push_back(merged_params[i]);
        unmerged_active.push_back(unmerged_params[i]);
      }
      EXPECT_EQ(merged.stats().virtual_groups, 1);
    }
    set_grads(merged_active, step);
    set_grads(unmerged_active, step);
    merged.step();
    unmerged.step();
    ASSERT_TRUE(bit_equal(snapshot(merged_active), snapshot(unmerged_active))) << "step " << step;
  }
  EXPECT_EQ(merged.group_step(0), 12);
  EXPECT_EQ(merged.group_step(8), 7);

  // The late group's first step equals a fresh optimizer's first step (bias corrections of
  // step 1, not step 6).
  auto late = make_params(4);
  auto fresh_params = make_params(4);
  auto late_groups = make_groups(late, kGroups);
  DistributedShampoo with_late(
      std::vector<torch::optim::OptimizerParamGroup>(late_groups.begin(), late_groups.begin() + 1));
  std::vector<at::Tensor> first_two(late.begin(), late.begin() + 2);
  for (int step = 1; step <= 5; ++step) {
    set_grads(first_two, step);
    with_late.step();
  }
  with_late.add_param_group(late_groups[8]);
  for (const auto& p : first_two) p.mutable_grad().reset();
  std::vector<at::Tensor> late_pair{late[16], late[17]};
  set_grads(late_pair, 99);
  with_late.step();
  auto fresh_groups = make_groups(fresh_params, kGroups);
  DistributedShampoo fresh(std::vector<torch::optim::OptimizerParamGroup>{fresh_groups[8]});
  std::vector<at::Tensor> fresh_pair{fresh_params[16], fresh_params[17]};
  set_grads(fresh_pair, 99);
  fresh.step();
  EXPECT_TRUE(bit_equal(snapshot(late_pair), snapshot(fresh_pair)));
}

/// Losses of an MLP trained with the parameters assigned round-robin to groups of `lrs`.
std::vector<double> round_robin_losses(const std::vector<double>& lrs) {
  auto model = shampoo::testing::make_mlp(8, 16, 4, /*seed=*/5);
  const auto data = shampoo::testing::make_blobs(128, 8, 4, /*seed=*/6);
  const auto params = model->parameters();
  std::vector<std::vector<at::Tensor>> members(lrs.size());
  for (size_t i = 0; i < params.size(); ++i) members[i % lrs.size()].push_back(params[i]);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  const auto base = ShampooOptions::reference_defaults()
                        .betas({0.9, 0.999})
                        .epsilon(1e-10)
                        .precondition_frequency(4)
                        .grafting(shampoo::AdamGraftingConfig{0.999, 1e-8});
  for (size_t g = 0; g < lrs.size(); ++g) {
    groups.emplace_back(members[g],
                        std::make_unique<ShampooOptions>(ShampooOptions(base).lr(lrs[g])));
  }
  DistributedShampoo optimizer(groups, base);
  std::vector<double> losses;
  for (int step = 0; step < 20; ++step) {
    optimizer.zero_grad();
    losses.push_back(shampoo::testing::classification_loss(model, data, true).item<double>());
    optimizer.step();
  }
  return losses;
}

TEST(VirtualGroups, RoundRobinLearningRates) {
  const auto single = round_robin_losses({0.1});
  EXPECT_EQ(round_robin_losses({0.1, 0.1}), single);
  EXPECT_NE(round_robin_losses({0.1, 0.2}), single);
  EXPECT_LT(single.back(), single.front());
}

TEST(VirtualGroups, CheckpointsCrossBetweenMergedAndUnmerged) {
  for (const bool save_merged : {true, false}) {
    auto reference_params = make_params(7);
    DistributedShampoo reference(make_groups(reference_params, 16));
    for (int step = 1; step <= 10; ++step) {
      set_grads(reference_params, step);
      reference.step();
    }
    auto first_params = make_params(7);
    DistributedShampoo first(make_groups(first_params, 16), ShampooOptions::reference_defaults(),
                             DistributedOptions().merge_param_groups(save_merged));
    for (int step = 1; step <= 5; ++step) {
      set_grads(first_params, step);
      first.step();
    }
    const auto path = shampoo::testing::temp_path(save_merged ? "merged.pt" : "unmerged.pt");
    torch::save(first, path);
    auto second_params = make_params(7);
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < second_params.size(); ++i) second_params[i].copy_(first_params[i]);
    }
    DistributedShampoo second(make_groups(second_params, 16), ShampooOptions::reference_defaults(),
                              DistributedOptions().merge_param_groups(!save_merged));
    torch::load(second, path);
    for (int step = 6; step <= 10; ++step) {
      set_grads(second_params, step);
      second.step();
    }
    std::vector<at::Tensor> used(reference_params.begin(), reference_params.begin() + 32);
    std::vector<at::Tensor> resumed(second_params.begin(), second_params.begin() + 32);
    EXPECT_TRUE(bit_equal(snapshot(resumed), snapshot(used))) << "saved merged: " << save_merged;
    std::filesystem::remove(path);
  }
}

/// The parameters after `steps` steps of the 32 groups (merged), with the step's rows in chunks
/// of at most `chunk_bytes` (0 = the default 32 MiB: one chunk here).
std::vector<at::Tensor> run_in_chunks(int64_t chunk_bytes, bool eigenvalue_corrected, int steps) {
  shampoo::detail::set_step_chunk_bytes_for_testing(chunk_bytes);
  auto params = make_params(1);
  auto groups = make_groups(params, kGroups);
  if (eigenvalue_corrected) {
    for (auto& group : groups) {
      static_cast<ShampooOptions&>(group.options())
          .preconditioner(shampoo::EigenvalueCorrectedShampooConfig{});
    }
  }
  DistributedShampoo opt(std::move(groups));
  for (int step = 1; step <= steps; ++step) {
    set_grads(params, step);
    if (step % 4 == 0) params[5].mutable_grad() = at::Tensor();  // a row without a gradient
    opt.step();
  }
  shampoo::detail::set_step_chunk_bytes_for_testing(0);
  return snapshot(params);
}

TEST(StepChunks, ResultsDoNotDependOnTheChunks) {
  // The 12×9 parameters make a stack of 64 rows of 8×8 blocks; 1 byte puts every row in a chunk
  // of its own, 2 KiB a few rows together, across stacks.
  for (const bool eigenvalue_corrected : {false, true}) {
    const auto whole = run_in_chunks(0, eigenvalue_corrected, 7);
    EXPECT_TRUE(bit_equal(run_in_chunks(1, eigenvalue_corrected, 7), whole))
        << "one row per chunk, eigenvalue corrected: " << eigenvalue_corrected;
    EXPECT_TRUE(bit_equal(run_in_chunks(2048, eigenvalue_corrected, 7), whole))
        << "2 KiB chunks, eigenvalue corrected: " << eigenvalue_corrected;
  }
}

}  // namespace
