// Failure policy (docs/math.md step 3): a failed amortized computation keeps the previous root and
// warns once; more than num_tolerated_failed_amortized_computations consecutive failures raise;
// a non-finite gradient or factor is an immediate, clear error and never reaches the parameters.
#include <c10/util/Exception.h>
#include <shampoo/shampoo.h>

#include <atomic>

#include "support/test_support.h"

namespace {

using shampoo::DistributedShampoo;
using shampoo::ShampooOptions;
using shampoo::testing::bit_equal;

/// Collects c10 warnings while alive.
class WarningCollector : public c10::WarningHandler {
 public:
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
  std::vector<std::string> messages;
};

ShampooOptions options() {
  return ShampooOptions::reference_defaults(0.05)
      .betas({0.0, 1.0})
      .epsilon(1e-6)
      .precondition_frequency(1)
      .start_preconditioning_step(1)
      .num_tolerated_failed_amortized_computations(3);
}

at::Tensor gradient(int step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  return at::randn({6, 5}, gen);
}

TEST(FailurePolicy, FailedRootsKeepThePreviousRootAndWarnOnce) {
  auto a = at::randn({6, 5}).requires_grad_();
  auto b = a.detach().clone().requires_grad_();
  DistributedShampoo failing({a}, options());
  // Reference: the roots of step 1 are never recomputed.
  DistributedShampoo frozen({b}, options().precondition_frequency(1000));
  std::atomic<bool> fail{false};
  failing.set_failure_injector_for_testing([&](const std::string& block, int64_t) {
    return fail.load() && block == "parameter 0 block 0";
  });

  WarningCollector warnings;
  c10::WarningUtils::WarningHandlerGuard guard(&warnings);
  for (int step = 1; step <= 4; ++step) {
    fail = step >= 2;  // steps 2, 3, 4 fail: three in a row is still tolerated
    a.mutable_grad() = gradient(step);
    b.mutable_grad() = gradient(step);
    failing.step();
    frozen.step();
    ASSERT_TRUE(bit_equal(a.detach(), b.detach())) << "step " << step;
  }
  EXPECT_EQ(failing.stats().failed_amortized_computations, 3);
  EXPECT_EQ(failing.stats().amortized_computations, 4);
  int shampoo_warnings = 0;
  for (const auto& m : warnings.messages) {
    if (m.find("parameter 0 block 0") != std::string::npos) {
      ++shampoo_warnings;
      EXPECT_NE(m.find("keeping its previous preconditioner"), std::string::npos) << m;
    }
  }
  EXPECT_EQ(shampoo_warnings, 1);

  // The fourth failure in a row raises, naming the block and the limit.
  a.mutable_grad() = gradient(5);
  try {
    failing.step();
    FAIL() << "expected the fourth consecutive failure to raise";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("parameter 0 block 0"), std::string::npos) << message;
    EXPECT_NE(message.find("num_tolerated_failed_amortized_computations = 3"), std::string::npos)
        << message;
  }
}

TEST(FailurePolicy, SuccessResetsTheConsecutiveCount) {
  auto p = at::randn({4, 3}).requires_grad_();
  DistributedShampoo opt({p}, options());
  int step = 0;
  // Step 1 succeeds, 2-4 fail, 5 succeeds, 6-8 fail: never more than 3 in a row.
  opt.set_failure_injector_for_testing(
      [&](const std::string&, int64_t) { return step != 1 && step != 5; });
  for (step = 1; step <= 8; ++step) {
    p.mutable_grad() = at::randn({4, 3});
    EXPECT_NO_THROW(opt.step()) << "step " << step;
  }
  EXPECT_EQ(opt.stats().failed_amortized_computations, 6);
}

TEST(FailurePolicy, NonFiniteGradientIsAnErrorAndChangesNothing) {
  auto p = at::randn({5, 4}).requires_grad_();
  auto q = at::randn({3}).requires_grad_();
  DistributedShampoo opt({p, q}, options().grafting(shampoo::AdamGraftingConfig{}));
  p.mutable_grad() = at::randn({5, 4});
  q.mutable_grad() = at::randn({3});
  opt.step();
  const auto p_before = p.detach().clone();
  const auto q_before = q.detach().clone();
  for (const double bad : {NAN, INFINITY, -INFINITY}) {
    p.mutable_grad() = at::randn({5, 4});
    q.mutable_grad() = at::randn({3});
    q.mutable_grad()[1] = bad;
    try {
      opt.step();
      FAIL() << "expected an error for a gradient holding " << bad;
    } catch (const c10::Error& e) {
      const std::string message = e.what_without_backtrace();
      EXPECT_NE(message.find("parameter 1"), std::string::npos) << message;
      EXPECT_NE(message.find("non-finite"), std::string::npos) << message;
    }
    EXPECT_TRUE(bit_equal(p.detach(), p_before));
    EXPECT_TRUE(bit_equal(q.detach(), q_before));
    EXPECT_EQ(opt.group_step(0), 1);
  }
  // The optimizer is still usable afterwards.
  q.mutable_grad() = at::randn({3});
  opt.step();
  EXPECT_EQ(opt.group_step(0), 2);
  EXPECT_TRUE(at::isfinite(p.detach()).all().item<bool>());
}

TEST(FailurePolicy, OverflowingFactorIsAClearError) {
  // One gradient whose G·Gᵀ overflows float32: refused before anything changes.
  auto p = at::randn({4, 4}).requires_grad_();
  DistributedShampoo opt({p}, options());
  p.mutable_grad() = at::full({4, 4}, 1e30);
  shampoo::testing::expect_error([&] { opt.step(); },
                                 {"gradient of parameter 0", "would overflow the optimizer state",
                                  "the step was not applied"});
}

}  // namespace
