// detail::BackwardPass: one pass per backward, ended by autograd's end callback, and the
// gradient accumulation that in-backward and full sharding count with it.
#include "parallel/data_parallel/backward_pass.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/variable.h>

#include <vector>

namespace {

using shampoo::detail::BackwardPass;

/// Two leaves whose gradient hooks open `pass` (the second in the same backward finds it open);
/// what each opening answered and whether the pass stepped are recorded.
struct Model {
  at::Tensor a = at::randn({3}).requires_grad_();
  at::Tensor b = at::randn({3}).requires_grad_();
  BackwardPass pass;
  bool may_step = true;
  std::vector<bool> opened;
  std::vector<bool> stepping;  // per backward, seen at its end

  Model() {
    for (auto* leaf : {&a, &b}) {
      leaf->register_hook([this](const at::Tensor& grad) {
        const auto at_end = [this] {
          stepping.push_back(pass.stepping());
          pass.end();
        };
        opened.push_back(pass.open(at_end, may_step));
        return grad;
      });
    }
  }
  void backward() { (a * b).sum().backward(); }
};

TEST(BackwardPass, EveryKthPassStepsAndEachBackwardIsOnePass) {
  Model m;
  m.pass.set_accumulation_steps(2);
  for (int i = 0; i < 4; ++i) m.backward();
  EXPECT_EQ(m.opened, (std::vector<bool>{true, false, true, false, true, false, true, false}));
  EXPECT_EQ(m.stepping, (std::vector<bool>{false, true, false, true}));
  EXPECT_EQ(m.pass.passes(), 4);
  EXPECT_EQ(m.pass.passes_since_step(), 4) << "never restarted: every k-th pass steps";
  EXPECT_FALSE(m.pass.is_open());
  EXPECT_FALSE(m.pass.stepping()) << "between passes";
}

TEST(BackwardPass, AStepRestartsTheCountAndAPassThatMayNotStepDoesNot) {
  Model m;
  m.pass.set_accumulation_steps(2);
  m.backward();
  m.pass.stepped();  // a step after the first pass (full sharding's step() decides when)
  m.backward();
  m.may_step = false;  // the second since the step, but told not to step (no_step)
  EXPECT_TRUE(m.pass.next_steps());
  m.backward();
  EXPECT_EQ(m.stepping, (std::vector<bool>{false, false, false}));
  EXPECT_EQ(m.pass.passes(), 3);
  EXPECT_EQ(m.pass.passes_since_step(), 2);
  // A checkpoint's counts, and a pass closed without counting.
  m.pass.restore(7, 1);
  m.may_step = true;
  m.backward();
  EXPECT_EQ(m.stepping.back(), true);
  EXPECT_EQ(m.pass.passes(), 8);
  m.pass.close();
  EXPECT_EQ(m.pass.passes(), 8);
}

}  // namespace
