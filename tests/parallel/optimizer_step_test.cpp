// The one lookup of what an optimizer offers a wrapper (parallel/optimizers/capabilities.h), the
// internal interfaces the public optimizers keep behind their classes
// (parallel/optimizers/internal_interfaces.h), and the one way a wrapper steps an optimizer
// (parallel/optimizers/optimizer_step.h).
#include "parallel/optimizers/optimizer_step.h"

#include <shampoo/shampoo.h>
#include <torch/optim/adam.h>

#include <utility>
#include <vector>

#include "parallel/optimizers/capabilities.h"
#include "parallel/optimizers/parameter_owners.h"
#include "parallel/optimizers/partial_step.h"
#include "parallel/optimizers/phased_backward_step.h"
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

TEST(Capabilities, EachPublicOptimizerAnswersWithItsInterfaces) {
  auto w = at::randn({6, 4}).requires_grad_();
  auto b = at::randn({4}).requires_grad_();
  DistributedShampoo shampoo({w, b}, every_step_options());
  const auto of_shampoo = capabilities_of(shampoo);
  EXPECT_NE(of_shampoo.phased, nullptr);
  EXPECT_NE(of_shampoo.partial, nullptr);
  EXPECT_NE(of_shampoo.owners, nullptr);
  EXPECT_NE(of_shampoo.portable, nullptr);
  EXPECT_NE(of_shampoo.checkpointable, nullptr);
  EXPECT_EQ(of_shampoo.scaled, nullptr);

  auto in_backward = shampoo::apply_optimizer_in_backward({w}, [](std::vector<at::Tensor> p) {
    return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(0.1));
  });
  const auto of_in_backward = capabilities_of(in_backward);
  EXPECT_EQ(of_in_backward.phased, nullptr);
  EXPECT_EQ(of_in_backward.partial, nullptr);
  ASSERT_NE(of_in_backward.owners, nullptr);
  EXPECT_NE(of_in_backward.scaled, nullptr);
  // The adapter answers as the object does: LibTorch's Adam steps on every rank.
  EXPECT_EQ(of_in_backward.owners->owner_of(w), in_backward.owner_of(w));
  EXPECT_EQ(of_in_backward.owners->owner_of(w), shampoo::ParameterOwners::kEveryRank);

  torch::optim::Adam adam({w}, torch::optim::AdamOptions(0.1));
  const auto of_adam = capabilities_of(adam);
  EXPECT_EQ(of_adam.phased, nullptr);
  EXPECT_EQ(of_adam.partial, nullptr);
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
    EXPECT_EQ(found.partial, nullptr);
    EXPECT_EQ(found.owners->owners_group().get(), group.get());
    for (const auto& p : params) EXPECT_EQ(found.owners->owner_of(p), sharded.owner_of(p));
    EXPECT_FALSE(found.owners->owner_of(at::ones({2})).has_value());
    // A pass opened and aborted through the adapter leaves the parameters as they were.
    const auto before = params[0].detach().clone();
    found.phased->set_in_backward(true);
    found.phased->begin_backward_step();
    EXPECT_TRUE(found.phased->backward_step_open());
    set_grads(params, 1.0);
    found.phased->step_parameters(params);
    found.phased->abort_backward_step();
    EXPECT_FALSE(found.phased->backward_step_open());
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
  ASSERT_NE(found.partial, nullptr);
  set_grads(params, 2.0);
  const auto before = params[0].detach().clone();
  found.partial->step_only(params);
  EXPECT_FALSE(at::equal(params[0].detach(), before));
  EXPECT_EQ(found.partial->group_step(0), 2);
  EXPECT_EQ(moved.group_step(0), 2);
  // The moved-from object answers without its internal interfaces.
  const auto empty = capabilities_of(first);
  EXPECT_EQ(empty.phased, nullptr);
  EXPECT_EQ(empty.partial, nullptr);
  EXPECT_EQ(empty.owners, nullptr);
}

TEST(OptimizerStep, APhasedOptimizerOpensOneStepPerPassThatItsUndoRecordAborts) {
  std::vector<at::Tensor> params{at::randn({6, 4}).requires_grad_(),
                                 at::randn({4}).requires_grad_()};
  DistributedShampoo shampoo(params, every_step_options());
  const auto found = capabilities_of(shampoo);
  set_grads(params, 1.0);
  shampoo.step();
  const auto first_values = params[0].detach().clone();
  const auto second_values = params[1].detach().clone();

  UndoRecord undo;
  set_grads(params, -3.0);
  shampoo::detail::step_optimizer(shampoo, found, {}, StepScope::kInPass, &undo);
  EXPECT_FALSE(found.phased->backward_step_open()) << "no parameters: nothing opened";
  shampoo::detail::step_optimizer(shampoo, found, {params[0]}, StepScope::kInPass, &undo);
  EXPECT_TRUE(found.phased->backward_step_open());
  shampoo::detail::step_optimizer(shampoo, found, {params[1]}, StepScope::kInPass, &undo);
  EXPECT_TRUE(undo.complete());
  undo.undo();
  EXPECT_FALSE(found.phased->backward_step_open());
  EXPECT_TRUE(at::equal(params[0].detach(), first_values));
  EXPECT_TRUE(at::equal(params[1].detach(), second_values));
  EXPECT_EQ(shampoo.group_step(0), 1);

  // Committed, the same pass stands and counts one step.
  shampoo::detail::step_optimizer(shampoo, found, {params[0]}, StepScope::kInPass, &undo);
  shampoo::detail::step_optimizer(shampoo, found, {params[1]}, StepScope::kInPass, &undo);
  undo.commit();
  EXPECT_FALSE(found.phased->backward_step_open());
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
  EXPECT_FALSE(of_shampoo.phased->backward_step_open()) << "a step alone is not a pass";
  EXPECT_EQ(shampoo.group_step(0), 1);
  EXPECT_TRUE(at::equal(params[1].detach(), before));
  EXPECT_FALSE(incomplete.complete());
}

}  // namespace
