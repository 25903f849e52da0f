// The one lookup of what an optimizer offers a wrapper (parallel/optimizers/capabilities.h), the
// internal interfaces the public optimizers keep behind their classes
// (parallel/optimizers/internal_interfaces.h), and the one way a wrapper steps an optimizer
// (parallel/optimizers/optimizer_step.h).
#include "parallel/optimizers/optimizer_step.h"

#include <shampoo/shampoo.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <functional>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "parallel/optimizers/block_states.h"
#include "parallel/optimizers/capabilities.h"
#include "parallel/optimizers/local_optimizer.h"
#include "parallel/optimizers/options_push.h"
#include "parallel/optimizers/parameter_owners.h"
#include "parallel/optimizers/phased_step.h"
#include "parallel/optimizers/undo_record.h"
#include "support/test_support.h"

namespace {

using shampoo::DistributedShampoo;
using shampoo::ShampooOptions;
using shampoo::detail::capabilities_of;
using shampoo::detail::StepScope;
using shampoo::detail::UndoRecord;

ShampooOptions every_step_options() {
  return ShampooOptions::reference_defaults(0.1)
      .start_preconditioning_step(1)
      .precondition_frequency(1);
}

void set_grads(const std::vector<at::Tensor>& params, double scale) {
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].mutable_grad() = at::full_like(params[i], scale * static_cast<double>(i + 1));
  }
}

/// A weight and a bias, with a Shampoo over them that took one step.
struct OneStepTaken {
  std::vector<at::Tensor> params{at::randn({6, 4}).requires_grad_(),
                                 at::randn({4}).requires_grad_()};
  DistributedShampoo shampoo{params, every_step_options()};
  OneStepTaken() {
    set_grads(params, 1.0);
    shampoo.step();
  }
};

TEST(Capabilities, EachPublicOptimizerAnswersWithItsInterfaces) {
  auto w = at::randn({6, 4}).requires_grad_();
  auto b = at::randn({4}).requires_grad_();
  DistributedShampoo shampoo({w, b}, every_step_options());
  const auto of_shampoo = capabilities_of(shampoo);
  EXPECT_NE(of_shampoo.phased, nullptr);
  EXPECT_NE(of_shampoo.blocks, nullptr);
  EXPECT_NE(of_shampoo.owners, nullptr);
  EXPECT_NE(of_shampoo.portable, nullptr);
  EXPECT_NE(of_shampoo.checkpointable, nullptr);
  EXPECT_EQ(of_shampoo.scaled, nullptr);

  auto in_backward = shampoo::apply_optimizer_in_backward({w}, [](std::vector<at::Tensor> p) {
    return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(0.1));
  });
  const auto of_in_backward = capabilities_of(in_backward);
  EXPECT_EQ(of_in_backward.phased, nullptr);
  EXPECT_EQ(of_in_backward.blocks, nullptr);
  ASSERT_NE(of_in_backward.owners, nullptr);
  EXPECT_NE(of_in_backward.scaled, nullptr);
  // The adapter answers as the object does: LibTorch's Adam steps on every rank.
  EXPECT_EQ(of_in_backward.owners->owner_of(w), in_backward.owner_of(w));
  EXPECT_EQ(of_in_backward.owners->owner_of(w), shampoo::ParameterOwners::kEveryRank);

  torch::optim::Adam adam({w}, torch::optim::AdamOptions(0.1));
  const auto of_adam = capabilities_of(adam);
  EXPECT_EQ(of_adam.phased, nullptr);
  EXPECT_EQ(of_adam.blocks, nullptr);
  EXPECT_EQ(of_adam.owners, nullptr);
  EXPECT_EQ(of_adam.scaled, nullptr);
  EXPECT_EQ(of_adam.portable, nullptr);
  EXPECT_EQ(of_adam.checkpointable, nullptr);
}

