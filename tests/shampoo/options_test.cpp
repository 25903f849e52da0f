// Construction-time checks (field, value, allowed range), per-group options kept, lr()/set_lr()
// and LibTorch's LR schedulers. The base class's add_param_group: base_class_api_test.
#include <ATen/CPUGeneratorImpl.h>
#include <shampoo/shampoo.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/optim/sgd.h>

#include <regex>

#include "support/test_support.h"

namespace {

using shampoo::testing::expect_error;

using shampoo::DistributedShampoo;
using shampoo::ShampooOptions;

std::vector<at::Tensor> params() {
  return {at::randn({4, 3}).requires_grad_(), at::randn({3}).requires_grad_()};
}

TEST(OptionsValidation, BadValuesNameFieldValueAndRange) {
  auto build = [](ShampooOptions o) { return [o] { DistributedShampoo opt(params(), o); }; };
  expect_error(build(ShampooOptions::reference_defaults(-0.1)), {"lr", "-0.1", ">= 0"});
  expect_error(build(ShampooOptions::reference_defaults().betas({1.0, 0.9})), {"betas[0]", "1", "[0, 1)"});
  expect_error(build(ShampooOptions::reference_defaults().betas({0.9, 0.0})), {"betas[1]", "0", "(0, 1]"});
  expect_error(build(ShampooOptions::reference_defaults().betas({0.9, 1.5})), {"betas[1]", "1.5"});
  expect_error(build(ShampooOptions::reference_defaults().beta3(1.2)), {"beta3", "1.2"});
  expect_error(build(ShampooOptions::reference_defaults().epsilon(0.0)), {"epsilon", "0", "> 0"});
  expect_error(build(ShampooOptions::reference_defaults().epsilon(-1e-12)), {"epsilon", "> 0"});
  expect_error(build(ShampooOptions::reference_defaults().max_preconditioner_dim(0)),
               {"max_preconditioner_dim", "0", ">= 1"});
  expect_error(build(ShampooOptions::reference_defaults().precondition_frequency(0)),
               {"precondition_frequency", "0", ">= 1"});
  expect_error(build(ShampooOptions::reference_defaults().start_preconditioning_step(-2)),
               {"start_preconditioning_step", "-2"});
  expect_error(build(ShampooOptions::reference_defaults().weight_decay(-1.0)), {"weight_decay", "-1"});
  expect_error(build(ShampooOptions::reference_defaults().momentum(1.0)), {"momentum", "1"});
  expect_error(build(ShampooOptions::reference_defaults().factor_matrix_dtype(at::kHalf)),
               {"factor_matrix_dtype", "Half", "Float or Double"});
  expect_error(build(ShampooOptions::reference_defaults().grafting(shampoo::AdamGraftingConfig{0.999, 0.0})),
               {"grafting (Adam).epsilon", "> 0"});
  expect_error(build(ShampooOptions::reference_defaults().inverse_exponent_override({{2, {{5, 0.5}}}})),
               {"inverse_exponent_override", "dim 5"});
  expect_error(build(ShampooOptions::reference_defaults().num_tolerated_failed_amortized_computations(-1)),
               {"num_tolerated_failed_amortized_computations", "-1"});
}

TEST(OptionsValidation, BadRootSolverSettingsNameFieldValueAndRange) {
  auto build = [](ShampooOptions o) { return [o] { DistributedShampoo opt(params(), o); }; };
  using shampoo::RootInvShampooConfig;
  using shampoo::RootSolver;
  expect_error(build(ShampooOptions::reference_defaults().preconditioner(RootInvShampooConfig{
                   .solver = RootSolver::kCoupledNewton, .max_iterations = 0})),
               {"preconditioner.max_iterations", "0", ">= 1"});
  expect_error(build(ShampooOptions::reference_defaults().preconditioner(
                   RootInvShampooConfig{.solver = RootSolver::kNewtonDB, .tolerance = 0.0})),
               {"preconditioner.tolerance", "0", "> 0"});
  expect_error(build(ShampooOptions::reference_defaults()
                         .preconditioner(RootInvShampooConfig{.solver = RootSolver::kNewtonDB})
                         .inverse_exponent_override({{2, {{1, 0.3}}}})),
               {"inverse_exponent_override[2][1]", "0.3", "integer"});
  expect_error(
      build(ShampooOptions::reference_defaults().preconditioner(RootInvShampooConfig{.solver = RootSolver(7)})),
      {"preconditioner.solver", "7"});
  // eigh takes any exponent and ignores the iteration settings.
  DistributedShampoo fine(params(), ShampooOptions::reference_defaults()
                                        .preconditioner(RootInvShampooConfig{.max_iterations = 0})
                                        .inverse_exponent_override({{2, {{1, 0.3}}}}));
}

TEST(OptionsValidation, BadDistributedOptions) {
  expect_error(
      [] {
        DistributedShampoo opt(params(), {},
                               shampoo::DistributedOptions().communication_dtype(at::kDouble));
      },
      {"communication_dtype", "Double", "Float, BFloat16 or Half"});
  expect_error(
      [] {
        DistributedShampoo opt(params(), {},
                               shampoo::DistributedOptions().num_trainers_per_group(0));
      },
      {"num_trainers_per_group", "0"});
}

TEST(OptionsValidation, BadParameters) {
  expect_error([] { DistributedShampoo opt({at::ones({3}, at::kLong)}); },
               {"parameter 0", "Long", "floating-point"});
  expect_error([] { DistributedShampoo opt({at::ones({3}).to(at::kFloat8_e4m3fn)}); },
               {"parameter 0", "Float8_e4m3fn", "Float, Double, BFloat16 or Half"});
  expect_error(
      [] {
        auto sparse = at::eye(3).to_sparse();
        DistributedShampoo opt({sparse});
      },
      {"sparse"});
  expect_error(
      [] {
        auto p = at::randn({3}).requires_grad_();
        std::vector<torch::optim::OptimizerParamGroup> groups;
        groups.emplace_back(std::vector<at::Tensor>{p});
        groups.emplace_back(std::vector<at::Tensor>{at::randn({2}), p});
        DistributedShampoo opt(groups);
      },
      {"param group 1", "parameter 1", "already in param group 0"});
  expect_error(
      [] {
        auto p = at::randn({3}).requires_grad_();
        DistributedShampoo opt({p, p});
      },
      {"already in param group 0"});
  // An empty list is accepted, as LibTorch's optimizers accept one (base_class_api_test).
  // Non-contiguous parameters, such as channels_last weights, are accepted: mixed_precision_test.
}

TEST(MixedDtypes, OneGroupWithFloatAndDoubleIsRefusedAtConstruction) {
  // Found at construction, naming both parameters and dtypes (not at step() by the chain).
  expect_error(
      [] {
        DistributedShampoo opt(
            {at::randn({3}).requires_grad_(), at::randn({2}, at::kDouble).requires_grad_()});
      },
      {"param group 0", "parameter 1", "dtype: got Double, expected Float", "parameter 0"});
  DistributedShampoo opt(params());
  expect_error(
      [&] {
        opt.add_param_group(torch::optim::OptimizerParamGroup(
            {at::randn({2}, at::kDouble).requires_grad_(), at::randn({2}).requires_grad_()}));
      },
      {"param group 1", "parameter 1", "dtype: got Float, expected Double", "parameter 0"});
  EXPECT_EQ(opt.param_groups().size(), 1u);  // the refused group was not added
}

/// Steps `optimizer` `steps` times with fixed gradients drawn for each step.
void run_steps(torch::optim::Optimizer& optimizer, const std::vector<at::Tensor>& ps, int steps) {
  for (int t = 0; t < steps; ++t) {
    shampoo::testing::set_random_grads(ps, 100 + t);
    optimizer.step();
  }
}

TEST(MixedDtypes, GroupsOfDifferentDtypesStepLikeSeparateOptimizers) {
  // Different dtypes in different groups are allowed: each dtype is a virtual group of its own
  // (the chain runs one dtype), even when the groups' options are equal.
  const auto options =
      ShampooOptions::reference_defaults(0.05).betas({0.9, 0.99}).grafting(shampoo::AdamGraftingConfig{0.99, 1e-8});
  for (const bool merge : {true, false}) {
    SCOPED_TRACE(merge ? "merged" : "unmerged");
    auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
    const std::vector<at::Tensor> floats{at::randn({4, 3}, gen).requires_grad_(),
                                         at::randn({3}, gen).requires_grad_()};
    const std::vector<at::Tensor> doubles{at::randn({5, 2}, gen).to(at::kDouble).requires_grad_(),
                                          at::randn({2}, gen).to(at::kDouble).requires_grad_()};
    const auto floats_alone = shampoo::testing::clone_params(floats);
    const auto doubles_alone = shampoo::testing::clone_params(doubles);

    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(floats);
    groups.emplace_back(doubles);
    DistributedShampoo both(groups, options,
                            shampoo::DistributedOptions().merge_param_groups(merge));
    EXPECT_EQ(both.stats().virtual_groups, 2);
    std::vector<at::Tensor> all = floats;
    all.insert(all.end(), doubles.begin(), doubles.end());
    run_steps(both, all, 4);

    DistributedShampoo float_opt(floats_alone, options);
    DistributedShampoo double_opt(doubles_alone, options);
    std::vector<at::Tensor> all_alone = floats_alone;
    all_alone.insert(all_alone.end(), doubles_alone.begin(), doubles_alone.end());
    for (int t = 0; t < 4; ++t) {
      shampoo::testing::set_random_grads(all_alone, 100 + t);
      float_opt.step();
      double_opt.step();
    }
    EXPECT_EQ(doubles[0].scalar_type(), at::kDouble);
    EXPECT_TRUE(shampoo::testing::bit_equal(shampoo::testing::snapshot(all),
                                            shampoo::testing::snapshot(all_alone)));
  }
}

TEST(OptionsValidation, GroupsOfAnotherOptimizerAreRejected) {
  expect_error(
      [] {
        std::vector<torch::optim::OptimizerParamGroup> groups;
        groups.emplace_back(std::vector<at::Tensor>{at::randn({3}).requires_grad_()},
                            std::make_unique<torch::optim::SGDOptions>(0.1));
        DistributedShampoo opt(groups);
      },
      {"param group 0", "shampoo::ShampooOptions"});
}

TEST(GroupOptions, EachGroupKeepsItsOwnOptions) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{at::randn({3}).requires_grad_()},
                      std::make_unique<ShampooOptions>(ShampooOptions::reference_defaults(0.5).epsilon(1e-6)));
  groups.emplace_back(std::vector<at::Tensor>{at::randn({3}).requires_grad_()});
  DistributedShampoo opt(groups, ShampooOptions::reference_defaults(0.01));
  opt.add_param_group(torch::optim::OptimizerParamGroup(
      {at::randn({2}).requires_grad_()},
      std::make_unique<ShampooOptions>(ShampooOptions::reference_defaults(0.25).momentum(0.5))));
  ASSERT_EQ(opt.param_groups().size(), 3u);
  EXPECT_EQ(opt.group_options(0).lr(), 0.5);
  EXPECT_EQ(opt.group_options(0).epsilon(), 1e-6);
  EXPECT_EQ(opt.group_options(1).lr(), 0.01);  // no options: the defaults
  EXPECT_EQ(opt.group_options(2).lr(), 0.25);
  EXPECT_EQ(opt.group_options(2).momentum(), 0.5);
  EXPECT_EQ(opt.param_groups()[2].options().get_lr(), 0.25);
}

