// The wrappers' one undo record (parallel/optimizers/undo_record.h): what it saves is put back
// bit for bit, once per tensor and parameter, and it says when it cannot be.
#include "parallel/optimizers/undo_record.h"

#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "support/test_support.h"

namespace {

using shampoo::detail::UndoRecord;

/// `steps` Adam steps of `p` (its gradient set before each).
void adam_steps(torch::optim::Adam& adam, const at::Tensor& p, int steps) {
  for (int i = 0; i < steps; ++i) {
    p.mutable_grad() = at::full_like(p, 0.5 + i);
    adam.step();
  }
}

TEST(UndoRecord, PutsBackValuesAndLibTorchStatesBitForBit) {
  auto a = at::arange(6, at::kFloat).reshape({2, 3}).requires_grad_();
  auto b = at::ones({4}).requires_grad_();
  torch::optim::Adam adam(std::vector<at::Tensor>{a, b}, torch::optim::AdamOptions(0.1));
  adam_steps(adam, a, 1);  // a has state, b none yet
  b.mutable_grad() = at::Tensor();
  const auto a_before = a.detach().clone();
  const auto b_before = b.detach().clone();
  const auto* a_state =
      static_cast<torch::optim::AdamParamState*>(adam.state().at(a.unsafeGetTensorImpl()).get());
  const auto exp_avg_before = a_state->exp_avg().clone();

  UndoRecord record;
  record.save_values(a);
  record.save_values(b);
  record.save_states(adam, {a, b});
  a.mutable_grad() = at::full_like(a, 3.0);
  b.mutable_grad() = at::full_like(b, -2.0);
  adam.step();
  // Saved once: a second save after the step does not replace what was before it.
  record.save_values(a);
  record.save_states(adam, {a});
  ASSERT_FALSE(at::equal(a.detach(), a_before));
  ASSERT_EQ(adam.state().count(b.unsafeGetTensorImpl()), 1u);
  EXPECT_TRUE(record.complete());

  record.undo();
  EXPECT_TRUE(at::equal(a.detach(), a_before));
  EXPECT_TRUE(at::equal(b.detach(), b_before));
  const auto& restored =
      static_cast<torch::optim::AdamParamState&>(*adam.state().at(a.unsafeGetTensorImpl()));
  EXPECT_EQ(restored.step(), 1);
  EXPECT_TRUE(at::equal(restored.exp_avg(), exp_avg_before));
  EXPECT_EQ(adam.state().count(b.unsafeGetTensorImpl()), 0u) << "b had no state before";

  // Emptied: undoing again changes nothing.
  adam_steps(adam, a, 1);
  const auto a_after = a.detach().clone();
  record.undo();
  EXPECT_TRUE(at::equal(a.detach(), a_after));
}

/// An optimizer whose per-parameter state the record cannot copy (not one of LibTorch's five).
class OtherOptimizer : public torch::optim::Optimizer {
 public:
  explicit OtherOptimizer(std::vector<at::Tensor> params)
      : torch::optim::Optimizer({torch::optim::OptimizerParamGroup(std::move(params))},
                                std::make_unique<torch::optim::SGDOptions>(0.1)) {}
  at::Tensor step(LossClosure) override { return {}; }
};

TEST(UndoRecord, AnotherOptimizersStateMakesItIncomplete) {
  auto p = at::ones({3}).requires_grad_();
  OtherOptimizer other({p});
  UndoRecord record;
  record.save_states(other, {});
  EXPECT_TRUE(record.complete()) << "no parameter: nothing that cannot be undone";
  record.save_states(other, {p});
  EXPECT_FALSE(record.complete());
  record.clear();
  EXPECT_TRUE(record.complete());
}

/// Records what a wrapper asks of an optimizer that steps in phases.
class PhaseLog : public shampoo::PhasedStep {
 public:
  void set_in_backward(bool) override {}
  bool step_open() const override { return open; }
  void begin(bool /*in_pass*/) override { open = true; }
  void step_parameters(const std::vector<at::Tensor>&) override {}
  void finish() override {
    open = false;
    calls += "finish ";
  }
  void abort() override {
    open = false;
    calls += "abort ";
  }
  bool open = false;
  std::string calls;
};

TEST(UndoRecord, UndoAbortsAndCommitFinishesThePhasedStepsAdded) {
  PhaseLog first;
  PhaseLog second;
  UndoRecord record;
  first.begin(/*in_pass=*/true);
  second.begin(/*in_pass=*/true);
  record.add_phased(first);
  record.add_phased(second);
  record.undo();
  EXPECT_EQ(first.calls, "abort ");
  EXPECT_EQ(second.calls, "abort ");
  record.undo();  // emptied
  EXPECT_EQ(first.calls, "abort ");

  first.begin(/*in_pass=*/true);
  record.add_phased(first);
  record.commit();
  EXPECT_EQ(first.calls, "abort finish ");
  record.clear();
  record.commit();
  EXPECT_EQ(first.calls, "abort finish ");
}

}  // namespace
