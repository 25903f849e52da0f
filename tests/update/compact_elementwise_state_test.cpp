// The compact elementwise state (update/elementwise_state.h): stochastic rounding to bfloat16 is
// unbiased, lands on one of the two neighbours, and is deterministic in its key; a compact
// ElementwiseState binds float copies, keeps its bfloat16 rows until commit(), and exports the
// blocks' dtype.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>

#include "support/test_support.h"
#include "update/elementwise_state.h"

namespace {

using shampoo::detail::ChainBlockTensors;
using shampoo::detail::ElementwiseState;
using shampoo::detail::GraftingKind;
using shampoo::detail::round_bfloat16_stochastic;
using shampoo::detail::StackSpec;
using shampoo::testing::bit_equal;

TEST(StochasticRounding, UnbiasedOnANeighbourAndDeterministic) {
  // 1 + 3/8 of the way from 1 to the next bfloat16 (1 + 2^-7), a million times, both signs.
  const float step = 1.0f / 128.0f;
  for (const float sign : {1.0f, -1.0f}) {
    const float x = sign * (1.0f + 0.375f * step);
    const auto values = at::full({1 << 20}, x);
    const auto rounded = round_bfloat16_stochastic(values, 17).to(at::kFloat);
    const auto low = at::full({1}, sign * 1.0f);
    const auto high = at::full({1}, sign * (1.0f + step));
    EXPECT_TRUE(rounded.eq(low).logical_or(rounded.eq(high)).all().item<bool>());
    // The fraction rounded up: 0.375 within 5 standard deviations of a binomial over 2^20.
    const double up = rounded.eq(high).to(at::kDouble).mean().item<double>();
    EXPECT_NEAR(up, 0.375, 5 * std::sqrt(0.375 * 0.625 / (1 << 20)));
    EXPECT_TRUE(bit_equal(round_bfloat16_stochastic(values, 17), rounded.to(at::kBFloat16)));
    EXPECT_FALSE(bit_equal(round_bfloat16_stochastic(values, 18), rounded.to(at::kBFloat16)));
  }
  // The CPU pass gives the bits of the ATen formulation (which CUDA tensors use), here over
  // more than one 2^16 block of indices and both signs.
  const auto mixed = at::randn({3, 40000}) * 1e3;
  EXPECT_TRUE(bit_equal(round_bfloat16_stochastic(mixed, 0xDEADBEEF),
                        shampoo::detail::round_bfloat16_stochastic_aten(mixed, 0xDEADBEEF)));
  // bfloat16 values stay as they are; shapes are kept.
  const auto exact = at::randn({7, 9}).to(at::kBFloat16);
  EXPECT_TRUE(bit_equal(round_bfloat16_stochastic(exact.to(at::kFloat), 3), exact));
}

TEST(StochasticRounding, AnExponentialAverageDoesNotDrift) {
  // V ← 0.999·V + 0.001·g² over 3000 steps with g² = 1: rounded to nearest in bfloat16 it
  // stalls far below 1 - 0.999^3000 (each increment is below half a bfloat16 step); rounded
  // stochastically it stays within 1% of the float32 average.
  auto exact = at::zeros({4096});
  auto nearest = at::zeros({4096}, at::kBFloat16);
  auto stochastic = at::zeros({4096}, at::kBFloat16);
  for (int t = 1; t <= 3000; ++t) {
    exact = exact * 0.999f + 0.001f;
    nearest = (nearest.to(at::kFloat) * 0.999f + 0.001f).to(at::kBFloat16);
    stochastic = round_bfloat16_stochastic(stochastic.to(at::kFloat) * 0.999f + 0.001f,
                                           static_cast<uint32_t>(t));
  }
  const double target = exact.mean().item<double>();
  EXPECT_LT(nearest.to(at::kFloat).mean().item<double>(), 0.8 * target);
  EXPECT_NEAR(stochastic.to(at::kFloat).mean().item<double>(), target, 0.01 * target);
}

StackSpec spec() {
  StackSpec s;
  s.block_shape = {3, 4};
  s.options = at::TensorOptions().dtype(at::kFloat);
  s.names = {"block 0", "block 1"};
  s.dim_exponents = {0.25, 0.25};
  return s;
}

TEST(CompactElementwiseState, FloatCopiesUntilCommitAndFloatExports) {
  ElementwiseState state(GraftingKind::kAdam, {spec()}, /*compact=*/true);
  ChainBlockTensors c;
  state.bind(0, 1, /*filter=*/true, /*momentum=*/true, c, /*block=*/5, /*step=*/1);
  ASSERT_EQ(c.diagonal_state.scalar_type(), at::kFloat);
  ASSERT_EQ(c.filter_state.scalar_type(), at::kFloat);
  ASSERT_EQ(c.momentum_state.scalar_type(), at::kFloat);
  const auto v = at::rand({3, 4}) + 1;
  c.diagonal_state.copy_(v);
  c.filter_state.fill_(0.5);
  std::map<std::string, at::Tensor> before;
  state.export_member(0, 1, before);
  EXPECT_TRUE(bit_equal(before.at("diagonal"), at::zeros({3, 4})));  // not yet committed
  state.commit();
  std::map<std::string, at::Tensor> after;
  state.export_member(0, 1, after);
  EXPECT_EQ(after.at("diagonal").scalar_type(), at::kFloat);
  EXPECT_TRUE(bit_equal(after.at("filter"), at::full({3, 4}, 0.5f)));
  // Each element is one of the two bfloat16 neighbours of v.
  const auto got = after.at("diagonal");
  EXPECT_TRUE((got - v).abs().le(v.abs() / 128).all().item<bool>());
  EXPECT_TRUE(bit_equal(got.to(at::kBFloat16).to(at::kFloat), got));
  EXPECT_FALSE(bit_equal(got, v));
  // A discarded binding changes nothing.
  ChainBlockTensors again;
  state.bind(0, 1, true, true, again, 5, 2);
  again.diagonal_state.fill_(100);
  state.discard();
  state.commit();
  std::map<std::string, at::Tensor> last;
  state.export_member(0, 1, last);
  EXPECT_TRUE(bit_equal(last.at("diagonal"), got));
  // bfloat16 rows: half the bytes of float32.
  ElementwiseState full(GraftingKind::kAdam, {spec()});
  ChainBlockTensors f;
  full.bind(0, 0, true, true, f);
  EXPECT_EQ(2 * state.state_bytes(), full.state_bytes());
}

}  // namespace