TEST(Capabilities, ShardedOptimizersAdaptersForwardToIt) {
  shampoo::testing::run_ranks(2, [](int rank, const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
    std::vector<at::Tensor> params{at::randn({8, 3}).requires_grad_(),
                                   at::randn({5}).requires_grad_()};
    shampoo::ShardedOptimizer sharded(
        params,
        shampoo::group_optimizer_factory<torch::optim::Adam>(torch::optim::AdamOptions(0.1)),
        group);
    const auto found = capabilities_of(sharded);
    ASSERT_NE(found.phased, nullptr);
    ASSERT_NE(found.owners, nullptr);
    EXPECT_EQ(found.blocks, nullptr);
    EXPECT_EQ(found.owners->owners_group().get(), group.get());
    for (const auto& p : params) EXPECT_EQ(found.owners->owner_of(p), sharded.owner_of(p));
    EXPECT_FALSE(found.owners->owner_of(at::ones({2})).has_value());
    // A pass opened and aborted through the adapter leaves the parameters as they were.
    const auto before = params[0].detach().clone();
    found.phased->set_in_backward(true);
    found.phased->begin(/*in_pass=*/true);
    EXPECT_TRUE(found.phased->step_open());
    set_grads(params, 1.0);
    found.phased->step_parameters(params);
    found.phased->abort();
    EXPECT_FALSE(found.phased->step_open());
    EXPECT_TRUE(at::equal(params[0].detach(), before)) << "rank " << rank;
    found.phased->set_in_backward(false);
  });
}

TEST(Capabilities, AdaptersFollowAMovedOptimizer) {
  std::vector<at::Tensor> params{at::randn({6, 4}).requires_grad_()};
  DistributedShampoo first(params, every_step_options());
  set_grads(params, 1.0);
  first.step();
  DistributedShampoo moved(std::move(first));
  const auto found = capabilities_of(moved);
  ASSERT_NE(found.blocks, nullptr);
  set_grads(params, 2.0);
  const auto before = params[0].detach().clone();
  shampoo::detail::step_optimizer(moved, found, params, StepScope::kAlone, nullptr);
  EXPECT_FALSE(at::equal(params[0].detach(), before));
  EXPECT_EQ(found.blocks->group_step(0), 2);
  EXPECT_EQ(moved.group_step(0), 2);
  // Its internal objects (the phased step, the checkpoint and block states) follow it too.
  EXPECT_FALSE(found.phased->step_open());
  EXPECT_FALSE(found.blocks->in_eval_mode());
  EXPECT_EQ(moved.portable_param_step(params[0]), 2);
  EXPECT_EQ(moved.checkpoint_kind(), "DistributedShampoo");
  DistributedShampoo assigned(std::vector<at::Tensor>{at::zeros({2}, at::requires_grad())});
  assigned = std::move(moved);
  EXPECT_EQ(assigned.portable_param_step(params[0]), 2);
  EXPECT_EQ(capabilities_of(assigned).blocks->group_step(0), 2);
  // The moved-from object answers without its internal interfaces.
  const auto empty = capabilities_of(first);
  EXPECT_EQ(empty.phased, nullptr);
  EXPECT_EQ(empty.blocks, nullptr);
  EXPECT_EQ(empty.owners, nullptr);
}

TEST(OptimizerStep, APhasedOptimizerOpensOneStepPerPassThatItsUndoRecordAborts) {
  OneStepTaken run;
  auto& params = run.params;
  auto& shampoo = run.shampoo;
  const auto found = capabilities_of(shampoo);
  const auto first_values = params[0].detach().clone();
  const auto second_values = params[1].detach().clone();

  UndoRecord undo;
  set_grads(params, -3.0);
  shampoo::detail::step_optimizer(shampoo, found, {}, StepScope::kInPass, &undo);
  EXPECT_FALSE(found.phased->step_open()) << "no parameters: nothing opened";
  shampoo::detail::step_optimizer(shampoo, found, {params[0]}, StepScope::kInPass, &undo);
  EXPECT_TRUE(found.phased->step_open());
  shampoo::detail::step_optimizer(shampoo, found, {params[1]}, StepScope::kInPass, &undo);
  EXPECT_TRUE(undo.complete());
  undo.undo();
  EXPECT_FALSE(found.phased->step_open());
  EXPECT_TRUE(at::equal(params[0].detach(), first_values));
  EXPECT_TRUE(at::equal(params[1].detach(), second_values));
  EXPECT_EQ(shampoo.group_step(0), 1);

  // Committed, the same pass stands and counts one step.
  shampoo::detail::step_optimizer(shampoo, found, {params[0]}, StepScope::kInPass, &undo);
  shampoo::detail::step_optimizer(shampoo, found, {params[1]}, StepScope::kInPass, &undo);
  undo.commit();
  EXPECT_FALSE(found.phased->step_open());
  EXPECT_FALSE(at::equal(params[0].detach(), first_values));
  EXPECT_EQ(shampoo.group_step(0), 2);
}

