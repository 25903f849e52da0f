// The matmul-only inverse-root solvers (coupled Newton, Newton–DB, coupled higher order,
// Newton–Schulz; docs/math.md, "Inverse-root solvers") against float64 eigh: well- and
// ill-conditioned stacks, closed forms, the fallback to eigh, independence of the batch, mixed
// exponents; CUDA ≡ CPU (skipped without a GPU).
#include "preconditioners/iterative_roots.h"

#include <torch/cuda.h>

#include <algorithm>
#include <cmath>
#include <iostream>

#include "preconditioners/matrix_functions.h"
#include "support/test_support.h"

namespace {

using shampoo::RootInvShampooConfig;
using shampoo::RootSolver;
using shampoo::detail::integer_root;
using shampoo::detail::power_of_two_root;
using shampoo::detail::stacked_inverse_root;
using shampoo::testing::all_close;
using shampoo::testing::bit_equal;

constexpr auto kNewton = RootSolver::kCoupledNewton;
constexpr auto kDB = RootSolver::kNewtonDB;

RootInvShampooConfig settings(RootSolver method, double tolerance = 1e-6,
                              int64_t max_iterations = 100) {
  RootInvShampooConfig s;
  s.solver = method;
  s.tolerance = tolerance;
  s.max_iterations = max_iterations;
  return s;
}

/// n matrices Q·diag(λ)·Qᵀ with λ log-spaced from 1 down to 1/condition, random Q.
at::Tensor conditioned_spd(int64_t n, int64_t d, double condition, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto options = at::TensorOptions().dtype(at::kDouble);
  const auto q = std::get<0>(at::linalg_qr(at::randn({n, d, d}, gen, options)));
  const auto lambda = at::logspace(0.0, -std::log10(condition), d, 10.0, options);
  return at::matmul(q * lambda, q.transpose(1, 2));
}

/// (A + ε·I)^(−exponent) in float64 through eigh, without the eigenvalue shift (A is SPD here).
at::Tensor exact_root(const at::Tensor& A, double epsilon, double exponent) {
  const auto a = A.to(at::kDouble) + epsilon * at::eye(A.size(-1), at::kDouble);
  const auto [lambda, q] = at::linalg_eigh(a);
  return at::matmul(q * lambda.pow(-exponent).unsqueeze(-2), q.transpose(-1, -2));
}

double relative_error(const at::Tensor& actual, const at::Tensor& expected) {
  const auto e = expected.to(at::kDouble);
  return (actual.to(at::kDouble) - e).norm().item<double>() / e.norm().item<double>();
}

struct Case {
  RootSolver method;
  at::ScalarType dtype;
  double condition;
  double exponent;
  double tolerance;
  double bound;  // relative error (Frobenius) against float64 eigh
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << (c.method == kNewton ? "coupled Newton" : "Newton-DB") << ", " << c.dtype << ", condition "
      << c.condition << ", exponent " << c.exponent << ", tolerance " << c.tolerance << ", bound "
      << c.bound;
}

class AgainstEigh : public ::testing::TestWithParam<Case> {};

TEST_P(AgainstEigh, WithinTheStatedRelativeError) {
  const auto c = GetParam();
  const double eps = 1e-10;
  const auto a = conditioned_spd(4, 24, c.condition, 7).to(c.dtype);
  const std::vector<double> epsilons(4, eps);
  const std::vector<double> exponents(4, c.exponent);
  const auto s = settings(c.method, c.tolerance);
  const auto r = stacked_inverse_root(a, epsilons, exponents, true, &s);
  EXPECT_EQ(r.solver_fallbacks, 0);
  for (int64_t i = 0; i < 4; ++i) {
    ASSERT_FALSE(r.failed[i]);
    const double error = relative_error(r.values[i], exact_root(a[i], eps, c.exponent));
    EXPECT_LE(error, c.bound) << "matrix " << i;
  }
}

// Bounds: float64 at tolerance 1e-12 near rounding; float32 at the default tolerance limited by
// the float32 factor itself (the rounding of A perturbs its smallest eigenvalues by ~u·λ_max).
INSTANTIATE_TEST_SUITE_P(Solvers, AgainstEigh,
                         ::testing::Values(Case{kNewton, at::kDouble, 1e2, 0.25, 1e-12, 1e-10},
                                           Case{kDB, at::kDouble, 1e2, 0.25, 1e-12, 1e-10},
                                           Case{kNewton, at::kDouble, 1e8, 0.25, 1e-12, 1e-8},
                                           Case{kDB, at::kDouble, 1e8, 0.25, 1e-12, 1e-8},
                                           Case{kNewton, at::kDouble, 1e4, 1.0 / 6.0, 1e-12, 1e-10},
                                           Case{kDB, at::kDouble, 1e4, 0.5, 1e-12, 1e-10},
                                           Case{kNewton, at::kFloat, 1e2, 0.25, 1e-6, 1e-5},
                                           Case{kDB, at::kFloat, 1e2, 0.25, 1e-6, 1e-5},
                                           Case{kNewton, at::kFloat, 1e5, 0.25, 1e-6, 1e-3},
                                           Case{kDB, at::kFloat, 1e5, 0.25, 1e-6, 1e-3}));

// The reference's coupled higher-order iteration (issue 58): against eigh of A + ridge·I, the
// ridge max(rel·‖A‖∞, abs) (both branches), at orders 2 to 4 and roots 2, 4 and 6; a higher order
// takes no more iterations than Newton's (order 2) on the same matrices.
TEST(IterativeRoot, CoupledHigherOrderAgainstEigh) {
  const auto a = conditioned_spd(3, 16, 1e3, 5);
  for (const int64_t root : {2, 4, 6}) {
    std::vector<int64_t> newton_iterations;
    for (const int64_t order : {2, 3, 4}) {
      for (const bool relative : {true, false}) {
        auto s = settings(RootSolver::kCoupledHigherOrder, 1e-12);
        s.order = order;
        s.rel_epsilon = relative ? 1e-4 : 1e-12;
        s.abs_epsilon = relative ? 1e-12 : 1e-4;
        const auto r = shampoo::detail::iterative_inverse_root(a, {0.0, 0.0, 0.0}, root, s);
        for (int64_t i = 0; i < 3; ++i) {
          SCOPED_TRACE(::testing::Message() << "root " << root << " order " << order
                                            << (relative ? " relative" : " absolute") << " " << i);
          ASSERT_TRUE(r.converged[i]);
          const double norm = a[i].abs().sum(1).max().item<double>();
          const double ridge = std::max(s.rel_epsilon * norm, s.abs_epsilon);
          EXPECT_LE(relative_error(r.values[i], exact_root(a[i], ridge, 1.0 / root)), 1e-10);
          if (order == 2 && relative) newton_iterations.push_back(r.iterations[i]);
          if (order > 2 && relative) {
            EXPECT_LE(r.iterations[i], newton_iterations[i]);
          }
        }
      }
    }
  }
  // The iteration counts of every solver on these matrices (root 4, the same ridge 1e-4·‖A‖∞
  // for all), reported for docs/math.md.
  const double ridge = 1e-4 * a.abs().sum(2).amax(1).max().item<double>();
  for (const auto solver : {RootSolver::kCoupledNewton, RootSolver::kNewtonDB,
                            RootSolver::kCoupledHigherOrder, RootSolver::kNewtonSchulz}) {
    auto s = settings(solver, 1e-12);
    s.abs_epsilon = ridge;
    s.relative_epsilon = 0.0;  // kNewtonSchulz's ridge: the ε of the others
    const auto r = shampoo::detail::iterative_inverse_root(a, {ridge, ridge, ridge}, 4, s);
    std::cout << shampoo::detail::enumerator_names(solver)[static_cast<size_t>(solver)]
              << " (root 4, condition 1e3, 16x16, float64, tolerance 1e-12): iterations "
              << r.iterations[0] << " " << r.iterations[1] << " " << r.iterations[2] << "\n";
    for (int64_t i = 0; i < 3; ++i) EXPECT_TRUE(r.converged[i]) << i;
  }
}

/// (A + r·I)^(−1/p) with the Newton–Schulz ridge r = max(relative_epsilon·‖A‖_F, ε), in float64.
at::Tensor newton_schulz_expected(const at::Tensor& A, double epsilon, int64_t root,
                                  const RootInvShampooConfig& s) {
  const double norm = A.to(at::kDouble).norm().item<double>();
  return exact_root(A, std::max(s.relative_epsilon * norm, epsilon), 1.0 / root);
}

// The reference's Newton–Schulz inverse root (issue 58): against float64 eigh of A + ridge·I on
// well-conditioned stacks (condition 1e3, 24x24) at roots 2, 4 and 8, float64 and float32, with
// the reference's default schedule; the iteration count is fixed (10 per square-root pass).
TEST(IterativeRoot, NewtonSchulzAgainstEigh) {
  const auto a64 = conditioned_spd(4, 24, 1e3, 9);
  const auto s = settings(RootSolver::kNewtonSchulz);
  ASSERT_EQ(s.coefficients.size(), 10u);
  for (const auto dtype : {at::kDouble, at::kFloat}) {
    const auto a = a64.to(dtype);
    for (const int64_t root : {2, 4, 8}) {
      const auto r =
          shampoo::detail::iterative_inverse_root(a, std::vector<double>(4, 1e-10), root, s);
      double worst = 0.0;
      for (int64_t i = 0; i < 4; ++i) {
        SCOPED_TRACE(::testing::Message() << dtype << " root " << root << " matrix " << i);
        ASSERT_TRUE(r.converged[i]);
        EXPECT_EQ(r.iterations[i], 10 * static_cast<int64_t>(std::log2(root)));
        worst = std::max(
            worst, relative_error(r.values[i], newton_schulz_expected(a64[i], 1e-10, root, s)));
      }
      std::cout << "Newton-Schulz " << dtype << " root " << root
                << " (condition 1e3, 24x24): " << r.iterations[0] << " iterations, relative error "
                << worst << "\n";
      EXPECT_LE(worst, dtype == at::kDouble ? 1e-12 : 2e-5);
    }
  }
}

// The Shampoo ε takes over from the relative floor when it is larger: the ridge is the max.
TEST(IterativeRoot, NewtonSchulzRidgeIsTheLargerOfEpsilonAndTheRelativeFloor) {
  const auto a = conditioned_spd(2, 12, 1e2, 4);
  auto s = settings(RootSolver::kNewtonSchulz);
  for (const double epsilon : {1e-12, 1e-2}) {
    for (const double relative : {1e-6, 1e-3}) {
      s.relative_epsilon = relative;
      const auto r = shampoo::detail::iterative_inverse_root(a, {epsilon, epsilon}, 4, s);
      for (int64_t i = 0; i < 2; ++i) {
        ASSERT_TRUE(r.converged[i]);
        EXPECT_LE(relative_error(r.values[i], newton_schulz_expected(a[i], epsilon, 4, s)), 1e-10)
            << "epsilon " << epsilon << " relative " << relative;
      }
    }
  }
}

// No convergence check during the schedule: a result that did not land on the root (a schedule
// too short for the spectrum, or an indefinite A + ridge·I) is computed by eigh, as every
// solver's unconverged matrices are; the reference would return it as is.
TEST(IterativeRoot, NewtonSchulzResultsOffTheRootAreComputedByEigh) {
  const auto a = conditioned_spd(3, 16, 1e3, 3);
  const std::vector<double> eps(3, 1e-10), exponents(3, 0.25);
  const auto eigh = stacked_inverse_root(a, eps, exponents, true);
  auto s = settings(RootSolver::kNewtonSchulz);
  s.coefficients = {{1.875, -1.25, 0.375}};
  auto r = stacked_inverse_root(a, eps, exponents, true, &s);
  EXPECT_EQ(r.solver_fallbacks, 3);
  EXPECT_TRUE(bit_equal(r.values, eigh.values));
  const auto indefinite = at::diag(at::tensor({-1.0, 2.0, 3.0})).unsqueeze(0);
  s = settings(RootSolver::kNewtonSchulz);
  r = stacked_inverse_root(indefinite, {0.1}, {0.5}, true, &s);
  EXPECT_EQ(r.solver_fallbacks, 1);
  EXPECT_TRUE(bit_equal(r.values, stacked_inverse_root(indefinite, {0.1}, {0.5}, true).values));
}

TEST(IterativeRoot, NewtonSchulzRefusesRootsThatAreNotPowersOfTwo) {
  const auto a = conditioned_spd(1, 6, 1e2, 2);
  const auto s = settings(RootSolver::kNewtonSchulz);
  for (const double exponent : {1.0 / 6.0, 1.0}) {
    shampoo::testing::expect_error([&] { stacked_inverse_root(a, {1e-8}, {exponent}, true, &s); },
                                   {"kNewtonSchulz computes roots that are powers of two"});
  }
}

TEST(IterativeRoot, DiagonalClosedForm) {
  const auto a = at::diag(at::tensor({1.0, 4.0, 9.0, 16.0})).unsqueeze(0);
  const auto expected = at::diag(at::tensor({1.0, 0.5, 1.0 / 3.0, 0.25}));
  for (const auto method : {kNewton, kDB}) {
    const auto s = settings(method, 1e-13);
    const auto r = stacked_inverse_root(a, {0.0}, {0.5}, true, &s);
    EXPECT_EQ(r.solver_fallbacks, 0);
    EXPECT_TRUE(all_close(r.values[0], expected, {1e-12, 1e-12})) << static_cast<int>(method);
  }
}

TEST(IterativeRoot, UnconvergedMatricesFallBackToEigh) {
  // Condition 1e8 cannot converge in 3 iterations: every matrix is computed by eigh, exactly as
  // the eigh path computes it.
  const auto a = conditioned_spd(3, 16, 1e8, 3).to(at::kFloat);
  const std::vector<double> eps(3, 1e-12), exponents(3, 0.25);
  const auto eigh = stacked_inverse_root(a, eps, exponents, true);
  for (const auto method : {kNewton, kDB}) {
    const auto s = settings(method, 1e-6, 3);
    const auto r = stacked_inverse_root(a, eps, exponents, true, &s);
    EXPECT_EQ(r.solver_fallbacks, 3);
    EXPECT_TRUE(bit_equal(r.values, eigh.values)) << static_cast<int>(method);
  }
}

TEST(IterativeRoot, IndefiniteMatrixFallsBackToEigh) {
  // A + ε·I indefinite (eigenvalue −1): the iteration cannot converge; eigh shifts it.
  const auto a = at::diag(at::tensor({-1.0, 2.0, 3.0})).unsqueeze(0).to(at::kFloat);
  const auto eigh = stacked_inverse_root(a, {0.1}, {0.5}, true);
  for (const auto method : {kNewton, kDB}) {
    const auto s = settings(method);
    const auto r = stacked_inverse_root(a, {0.1}, {0.5}, true, &s);
    EXPECT_EQ(r.solver_fallbacks, 1);
    EXPECT_TRUE(bit_equal(r.values, eigh.values));
  }
}

TEST(IterativeRoot, ResultOfAMatrixDoesNotDependOnTheBatch) {
  // The distributed engine computes a rank's blocks only: a matrix must come out the same alone
  // as in any stack, bit for bit.
  auto a = at::cat({conditioned_spd(3, 12, 1e3, 1), conditioned_spd(2, 12, 1e6, 2)}).to(at::kFloat);
  const std::vector<double> eps{1e-8, 1e-6, 1e-8, 1e-10, 1e-8};
  const std::vector<double> exponents(5, 0.25);
  for (const auto method : {kNewton, kDB, RootSolver::kNewtonSchulz}) {
    const auto s = settings(method);
    const auto stacked = stacked_inverse_root(a, eps, exponents, true, &s);
    for (int64_t i = 0; i < 5; ++i) {
      const auto alone = stacked_inverse_root(a.narrow(0, i, 1), {eps[i]}, {0.25}, true, &s);
      EXPECT_TRUE(bit_equal(alone.values[0], stacked.values[i])) << "matrix " << i;
    }
  }
}

TEST(IterativeRoot, MixedExponentsInOneStack) {
  // 1/2 and 1/4 by the solver, 1/6 by coupled Newton (also under Newton–DB), 0.3 (root 10/3)
  // by eigh, 0 the identity.
  const auto a = conditioned_spd(5, 10, 1e3, 5);
  const std::vector<double> eps(5, 1e-9);
  const std::vector<double> exponents{0.5, 0.25, 1.0 / 6.0, 0.3, 0.0};
  const auto eigh = stacked_inverse_root(a, eps, exponents, true);
  for (const auto method : {kNewton, kDB}) {
    const auto s = settings(method, 1e-12);
    const auto r = stacked_inverse_root(a, eps, exponents, true, &s);
    EXPECT_EQ(r.solver_fallbacks, 0);
    for (int64_t i = 0; i < 3; ++i) {
      EXPECT_LE(relative_error(r.values[i], exact_root(a[i], 1e-9, exponents[i])), 1e-10);
    }
    EXPECT_TRUE(bit_equal(r.values[3], eigh.values[3]));
    EXPECT_TRUE(bit_equal(r.values[4], at::eye(10, at::kDouble)));
  }
}

TEST(IterativeRoot, IntegerRoots) {
  EXPECT_EQ(integer_root(0.25), 4);
  EXPECT_EQ(integer_root(1.0 / 6.0), 6);
  EXPECT_EQ(integer_root(1.0), 1);
  EXPECT_EQ(integer_root(0.3), 0);
  EXPECT_EQ(integer_root(0.0), 0);
  EXPECT_EQ(integer_root(2.0), 0);
  EXPECT_TRUE(power_of_two_root(2));
  EXPECT_TRUE(power_of_two_root(8));
  EXPECT_FALSE(power_of_two_root(6));
  EXPECT_FALSE(power_of_two_root(1));
}

TEST(IterativeRootCuda, MatchesCpuAndRestoresTf32Mode) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const auto a = conditioned_spd(6, 256, 1e4, 11).to(at::kFloat);
  const std::vector<double> eps(6, 1e-8), exponents(6, 0.25);
  at::globalContext().setAllowTF32CuBLAS(false);
  for (const auto method :
       {kNewton, kDB, RootSolver::kCoupledHigherOrder, RootSolver::kNewtonSchulz}) {
    auto s = settings(method);
    s.abs_epsilon = 1e-8;      // kCoupledHigherOrder's ridge: the ε of the others
    s.relative_epsilon = 0.0;  // kNewtonSchulz's ridge: the ε of the others
    const auto cpu = stacked_inverse_root(a, eps, exponents, true, &s);
    const auto gpu = stacked_inverse_root(a.cuda(), eps, exponents, true, &s);
    EXPECT_EQ(gpu.solver_fallbacks, 0);
    for (int64_t i = 0; i < 6; ++i) {
      EXPECT_LE(relative_error(gpu.values[i].cpu(), cpu.values[i]), 1e-4) << "matrix " << i;
    }
    s.tf32 = true;
    s.tolerance = 3e-2;
    const auto tf32 = stacked_inverse_root(a.cuda(), eps, exponents, true, &s);
    EXPECT_FALSE(at::globalContext().allowTF32CuBLAS());
    for (int64_t i = 0; i < 6; ++i) {
      EXPECT_LE(relative_error(tf32.values[i].cpu(), exact_root(a[i], 1e-8, 0.25)), 5e-2);
    }
  }
}

TEST(IterativeRootCuda, Tf32RetriesIllConditionedMatricesInFloat32) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  // Condition 1e6 is beyond TF32's resolution: those matrices diverge in TF32 and are solved
  // again in float32 (no eigh fallback), to float32's accuracy.
  const auto a = conditioned_spd(4, 128, 1e6, 13).to(at::kFloat);
  const std::vector<double> eps(4, 1e-10), exponents(4, 0.25);
  auto s = settings(kNewton, 1e-6);
  s.tf32 = true;
  const auto r = stacked_inverse_root(a.cuda(), eps, exponents, true, &s);
  EXPECT_EQ(r.solver_fallbacks, 0);
  for (int64_t i = 0; i < 4; ++i) {
    EXPECT_LE(relative_error(r.values[i].cpu(), exact_root(a[i], 1e-10, 0.25)), 3e-2);
  }
}

}  // namespace
