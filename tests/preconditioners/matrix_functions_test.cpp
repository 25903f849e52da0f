// Inverse roots and eigenbases of stacks of symmetric matrices (docs/math.md step 3).
#include "preconditioners/matrix_functions.h"

#include <cmath>

#include "support/test_support.h"

namespace {

using shampoo::detail::stacked_eigenbasis;
using shampoo::detail::stacked_eigenbasis_qr;
using shampoo::detail::stacked_inverse_root;
using shampoo::testing::all_close;
using shampoo::testing::bit_equal;

at::Tensor random_spd(int64_t n, int64_t d, uint64_t seed, at::ScalarType dtype = at::kFloat) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto g = at::randn({n, d, 2 * d}, gen, at::TensorOptions().dtype(at::kDouble));
  return (at::bmm(g, g.transpose(1, 2)) / (2.0 * d)).to(dtype);
}

TEST(StackedAllFinite, FindsEveryNonFiniteEntryLikeIsfinite) {
  // The CPU's one-pass check against at::isfinite: ±inf and NaN at the first, last and a middle
  // entry of a matrix, float and double, contiguous and transposed stacks, and an empty matrix.
  const double specials[] = {INFINITY, -INFINITY, NAN};
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    for (const bool transposed : {false, true}) {
      auto A = at::randn({6, 37, 37}, at::TensorOptions().dtype(dtype)) * 1e30;
      A[1][0][0] = specials[0];
      A[2][36][36] = specials[1];
      A[4][18][5] = specials[2];
      A[5][36][0] = specials[0];
      const auto input = transposed ? A.transpose(1, 2) : A;
      const auto expected = at::isfinite(input).flatten(1).all(1);
      const auto ours = shampoo::detail::stacked_all_finite(input);
      ASSERT_EQ(ours.size(), 6u);
      for (int64_t i = 0; i < 6; ++i) {
        EXPECT_EQ(ours[i], expected[i].item<bool>()) << dtype << ", matrix " << i;
      }
      EXPECT_EQ(ours, (std::vector<bool>{true, false, false, true, false, false}));
    }
  }
  EXPECT_EQ(shampoo::detail::stacked_all_finite(at::empty({2, 0, 0})),
            (std::vector<bool>{true, true}));
}

TEST(InverseRoot, DiagonalClosedForm) {
  const auto a = at::diag(at::tensor({1.0, 4.0, 9.0, 16.0})).unsqueeze(0).to(at::kFloat);
  const auto r = stacked_inverse_root(a, {1e-12}, {0.5}, true);
  ASSERT_FALSE(r.failed[0]);
  const auto expected = at::diag(at::tensor({1.0, 0.5, 1.0 / 3.0, 0.25})).to(at::kFloat);
  EXPECT_TRUE(all_close(r.values[0], expected));
  const auto quarter = stacked_inverse_root(a, {1e-12}, {0.25}, true);
  EXPECT_TRUE(all_close(
      quarter.values[0],
      at::diag(at::tensor({1.0, 1 / std::sqrt(2.0), 1 / std::sqrt(3.0), 0.5})).to(at::kFloat)));
}

TEST(InverseRoot, PowerOfTheRootGivesBackTheRegularizedMatrix) {
  // Independent check: X = (A + eps I)^(-1/4)  =>  X^4 (A + eps I) = I.
  const double eps = 1e-6;
  const auto a = random_spd(3, 12, 1, at::kDouble);
  const auto r = stacked_inverse_root(a, {eps, eps, eps}, {0.25, 0.25, 0.25}, true);
  for (int64_t i = 0; i < 3; ++i) {
    const auto x = r.values[i];
    const auto x4 = at::matmul(at::matmul(x, x), at::matmul(x, x));
    const auto id = at::matmul(x4, a[i] + eps * at::eye(12, at::kDouble));
    EXPECT_TRUE(all_close(id, at::eye(12, at::kDouble), {1e-8, 1e-8})) << "matrix " << i;
  }
}

TEST(InverseRoot, ShiftsSmallEigenvalues) {
  // Eigenvalues -2, 0.5, 3 with epsilon 0.1: -2 + 0.1 < 0.1, so every eigenvalue of A + eps I
  // moves by -lambda_min + eps = 2.0 -> 0.1, 2.6, 5.1.
  const auto q = std::get<0>(at::linalg_qr(at::randn({3, 3}, at::kDouble)));
  const auto a = at::matmul(at::matmul(q, at::diag(at::tensor({-2.0, 0.5, 3.0}))), q.t());
  const auto r = stacked_inverse_root(a.unsqueeze(0), {0.1}, {0.5}, true);
  const auto expected =
      at::matmul(at::matmul(q, at::diag(at::tensor({0.1, 2.6, 5.1}).pow(-0.5))), q.t());
  EXPECT_TRUE(all_close(r.values[0], expected, {1e-9, 1e-9}));
  // No shift when every eigenvalue of A + eps I is at least eps.
  const auto b = at::matmul(at::matmul(q, at::diag(at::tensor({1.0, 2.0, 3.0}))), q.t());
  const auto s = stacked_inverse_root(b.unsqueeze(0), {0.1}, {1.0}, true);
  EXPECT_TRUE(all_close(s.values[0], at::inverse(b + 0.1 * at::eye(3, at::kDouble)), {1e-9, 1e-9}));
}

