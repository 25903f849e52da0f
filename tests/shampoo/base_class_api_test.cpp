// DistributedShampoo used through LibTorch's base class, as generic training code holds it
// (torch::optim::Optimizer&): groups and parameters added through the base class are stepped
// like those given to the constructor, an empty parameter list is accepted, state() has an entry
// per parameter, and the options compare with operator==.
#include <ATen/CPUGeneratorImpl.h>
#include <shampoo/shampoo.h>
#include <torch/optim/adam.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/serialize.h>

#include "support/test_support.h"

namespace {

using shampoo::DistributedShampoo;
using shampoo::ShampooOptions;
using shampoo::ShampooParamState;
using shampoo::testing::bit_equal;
using shampoo::testing::expect_error;
using shampoo::testing::snapshot;

ShampooOptions options(double lr = 0.05) {
  return ShampooOptions::reference_defaults(lr)
      .betas({0.9, 0.99})
      .epsilon(1e-8)
      .precondition_frequency(2)
      .max_preconditioner_dim(4)
      .grafting(shampoo::AdamGraftingConfig{0.99, 1e-8});
}

/// Fixed parameters: a weight, a bias and a second weight.
std::vector<at::Tensor> make_params() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  return {at::randn({5, 3}, gen).requires_grad_(), at::randn({5}, gen).requires_grad_(),
          at::randn({3, 6}, gen).requires_grad_()};
}

void run_steps(torch::optim::Optimizer& optimizer, const std::vector<at::Tensor>& params,
               int first, int last) {
  for (int t = first; t <= last; ++t) {
    shampoo::testing::set_random_grads(params, 300 + t);
    optimizer.step();
  }
}

/// params[0] in group 0 (lr 0.05), params[1..2] in group 1 (lr 0.02, weight decay), built the way
/// `how` says: 0 = both in the constructor, 1 = DistributedShampoo::add_param_group,
/// 2 = torch::optim::Optimizer::add_param_group through a base-class reference, 3 = an empty list
/// first, then both groups through the base class.
std::unique_ptr<DistributedShampoo> build(const std::vector<at::Tensor>& p, int how) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{p[0]});
  auto second = torch::optim::OptimizerParamGroup(
      {p[1], p[2]}, std::make_unique<ShampooOptions>(options(0.02).weight_decay(1e-3)));
  if (how == 0) {
    groups.push_back(second);
    return std::make_unique<DistributedShampoo>(groups, options());
  }
  if (how == 3) {
    auto opt = std::make_unique<DistributedShampoo>(std::vector<at::Tensor>{}, options());
    auto& base = static_cast<torch::optim::Optimizer&>(*opt);
    // LibTorch's empty list is one group without parameters; it stays, as in LibTorch.
    base.add_param_group(torch::optim::OptimizerParamGroup({p[0]}));
    base.add_param_group(second);
    return opt;
  }
  auto opt = std::make_unique<DistributedShampoo>(groups, options());
  if (how == 1) opt->add_param_group(second);
  if (how == 2) static_cast<torch::optim::Optimizer&>(*opt).add_param_group(second);
  return opt;
}

TEST(BaseClassAddParamGroup, StepsLikeTheConstructorsGroupsBitForBit) {
  const auto reference_params = make_params();
  auto reference = build(reference_params, 0);
  run_steps(*reference, reference_params, 1, 5);
  for (const int how : {1, 2}) {
    const auto params = make_params();
    auto opt = build(params, how);
    run_steps(*opt, params, 1, 5);
    EXPECT_TRUE(bit_equal(snapshot(params), snapshot(reference_params))) << "how " << how;
    EXPECT_EQ(opt->param_groups().size(), 2u);
    EXPECT_EQ(opt->group_step(1), 5);
    // Groups that differ only in float options share a virtual group, however they came.
    EXPECT_EQ(opt->stats().virtual_groups, 1) << "how " << how;
    EXPECT_EQ(opt->stats().total_blocks, reference->stats().total_blocks);
  }
}

TEST(BaseClassAddParamGroup, GroupAddedAfterStepsJoinsLikeDistributedShampoosOwn) {
  // Added between steps: through the base class ≡ through DistributedShampoo::add_param_group.
  std::vector<std::vector<at::Tensor>> results;
  for (const bool through_base : {false, true}) {
    const auto params = make_params();
    DistributedShampoo opt({params[0]}, options());
    run_steps(opt, {params[0]}, 1, 3);
    torch::optim::OptimizerParamGroup late({params[1], params[2]},
                                           std::make_unique<ShampooOptions>(options(0.01)));
    if (through_base) {
      static_cast<torch::optim::Optimizer&>(opt).add_param_group(late);
    } else {
      opt.add_param_group(late);
    }
    run_steps(opt, params, 4, 7);
    EXPECT_EQ(opt.group_step(0), 7);
    EXPECT_EQ(opt.group_step(1), 4);
    results.push_back(snapshot(params));
  }
  EXPECT_TRUE(bit_equal(results[1], results[0]));
}