TEST(GroupOptions, SetLrChangesTheStep) {
  // One SGD-grafted step never preconditioned: p -= lr * g exactly.
  auto p = at::ones({3}).requires_grad_();
  DistributedShampoo opt({p}, ShampooOptions::reference_defaults(0.1)
                                  .betas({0.0, 1.0})
                                  .start_preconditioning_step(shampoo::kNeverStartPreconditioning)
                                  .grafting(shampoo::SGDGraftingConfig{}));
  p.mutable_grad() = at::full({3}, 2.0);
  opt.step();
  EXPECT_TRUE(at::allclose(p.detach(), at::full({3}, 0.8)));
  opt.param_groups()[0].options().set_lr(0.01);
  EXPECT_EQ(opt.group_options(0).lr(), 0.01);
  opt.step();
  EXPECT_TRUE(at::allclose(p.detach(), at::full({3}, 0.78)));
}

TEST(GroupOptions, StepLRSchedulerDrivesTheLearningRate) {
  auto p = at::ones({2}).requires_grad_();
  DistributedShampoo opt({p}, ShampooOptions::reference_defaults(1.0)
                                  .betas({0.0, 1.0})
                                  .start_preconditioning_step(shampoo::kNeverStartPreconditioning)
                                  .grafting(shampoo::SGDGraftingConfig{}));
  torch::optim::StepLR scheduler(opt, /*step_size=*/2, /*gamma=*/0.5);
  std::vector<double> lrs;
  for (int i = 0; i < 5; ++i) {
    p.mutable_grad() = at::ones({2});
    opt.step();
    lrs.push_back(opt.group_options(0).lr());
    scheduler.step();
  }
  // LibTorch's StepLR decays on the call after step_size calls (its first call is a no-op).
  EXPECT_EQ(lrs, (std::vector<double>{1.0, 1.0, 1.0, 0.5, 0.5}));
  // Parameters moved by the sum of the learning rates used.
  EXPECT_TRUE(at::allclose(p.detach(), at::full({2}, 1.0 - 4.0)));
}

TEST(GroupOptions, StructuralChangeAfterConstructionIsAnError) {
  auto p = at::ones({2}).requires_grad_();
  DistributedShampoo opt({p});
  opt.group_options(0).max_preconditioner_dim(1);
  p.mutable_grad() = at::ones({2});
  expect_error([&] { opt.step(); }, {"param group 0", "structural option"});
}

TEST(GroupOptions, InvalidFloatChangeAfterConstructionIsAnError) {
  auto p = at::ones({2}).requires_grad_();
  DistributedShampoo opt({p});
  opt.group_options(0).lr(-1.0);
  p.mutable_grad() = at::ones({2});
  expect_error([&] { opt.step(); }, {"param group 0", "lr"});
  EXPECT_TRUE(at::equal(p.detach(), at::ones({2})));
}

}  // namespace