TEST(InverseRoot, RankDeficientFloat32FactorsShiftToExactlyEpsilon) {
  // Rank-2 float32 factors G·Gᵀ of 64×64 with large entries: eigh rounds the null space to
  // eigenvalues of about ±1e-6·‖A‖, far above ε. The shift must still make the smallest
  // eigenvalue exactly ε (two roundings: λ − λ_min, then + ε), so every power is finite and the
  // largest eigenvalue of the root is ε^(−e). Adding (ε − λ_min) in one step turned it into 0
  // and its power into inf for most of these matrices.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const int64_t n = 64;
  const int64_t d = 64;
  for (const double scale : {4.0, 10.0}) {
    for (const double eps : {1e-12, 1e-10}) {
      const auto g = at::randn({n, d, 2}, gen, at::TensorOptions().dtype(at::kFloat)) * scale;
      const auto a = at::bmm(g, g.transpose(1, 2));
      const std::vector<double> epsilons(n, eps), exponents(n, 0.5);
      const auto r = stacked_inverse_root(a, epsilons, exponents, true);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_FALSE(r.failed[i]);
        ASSERT_TRUE(at::isfinite(r.values[i]).all().item<bool>())
            << "matrix " << i << " scale " << scale << " epsilon " << eps;
        const double largest =
            at::linalg_eigvalsh(r.values[i].to(at::kDouble)).max().item<double>();
        EXPECT_NEAR(largest / std::pow(eps, -0.5), 1.0, 1e-3)
            << "matrix " << i << " scale " << scale << " epsilon " << eps;
      }
    }
  }
}

TEST(InverseRoot, EachMatrixIndependentOfItsStack) {
  // LAPACK's batched eigh rounds differently for odd sizes depending on the batch; ours must not.
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    for (const int64_t d : {5, 7, 16, 33}) {
      const auto a = random_spd(5, d, 2, dtype);
      const std::vector<double> eps(5, 1e-8), exps(5, 0.25);
      const auto all = stacked_inverse_root(a, eps, exps, true);
      const auto basis = stacked_eigenbasis(a, true);
      for (int64_t first = 0; first < 5; ++first) {
        const std::vector<double> e(5 - first, 1e-8), x(5 - first, 0.25);
        const auto part = stacked_inverse_root(a.narrow(0, first, 5 - first), e, x, true);
        const auto part_basis = stacked_eigenbasis(a.narrow(0, first, 5 - first), true);
        for (int64_t i = first; i < 5; ++i) {
          EXPECT_TRUE(bit_equal(part.values[i - first], all.values[i]))
              << "d " << d << " matrix " << i;
          EXPECT_TRUE(bit_equal(part_basis.values[i - first], basis.values[i]));
        }
      }
    }
  }
}

TEST(InverseRoot, PerMatrixEpsilonAndExponent) {
  const auto a = random_spd(2, 6, 3, at::kDouble);
  const auto r = stacked_inverse_root(a, {1e-3, 1e-1}, {0.5, 0.0}, true);
  const auto first = stacked_inverse_root(a.narrow(0, 0, 1), {1e-3}, {0.5}, true);
  EXPECT_TRUE(all_close(r.values[0], first.values[0]));
  EXPECT_TRUE(bit_equal(r.values[1], at::eye(6, at::kDouble)));  // exponent 0: identity
}

TEST(InverseRoot, NonFiniteInputIsAnError) {
  auto a = random_spd(2, 4, 4);
  a[1][0][0] = NAN;
  EXPECT_THROW(stacked_inverse_root(a, {1e-6, 1e-6}, {0.5, 0.5}, true), c10::Error);
}

TEST(Eigenbasis, DiagonalizesTheMatrix) {
  const auto a = random_spd(3, 10, 5, at::kDouble);
  const auto r = stacked_eigenbasis(a, true);
  for (int64_t i = 0; i < 3; ++i) {
    const auto q = r.values[i];
    const auto d = at::matmul(at::matmul(q.t(), a[i]), q);
    EXPECT_TRUE(all_close(d - at::diag(d.diagonal()), at::zeros_like(d), {1e-9, 1e-9}));
    EXPECT_TRUE(all_close(at::matmul(q.t(), q), at::eye(10, at::kDouble), {1e-9, 1e-9}));
  }
}

TEST(Eigenbasis, QrStepFromTheExactBasisKeepsIt) {
  const auto a = random_spd(2, 8, 6, at::kDouble);
  const auto exact = stacked_eigenbasis(a, true).values;
  const auto r = stacked_eigenbasis_qr(a, exact);
  for (int64_t i = 0; i < 2; ++i) {
    // Same columns up to sign.
    const auto overlap = at::matmul(r.values[i].t(), exact[i]).abs();
    EXPECT_TRUE(all_close(overlap, at::eye(8, at::kDouble), {1e-7, 1e-7}));
  }
}

TEST(Eigenbasis, QrIterationsConvergeToTheEigenbasis) {
  const auto q0 = std::get<0>(at::linalg_qr(at::randn({6, 6}, at::kDouble)));
  const auto a =
      at::matmul(at::matmul(q0, at::diag(at::tensor({1., 2., 4., 8., 16., 32.}))), q0.t())
          .unsqueeze(0);
  auto basis = at::eye(6, at::kDouble).unsqueeze(0);
  for (int i = 0; i < 200; ++i) basis = stacked_eigenbasis_qr(a, basis).values;
  const auto d = at::matmul(at::matmul(basis[0].t(), a[0]), basis[0]);
  EXPECT_TRUE(all_close(d.diagonal(), at::tensor({1., 2., 4., 8., 16., 32.}), {1e-6, 1e-6}));
}

}  // namespace