TEST(BaseClassAddParamGroup, AddParametersGoesIntoGroupZeroAsLibTorchDoes) {
  const auto reference_params = make_params();
  DistributedShampoo reference(reference_params, options());
  run_steps(reference, reference_params, 1, 4);
  const auto params = make_params();
  DistributedShampoo opt({params[0]}, options());
  static_cast<torch::optim::Optimizer&>(opt).add_parameters({params[1], params[2]});
  run_steps(opt, params, 1, 4);
  ASSERT_EQ(opt.param_groups().size(), 1u);
  EXPECT_EQ(opt.param_groups()[0].params().size(), 3u);
  EXPECT_TRUE(bit_equal(snapshot(params), snapshot(reference_params)));
}

TEST(EmptyParameterList, IsAcceptedAndAddedGroupsTrainLikeTheConstructors) {
  const auto reference_params = make_params();
  auto reference = build(reference_params, 0);
  run_steps(*reference, reference_params, 1, 4);
  const auto params = make_params();
  auto opt = build(params, 3);
  ASSERT_EQ(opt->param_groups().size(), 3u);  // the empty group, then the two added
  run_steps(*opt, params, 1, 4);
  EXPECT_TRUE(bit_equal(snapshot(params), snapshot(reference_params)));
}

TEST(EmptyParameterList, StepWithoutParametersIsAClearError) {
  DistributedShampoo opt(std::vector<at::Tensor>{}, options());
  expect_error([&] { opt.step(); }, {"no parameters", "empty parameter list", "add_param_group"});
  std::vector<torch::optim::OptimizerParamGroup> none;
  DistributedShampoo no_groups(none, options());
  EXPECT_EQ(no_groups.param_groups().size(), 0u);
  expect_error([&] { no_groups.step(); }, {"no parameters"});
}

TEST(BaseClassAddParamGroup, AnotherOptimizersOptionsAreAClearErrorAtEveryStep) {
  const auto params = make_params();
  DistributedShampoo opt({params[0]}, options());
  static_cast<torch::optim::Optimizer&>(opt).add_param_group(torch::optim::OptimizerParamGroup(
      {params[1]}, std::make_unique<torch::optim::AdamOptions>(1e-3)));
  shampoo::testing::set_random_grads(params, 1);
  const auto before = snapshot(params);
  for (int attempt = 0; attempt < 2; ++attempt) {
    expect_error([&] { opt.step(); },
                 {"param group 1", "shampoo::ShampooOptions", "another optimizer's options"});
  }
  EXPECT_TRUE(bit_equal(snapshot(params), before)) << "nothing was stepped";
}

TEST(ParamState, EveryParameterHasAnEntryWithItsStepCount) {
  const auto params = make_params();
  DistributedShampoo opt({params[0], params[1]}, options());
  auto& base = static_cast<torch::optim::Optimizer&>(opt);
  ASSERT_EQ(base.state().size(), 2u);
  const auto step_of = [&](const at::Tensor& p) {
    const auto it = base.state().find(p.unsafeGetTensorImpl());
    EXPECT_NE(it, base.state().end());
    if (it == base.state().end()) return int64_t{-1};
    return dynamic_cast<const ShampooParamState&>(*it->second).step();
  };
  EXPECT_EQ(step_of(params[0]), 0);
  run_steps(opt, {params[0], params[1]}, 1, 3);
  EXPECT_EQ(step_of(params[0]), 3);
  EXPECT_EQ(step_of(params[1]), 3);
  const auto& entry =
      dynamic_cast<const ShampooParamState&>(*base.state().at(params[0].unsafeGetTensorImpl()));
  EXPECT_EQ(entry.param_group(), 0);
  EXPECT_EQ(entry.num_blocks(), 2);  // 5x3 with max_preconditioner_dim 4: blocks 4x3 and 1x3
  // A group added later: its own count, from 0.
  base.add_param_group(torch::optim::OptimizerParamGroup({params[2]}));
  run_steps(opt, params, 4, 5);
  EXPECT_EQ(base.state().size(), 3u);
  EXPECT_EQ(step_of(params[0]), 5);
  EXPECT_EQ(step_of(params[2]), 2);
  // Loaded into a fresh optimizer: the entries follow the loaded counts.
  const auto path = shampoo::testing::temp_path("param_state.pt");
  torch::save(opt, path);
  DistributedShampoo loaded({params[0], params[1]}, options());
  loaded.add_param_group(torch::optim::OptimizerParamGroup({params[2]}));
  auto& loaded_base = static_cast<torch::optim::Optimizer&>(loaded);
  EXPECT_EQ(dynamic_cast<const ShampooParamState&>(
                *loaded_base.state().at(params[0].unsafeGetTensorImpl()))
                .step(),
            0);
  torch::load(loaded, path);
  std::remove(path.c_str());
  for (const auto& p : params) {
    const auto& a = dynamic_cast<const ShampooParamState&>(*base.state().at(p.unsafeGetTensorImpl()));
    const auto& b =
        dynamic_cast<const ShampooParamState&>(*loaded_base.state().at(p.unsafeGetTensorImpl()));
    EXPECT_EQ(a, b);
  }
}

