// memory_summary(): the optimizer's state by kind equals what the CPU tracking allocator
// (benchmarks/tracking_allocator.h) sees the optimizer keep after its steps, within 1%, packed and
// unpacked, for the Kronecker families with grafting and a β1 filter; and the kinds add up.
#include <shampoo/shampoo.h>

#include <string>
#include <vector>

#include "benchmarks/tracking_allocator.h"
#include "preconditioners/symmetric_matrices.h"
#include "shampoo/storage_test_support.h"
#include "support/test_support.h"

namespace {

using shampoo::DistributedShampoo;
using shampoo::ShampooOptions;

using Case = shampoo::testing::storage::NamedOptions;

std::vector<Case> cases() {
  const auto base = ShampooOptions::reference_defaults(0.01)
                        .betas({0.9, 0.999})
                        .epsilon(1e-8)
                        .momentum(0.5)
                        .precondition_frequency(2)
                        .max_preconditioner_dim(64)
                        .grafting(shampoo::AdamGraftingConfig{0.999, 1e-8});
  return {
      {"root_inverse_packed", base},
      {"root_inverse_dense", ShampooOptions(base).use_symmetric_packing(false)},
      {"eigendecomposed",
       ShampooOptions(base).preconditioner(shampoo::EigendecomposedShampooConfig{})},
      {"eigenvalue_corrected",
       ShampooOptions(base).preconditioner(shampoo::EigenvalueCorrectedShampooConfig{})},
  };
}

class MemorySummaryTest : public ::testing::TestWithParam<Case> {};

TEST_P(MemorySummaryTest, EqualsWhatTheTrackingAllocatorSeesWithinOnePercent) {
  const auto& c = GetParam();
  auto& tracker = shampoo::bench::TrackingAllocator::install();
  // Parameters and gradients exist before the baseline: what is live after the steps beyond it
  // is what the optimizer keeps.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(4);
  std::vector<at::Tensor> params;
  for (const auto& shape :
       std::vector<std::vector<int64_t>>{{64, 48}, {200, 64}, {96}, {3, 32, 5}}) {
    params.push_back(at::randn(shape, gen).requires_grad_());
  }
  std::vector<at::Tensor> grads;
  for (const auto& p : params) grads.push_back(at::randn(p.sizes(), gen));
  for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[i].clone();
  int64_t baseline = 0;
  shampoo::MemorySummary memory;
  int64_t kept = 0;
  {
    baseline = tracker.live();
    DistributedShampoo optimizer(params, c.options);
    for (int step = 0; step < 4; ++step) optimizer.step();  // two root computations
    kept = tracker.live() - baseline;
    memory = optimizer.memory_summary();
    EXPECT_EQ(memory.state_total(), optimizer.stats().state_bytes);
  }
  EXPECT_GE(static_cast<double>(memory.state_total()), 0.99 * static_cast<double>(kept)) << c.name;
  EXPECT_LE(static_cast<double>(memory.state_total()), 1.01 * static_cast<double>(kept)) << c.name;

  int64_t numel = 0;
  for (const auto& p : params) numel += p.numel();
  // Adam grafting, the β1 filter and momentum: one float per element each.
  EXPECT_EQ(memory.grafting, numel * 4);
  EXPECT_EQ(memory.filtered_gradient, numel * 4);
  EXPECT_EQ(memory.momentum, numel * 4);
  EXPECT_GT(memory.factors, 0);
  const bool root_inverse = c.name.rfind("root_inverse", 0) == 0;
  const bool eigendecomposed = c.name.rfind("eigendecomposed", 0) == 0;
  // Root-inverse keeps a root per factor, of the same layout; the others keep eigenvectors, and
  // eigendecomposed Shampoo also its roots X_k formed from them (dense d×d, as the eigenvectors).
  if (eigendecomposed) {
    EXPECT_GT(memory.inverse_roots, 0);
    EXPECT_LT(memory.inverse_roots, memory.eigenvectors);  // those hold the eigenvalues too
  } else {
    EXPECT_EQ(memory.inverse_roots, root_inverse ? memory.factors : 0);
  }
  EXPECT_EQ(memory.eigenvectors > 0, !root_inverse);
  EXPECT_NE(memory.to_string().find("state total"), std::string::npos);
  EXPECT_NE(memory.to_line().find("MB factors"), std::string::npos);
  // After the optimizer is gone, nothing of it is left.
  EXPECT_EQ(tracker.live(), baseline);
}

INSTANTIATE_TEST_SUITE_P(Families, MemorySummaryTest, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

// The packed factors of a d×d dim take d(d+1)/2 floats: 64×48 blocks (dims 64 and 48).
TEST(MemorySummaryPacking, FactorsArePackedTriangles) {
  auto param = at::randn({64, 48}).requires_grad_();
  DistributedShampoo packed({param}, ShampooOptions::reference_defaults().max_preconditioner_dim(64));
  DistributedShampoo dense(
      {param}, ShampooOptions::reference_defaults().max_preconditioner_dim(64).use_symmetric_packing(false));
  using shampoo::detail::packed_size;
  EXPECT_EQ(packed.memory_summary().factors, (packed_size(64) + packed_size(48)) * 4);
  EXPECT_EQ(dense.memory_summary().factors, (64 * 64 + 48 * 48) * 4);
  EXPECT_EQ(packed.memory_summary().inverse_roots, packed.memory_summary().factors);
}

}  // namespace

namespace {

// The undo journal of a distributed step that keeps one (without the agreement before the
// update, DistributedOptions::agree_before_update(false)) holds what the step can change: the
// factors and the elementwise state of the blocks it steps, and the inverse roots only at a step
// that recomputes them (root-inverse Shampoo, world 2, roots every 3 steps).
TEST(MemorySummaryJournal, HoldsTheRootsOnlyWhenTheStepRecomputesThem) {
  const auto options = ShampooOptions::reference_defaults(0.01)
                           .betas({0.9, 0.999})
                           .precondition_frequency(3)
                           .max_preconditioner_dim(16)
                           .grafting(shampoo::AdamGraftingConfig{0.999, 1e-8});
  shampoo::testing::run_ranks(2, [&](int /*rank*/, const auto& group) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(8);
    std::vector<at::Tensor> params{at::randn({16, 12}, gen).requires_grad_(),
                                   at::randn({20}, gen).requires_grad_(),
                                   at::randn({9, 16}, gen).requires_grad_()};
    DistributedShampoo opt(
        params, options,
        shampoo::DistributedOptions().process_group(group).agree_before_update(false));
    for (int step = 1; step <= 6; ++step) {
      shampoo::testing::set_random_grads(params, 40 + step);
      opt.step();
      const auto m = opt.memory_summary();
      // Every block of this rank is stepped each time: all of its state but the roots, plus
      // the roots at the steps that recompute them (3 and 6); consecutive-failure counters
      // (8 bytes per block) come on top. The β1 filter exists from the first step on, so the
      // journal of step 1 has none.
      int64_t expected = step % 3 == 0 ? m.state_total() : m.state_total() - m.inverse_roots;
      if (step == 1) expected -= m.filtered_gradient;
      EXPECT_GE(m.scratch_last_step, expected) << "step " << step;
      EXPECT_LE(m.scratch_last_step, expected + 8 * opt.stats().owned_blocks) << "step " << step;
      EXPECT_EQ(m.scratch_last_step, opt.stats().rollback_bytes_last_step);
    }
  });
}

}  // namespace
