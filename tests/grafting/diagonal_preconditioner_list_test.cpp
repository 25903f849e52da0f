// The diagonal methods: the ATen formulation of DiagonalPreconditionerList against closed forms,
// and the coefficients the fused chain reads from it.
#include "grafting/diagonal_preconditioner_list.h"

#include <cmath>

#include "support/test_support.h"

namespace {

using shampoo::detail::DiagonalHyperparams;
using shampoo::detail::DiagonalMethod;
using shampoo::detail::DiagonalPreconditionerList;
using shampoo::detail::Rows;
using shampoo::detail::RowScalars;
using shampoo::detail::StackSpec;
using shampoo::testing::all_close;

StackSpec spec(int64_t n) {
  StackSpec s;
  s.block_shape = {3, 2};
  s.options = at::TensorOptions().dtype(at::kDouble);
  s.dim_exponents = {0.25, 0.25};
  for (int64_t i = 0; i < n; ++i) s.names.push_back("block " + std::to_string(i));
  return s;
}

RowScalars steps(std::vector<int64_t> t) {
  RowScalars s;
  s.step = std::move(t);
  return s;
}

TEST(DiagonalCoefficients, PerMethod) {
  const DiagonalHyperparams h{0.9, 1e-8};
  const auto ada = shampoo::detail::diagonal_coefficients(DiagonalMethod::kAdaGrad, h, 5);
  EXPECT_EQ(ada.beta2, 1.0);
  EXPECT_EQ(ada.weight, 1.0);
  EXPECT_EQ(ada.bias_correction2, 1.0);
  const auto rms = shampoo::detail::diagonal_coefficients(DiagonalMethod::kRMSprop, h, 5);
  EXPECT_DOUBLE_EQ(rms.weight, 0.1);
  EXPECT_EQ(rms.bias_correction2, 1.0);
  const auto adam = shampoo::detail::diagonal_coefficients(DiagonalMethod::kAdam, h, 5);
  EXPECT_DOUBLE_EQ(adam.bias_correction2, 1.0 - std::pow(0.9, 5));
  EXPECT_EQ(shampoo::detail::diagonal_coefficients(DiagonalMethod::kSGD, h, 5).epsilon, 0.0);
}

TEST(DiagonalPreconditionerList, AdamClosedFormOverSteps) {
  DiagonalPreconditionerList list(DiagonalMethod::kAdam, {spec(2)});
  list.set_row_hyperparams({{0.9, 1e-8}, {0.5, 1e-3}});
  const auto rows = Rows::every(2);
  auto v = at::zeros({2, 3, 2}, at::kDouble);
  for (int64_t t = 1; t <= 3; ++t) {
    const auto g = at::randn({2, 3, 2}, at::kDouble);
    list.update(0, rows, g, steps({t, t}), {false, false});
    v[0] = 0.9 * v[0] + 0.1 * g[0] * g[0];
    v[1] = 0.5 * v[1] + 0.5 * g[1] * g[1];
    EXPECT_TRUE(all_close(list.state(0), v));
    const auto f = at::randn({2, 3, 2}, at::kDouble);
    const auto p = list.precondition(0, rows, f, steps({t, t}));
    EXPECT_TRUE(all_close(p[0], f[0] / ((v[0] / (1 - std::pow(0.9, t))).sqrt() + 1e-8)));
    EXPECT_TRUE(all_close(p[1], f[1] / ((v[1] / (1 - std::pow(0.5, t))).sqrt() + 1e-3)));
  }
}

TEST(DiagonalPreconditionerList, SubsetOfRowsLeavesOthersAlone) {
  DiagonalPreconditionerList list(DiagonalMethod::kAdaGrad, {spec(3)});
  Rows middle;
  middle.rows = {1};
  list.set_row_hyperparams({{1.0, 1e-10}});
  const auto g = at::ones({1, 3, 2}, at::kDouble) * 2.0;
  list.update(0, middle, g, steps({1}), {false});
  EXPECT_EQ(list.state(0)[0].abs().sum().item<double>(), 0.0);
  EXPECT_TRUE(all_close(list.state(0)[1], at::full({3, 2}, 4.0, at::kDouble)));
  EXPECT_EQ(list.state(0)[2].abs().sum().item<double>(), 0.0);
}

TEST(DiagonalPreconditionerList, ExportImportRoundTrip) {
  DiagonalPreconditionerList a(DiagonalMethod::kRMSprop, {spec(2)});
  a.state(0).copy_(at::rand({2, 3, 2}, at::kDouble));
  DiagonalPreconditionerList b(DiagonalMethod::kRMSprop, {spec(2)});
  b.import_member(0, 1, a.export_member(0, 1));
  EXPECT_TRUE(at::equal(b.state(0)[1], a.state(0)[1]));
  EXPECT_EQ(b.state(0)[0].abs().sum().item<double>(), 0.0);
  EXPECT_THROW(b.import_member(0, 0, {}), c10::Error);  // names the missing entry
  EXPECT_FALSE(DiagonalPreconditionerList(DiagonalMethod::kSGD, {spec(1)}).has_state());
}

TEST(DiagonalChainScalars, FilledFromTheMethod) {
  shampoo::kernels::ChainScalars s;
  shampoo::detail::fill_chain_scalars(DiagonalMethod::kRMSprop, {0.99, 1e-6}, 4, s);
  EXPECT_EQ(s.diagonal_kind, static_cast<int32_t>(shampoo::kernels::DiagonalKind::kRMSprop));
  EXPECT_DOUBLE_EQ(s.diagonal_beta2, 0.99);
  EXPECT_DOUBLE_EQ(s.diagonal_weight, 1.0 - 0.99);
  EXPECT_DOUBLE_EQ(s.diagonal_epsilon, 1e-6);
}

}  // namespace