TEST(OptimizerStep, OutsideAPassItStepsTheGivenParametersAlone) {
  std::vector<at::Tensor> params{at::randn({3, 2}).requires_grad_(),
                                 at::randn({5}).requires_grad_()};
  torch::optim::Adam adam(params, torch::optim::AdamOptions(0.1));
  const auto found = capabilities_of(adam);
  set_grads(params, 1.0);
  const auto untouched = params[1].detach().clone();
  UndoRecord undo;
  shampoo::detail::step_optimizer(adam, found, {params[0]}, StepScope::kInPass, &undo);
  EXPECT_TRUE(at::equal(params[1].detach(), untouched)) << "a parameter not given moved";
  EXPECT_EQ(adam.state().count(params[1].unsafeGetTensorImpl()), 0u);
  ASSERT_EQ(adam.state().count(params[0].unsafeGetTensorImpl()), 1u);
  EXPECT_TRUE(params[1].grad().defined()) << "its gradient is put back";
  EXPECT_TRUE(undo.complete());
  undo.undo();  // LibTorch's state before the step: none
  EXPECT_EQ(adam.state().count(params[0].unsafeGetTensorImpl()), 0u);

  // DistributedShampoo stepped alone, with an undo record: the record cannot copy its state.
  DistributedShampoo shampoo(params, every_step_options());
  const auto of_shampoo = capabilities_of(shampoo);
  UndoRecord incomplete;
  const auto before = params[1].detach().clone();
  shampoo::detail::step_optimizer(shampoo, of_shampoo, {params[0]}, StepScope::kAlone, &incomplete);
  EXPECT_FALSE(of_shampoo.phased->step_open()) << "a step alone is not a pass";
  EXPECT_EQ(shampoo.group_step(0), 1);
  EXPECT_TRUE(at::equal(params[1].detach(), before));
  EXPECT_FALSE(incomplete.complete());
}

TEST(OptimizerStep, AStepAloneThatFailsChangesNothingAndClosesItsStep) {
  OneStepTaken run;
  auto& params = run.params;
  auto& shampoo = run.shampoo;
  const auto found = capabilities_of(shampoo);
  const auto before = params[0].detach().clone();
  set_grads(params, 2.0);
  // A parameter the optimizer does not hold: the error names it, after the step has begun.
  const auto stranger = at::randn({2}).requires_grad_();
  stranger.mutable_grad() = at::ones({2});
  shampoo::testing::expect_error(
      [&] {
        shampoo::detail::step_optimizer(shampoo, found, {params[0], stranger}, StepScope::kAlone,
                                        nullptr);
      },
      {"step_parameters", "not registered with this optimizer"});
  EXPECT_FALSE(found.phased->step_open()) << "the failed step was left open";
  EXPECT_TRUE(at::equal(params[0].detach(), before));
  EXPECT_EQ(shampoo.group_step(0), 1);
  // A non-finite gradient: the engine undoes its own step.
  params[0].mutable_grad().fill_(std::numeric_limits<double>::quiet_NaN());
  EXPECT_ANY_THROW(
      shampoo::detail::step_optimizer(shampoo, found, {params[0]}, StepScope::kAlone, nullptr));
  EXPECT_FALSE(found.phased->step_open());
  EXPECT_TRUE(at::equal(params[0].detach(), before));
  EXPECT_EQ(shampoo.group_step(0), 1);
  // Then it steps again.
  set_grads(params, 2.0);
  shampoo::detail::step_optimizer(shampoo, found, {params[0]}, StepScope::kAlone, nullptr);
  EXPECT_EQ(shampoo.group_step(0), 2);
  EXPECT_FALSE(at::equal(params[0].detach(), before));
}