TEST(ParamState, AParameterAlreadyRegisteredIsRefusedByTheBaseClass) {
  // LibTorch's add_param_group refuses a parameter that has a state entry: with an entry per
  // parameter, adding one twice through the base class is caught there, before any step.
  const auto params = make_params();
  DistributedShampoo opt({params[0]}, options());
  expect_error(
      [&] {
        static_cast<torch::optim::Optimizer&>(opt).add_param_group(
            torch::optim::OptimizerParamGroup({params[0]}));
      },
      {"more than one parameter group"});
}

TEST(OptionsEquality, EqualWhenEveryFieldIsAndAfterARoundTrip) {
  const auto a = options().momentum(0.5).preconditioner(shampoo::EigenvalueCorrectedShampooConfig{});
  EXPECT_EQ(a, a);
  EXPECT_EQ(a, ShampooOptions(a));
  EXPECT_EQ(a, shampoo::testing::options_round_trip(a));
  EXPECT_FALSE(a == ShampooOptions(a).lr(0.5));
  EXPECT_FALSE(a == ShampooOptions(a).betas({0.95, 0.99}));
  EXPECT_FALSE(a == ShampooOptions(a).grafting(shampoo::SGDGraftingConfig{}));
  EXPECT_FALSE(a == ShampooOptions(a).grafting(shampoo::AdamGraftingConfig{0.999, 1e-8}));
  EXPECT_FALSE(a == ShampooOptions(a).preconditioner(shampoo::RootInvShampooConfig{}));
  EXPECT_FALSE(a == ShampooOptions(a).precondition_frequency(3));
  EXPECT_FALSE(a == ShampooOptions(a).inverse_exponent_override({{2, {{0, 0.0}}}}));
  EXPECT_EQ(ShampooOptions::reference_defaults().weight_decay(0.0), ShampooOptions::reference_defaults().weight_decay(-0.0));
}

TEST(OptionsEquality, OptionsCompareAfterALoadAsLibTorchsDo) {
  const auto params = make_params();
  DistributedShampoo opt(params, options());
  run_steps(opt, params, 1, 2);
  opt.param_groups()[0].options().set_lr(0.125);
  const auto path = shampoo::testing::temp_path("options_equal.pt");
  torch::save(opt, path);
  DistributedShampoo loaded(params, options());
  EXPECT_FALSE(loaded.group_options(0) == opt.group_options(0));
  torch::load(loaded, path);
  std::remove(path.c_str());
  EXPECT_EQ(loaded.group_options(0), opt.group_options(0));
}

TEST(OptionsEquality, EveryOptionsTypeUsersHoldCompares) {
  EXPECT_EQ(shampoo::DistributedOptions(), shampoo::DistributedOptions());
  EXPECT_FALSE(shampoo::DistributedOptions() ==
               shampoo::DistributedOptions().merge_param_groups(false));
  EXPECT_EQ(shampoo::FullyShardedOptions(), shampoo::FullyShardedOptions());
  EXPECT_FALSE(shampoo::FullyShardedOptions() ==
               shampoo::FullyShardedOptions().overlap_step(false));
  EXPECT_EQ(shampoo::GradScalerOptions(), shampoo::GradScalerOptions());
  EXPECT_FALSE(shampoo::GradScalerOptions() == shampoo::GradScalerOptions().init_scale(8.0));
  EXPECT_EQ(shampoo::GradientSynchronizerOptions(), shampoo::GradientSynchronizerOptions());
  EXPECT_FALSE(shampoo::GradientSynchronizerOptions() ==
               shampoo::GradientSynchronizerOptions().bucket_cap_bytes(1));
}

TEST(BaseClassAddParamGroup, SchedulersActOnGroupsAddedThroughTheBaseClass) {
  const auto params = make_params();
  DistributedShampoo opt({params[0]}, options(0.1));
  auto& base = static_cast<torch::optim::Optimizer&>(opt);
  base.add_param_group(torch::optim::OptimizerParamGroup(
      {params[1]}, std::make_unique<ShampooOptions>(options(0.2))));
  torch::optim::StepLR scheduler(base, /*step_size=*/1, /*gamma=*/0.5);
  for (int t = 1; t <= 2; ++t) {  // LibTorch's StepLR leaves the first call's rates as they are
    run_steps(opt, {params[0], params[1]}, t, t);
    scheduler.step();
  }
  EXPECT_DOUBLE_EQ(opt.group_options(0).lr(), 0.05);
  EXPECT_DOUBLE_EQ(opt.group_options(1).lr(), 0.1);
}

}  // namespace