TEST(OptimizerStep, AStepAloneOfAnOptimizerInBackwardIsAnError) {
  std::vector<at::Tensor> params{at::randn({6, 4}).requires_grad_()};
  DistributedShampoo shampoo(params, every_step_options());
  const auto found = capabilities_of(shampoo);
  set_grads(params, 1.0);
  found.phased->set_in_backward(true);
  shampoo::testing::expect_error(
      [&] { shampoo::detail::step_optimizer(shampoo, found, params, StepScope::kAlone, nullptr); },
      {"outside a pass", "runs in backward"});
  EXPECT_FALSE(found.phased->step_open());
  found.phased->set_in_backward(false);
  EXPECT_EQ(shampoo.group_step(0), 0);
}

// ----- LocalOptimizer: the optimizer a wrapper runs on one rank, in the user's groups -----

TEST(LocalOptimizer, IsMadeAtItsFirstParameterWithTheGroupsBeforeItEmpty) {
  shampoo::detail::LocalOptimizer local(
      shampoo::group_optimizer_factory<torch::optim::Adam>(torch::optim::AdamOptions(1e-3)),
      "Wrapper: ");
  std::vector<torch::optim::AdamOptions> user{torch::optim::AdamOptions(0.1),
                                              torch::optim::AdamOptions(0.2),
                                              torch::optim::AdamOptions(0.3)};
  const auto options_of = [&](size_t g) -> const torch::optim::OptimizerOptions& {
    return user.at(g);
  };
  local.add(0, {}, options_of);
  EXPECT_EQ(local.get(), nullptr) << "made without a parameter";
  const auto weight = at::randn({3, 2}).requires_grad_();
  local.add(2, {weight}, options_of);
  ASSERT_NE(local.get(), nullptr);
  const auto& groups = local.get()->param_groups();
  ASSERT_EQ(groups.size(), 3u);
  for (size_t g = 0; g < 3; ++g) {
    EXPECT_EQ(groups[g].params().size(), g == 2 ? 1u : 0u) << "group " << g;
    EXPECT_DOUBLE_EQ(groups[g].options().get_lr(), 0.1 * static_cast<double>(g + 1))
        << "group " << g;
  }
  const auto bias = at::randn({2}).requires_grad_();
  local.add(0, {bias}, options_of);
  EXPECT_EQ(groups[0].params().size(), 1u);
  // The one options push: a copy, of the optimizer's type.
  user[1].lr(0.5);
  local.set_options(1, user[1]);
  user[1].lr(0.7);
  EXPECT_DOUBLE_EQ(groups[1].options().get_lr(), 0.5);
  shampoo::testing::expect_error([&] { local.set_options(1, torch::optim::SGDOptions(0.1)); },
                                 {"Wrapper: param group 1", "SGDOptions", "AdamOptions"});
  EXPECT_DOUBLE_EQ(groups[1].options().get_lr(), 0.5) << "a refused push changed the options";
  local.set_options(7, user[0]);  // a group it lacks: nothing
  EXPECT_EQ(groups.size(), 3u);
}

TEST(LocalOptimizer, StepsTheGivenParametersAndRefusesANullFactory) {
  const auto weight = at::randn({3, 2}).requires_grad_();
  const auto bias = at::randn({2}).requires_grad_();
  shampoo::detail::LocalOptimizer local(
      shampoo::group_optimizer_factory<torch::optim::SGD>(torch::optim::SGDOptions(0.1)),
      "Wrapper: ");
  local.make(torch::optim::OptimizerParamGroup({weight, bias}));
  set_grads({weight, bias}, 1.0);
  const auto weight_before = weight.detach().clone();
  const auto bias_before = bias.detach().clone();
  local.step({weight}, StepScope::kAlone, nullptr);
  EXPECT_TRUE(at::allclose(weight.detach(), weight_before - 0.1));
  EXPECT_TRUE(at::equal(bias.detach(), bias_before)) << "a parameter not given moved";

  shampoo::detail::LocalOptimizer null_factory(
      [](torch::optim::OptimizerParamGroup) -> std::unique_ptr<torch::optim::Optimizer> {
        return nullptr;
      },
      "Wrapper: ");
  shampoo::testing::expect_error(
      [&] { null_factory.make(torch::optim::OptimizerParamGroup({weight})); },
      {"Wrapper: ", "factory returned null"});
  EXPECT_EQ(null_factory.get(), nullptr);
}

/// Options of a type the library does not know (a user's optimizer): the push compares them by
/// their serialized bytes.
struct PlainOptions : torch::optim::OptimizerCloneableOptions<PlainOptions> {
  explicit PlainOptions(double lr) : lr_(lr) {}
  TORCH_ARG(double, lr);
  TORCH_ARG(double, decay) = 0.0;

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  void serialize(torch::serialize::OutputArchive& archive) const override {
    archive.write("lr", c10::IValue(lr()));
    archive.write("decay", c10::IValue(decay()));
  }
  void serialize(torch::serialize::InputArchive& archive) override {
    c10::IValue value;
    archive.read("lr", value);
    lr(value.toDouble());
    archive.read("decay", value);
    decay(value.toDouble());
  }
};

class PlainOptimizer : public torch::optim::Optimizer {
 public:
  PlainOptimizer(torch::optim::OptimizerParamGroup group, const PlainOptions& defaults)
      : Optimizer({std::move(group)}, std::make_unique<PlainOptions>(defaults)) {}
  torch::Tensor step(LossClosure /*closure*/) override { return {}; }
};

/// One options type's push: an option set on the driven optimizer stays while the user's group
/// is unchanged, and the user's options are copied when any of them changed (not only the lr).
void expect_push_notices_changes(
    const shampoo::GroupOptimizerFactory& factory, const torch::optim::OptimizerOptions& base,
    const std::function<double&(torch::optim::OptimizerOptions&)>& other) {
  const auto param = at::randn({4, 3}).requires_grad_();
  shampoo::detail::LocalOptimizer local(factory, "Test: ");
  local.make(torch::optim::OptimizerParamGroup({param}, base.clone()));
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{param}, base.clone());
  shampoo::detail::OptionsPush push("Test: ", "param_groups()", "local_optimizer()");
  push.add_group(groups[0].options());
  auto& driven = local.get()->param_groups()[0].options();
  auto& user = groups[0].options();
  other(driven) = 0.25;
  push.push(groups, {&local});
  EXPECT_EQ(other(driven), 0.25) << "the user's options did not change: nothing copied";
  other(user) = 0.5;
  push.push(groups, {&local});
  EXPECT_EQ(other(local.get()->param_groups()[0].options()), 0.5) << "changed: copied";
  other(local.get()->param_groups()[0].options()) = 0.125;
  push.push(groups, {&local});
  EXPECT_EQ(other(local.get()->param_groups()[0].options()), 0.125);
  user.set_lr(user.get_lr() * 2);
  push.push(groups, {&local});
  EXPECT_EQ(local.get()->param_groups()[0].options().get_lr(), user.get_lr());
  EXPECT_EQ(other(local.get()->param_groups()[0].options()), 0.5);
}

TEST(OptionsPush, NoticesAChangeOfAnyOptionOfLibTorchsShampoosAndOtherTypes) {
  {
    SCOPED_TRACE("torch::optim::Adam");
    expect_push_notices_changes(
        shampoo::group_optimizer_factory<torch::optim::Adam>(torch::optim::AdamOptions(0.1)),
        torch::optim::AdamOptions(0.1), [](torch::optim::OptimizerOptions& o) -> double& {
          auto& adam = static_cast<torch::optim::AdamOptions&>(o);
          return adam.weight_decay();
        });
  }
  {
    SCOPED_TRACE("DistributedShampoo");
    expect_push_notices_changes(
        shampoo::group_optimizer_factory<DistributedShampoo>(ShampooOptions(0.1)),
        ShampooOptions(0.1), [](torch::optim::OptimizerOptions& o) -> double& {
          return static_cast<ShampooOptions&>(o).weight_decay();
        });
  }
  {
    SCOPED_TRACE("a user's options type");
    expect_push_notices_changes(
        [](torch::optim::OptimizerParamGroup group) -> std::unique_ptr<torch::optim::Optimizer> {
          return std::make_unique<PlainOptimizer>(std::move(group), PlainOptions(0.1));
        },
        PlainOptions(0.1),
        [](torch::optim::OptimizerOptions& o) -> double& {
          return static_cast<PlainOptions&>(o).decay();
        });
  }
}

}  // namespace
