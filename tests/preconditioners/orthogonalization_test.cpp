// Orthogonalization (spectral descent's direction) against closed forms: the SVD gives
// sign(diag) for a diagonal matrix and maps v̂ to û for a rank-1 matrix u·vᵀ; Newton–Schulz maps
// every singular value σ to p⁵(σ/‖A‖_F) (p the quintic), so on those matrices its result is known
// exactly, lies within Muon's band [0.68, 1.14] of the SVD's, and with coefficients satisfying
// p(1) = 1 it converges to the SVD's. CUDA ≡ CPU when a GPU is present.
#include "preconditioners/orthogonalization.h"

#include <torch/cuda.h>

#include <cmath>

#include "support/test_support.h"

namespace {

using shampoo::OrthogonalizationMethod;
using shampoo::SpectralDescentConfig;
using shampoo::detail::newton_schulz;
using shampoo::detail::stacked_orthogonalize;
using shampoo::detail::svd_orthogonalize;
using shampoo::testing::all_close;

constexpr std::array<double, 3> kMuon = {3.4445, -4.7750, 2.0315};
// Modula's coefficients: p(1) = 1 and |p'(1)| = 0.6 < 1, so σ/‖A‖_F → 1 for every σ > 0.
constexpr std::array<double, 3> kConvergent = {3.0, -16.0 / 5.0, 6.0 / 5.0};

const auto kDouble = at::TensorOptions().dtype(at::kDouble);

/// p applied `n` times to x: the scalar Newton–Schulz map.
double iterate_quintic(double x, const std::array<double, 3>& c, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    x = c[0] * x + c[1] * x * x * x + c[2] * x * x * x * x * x;
  }
  return x;
}

/// A rows × cols matrix with `diag` on its diagonal, as a stack of one.
at::Tensor rectangular_diagonal(const std::vector<double>& diag, int64_t rows, int64_t cols) {
  auto a = at::zeros({1, rows, cols}, kDouble);
  for (size_t i = 0; i < diag.size(); ++i) a[0][i][i] = diag[i];
  return a;
}

class DiagonalMatrix : public ::testing::TestWithParam<std::pair<int64_t, int64_t>> {};

TEST_P(DiagonalMatrix, SvdGivesSignAndNewtonSchulzItsScalarMap) {
  const auto [rows, cols] = GetParam();
  const std::vector<double> diag{3.0, -0.5, 2.0, -1.0};
  const auto a = rectangular_diagonal(diag, rows, cols);
  std::vector<double> signs;
  double frobenius = 0.0;
  for (const double d : diag) {
    signs.push_back(d > 0 ? 1.0 : -1.0);
    frobenius += d * d;
  }
  frobenius = std::sqrt(frobenius);
  EXPECT_TRUE(all_close(svd_orthogonalize(a, false), rectangular_diagonal(signs, rows, cols)));

  // Newton–Schulz keeps a diagonal matrix diagonal: entry d → sign(d)·p⁵(|d|/‖A‖_F).
  std::vector<double> expected;
  for (size_t i = 0; i < diag.size(); ++i) {
    const double mapped = iterate_quintic(std::abs(diag[i]) / frobenius, kMuon, 5);
    // Muon's coefficients do not converge to 1: after 5 iterations every σ/‖A‖_F ≥ 0.05 lies in
    // [0.68, 1.14] (the accuracy the reference accepts for its default).
    EXPECT_GT(mapped, 0.68);
    EXPECT_LT(mapped, 1.14);
    expected.push_back(signs[i] * mapped);
  }
  const auto ns = newton_schulz(a, 5, kMuon);
  EXPECT_TRUE(all_close(ns, rectangular_diagonal(expected, rows, cols)));
  // With p(1) = 1 it converges: 40 iterations reach sign(diag) to 1e-8.
  EXPECT_TRUE(all_close(newton_schulz(a, 40, kConvergent), rectangular_diagonal(signs, rows, cols),
                        {1e-8, 1e-8}));
}

INSTANTIATE_TEST_SUITE_P(Shapes, DiagonalMatrix,
                         ::testing::Values(std::pair<int64_t, int64_t>{4, 4},
                                           std::pair<int64_t, int64_t>{4, 7},
                                           std::pair<int64_t, int64_t>{9, 4}));

TEST(RankOneMatrix, GivesTheOuterProductOfTheUnitVectors) {
  for (const auto& [m, k] : std::vector<std::pair<int64_t, int64_t>>{{5, 3}, {3, 5}}) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
    const auto u = at::randn({m}, gen, kDouble);
    const auto v = at::randn({k}, gen, kDouble);
    const auto a = at::outer(u, v).unsqueeze(0) * 4.0;
    const auto u_hat = u / u.norm(), v_hat = v / v.norm();
    const auto direction = at::outer(u_hat, v_hat).unsqueeze(0);
    // Newton–Schulz maps the zero singular values to p(0) = 0 and the one σ = ‖A‖_F to p⁵(1)
    // (0.696 for Muon's coefficients, 1 for coefficients with p(1) = 1).
    EXPECT_TRUE(all_close(newton_schulz(a, 5, kMuon), direction * iterate_quintic(1.0, kMuon, 5)))
        << m << "x" << k;
    EXPECT_TRUE(all_close(newton_schulz(a, 3, kConvergent), direction)) << m << "x" << k;
    // The SVD's U·Vᵀ is unique on the range only (its null-space columns are arbitrary, as in
    // the reference): it maps v̂ to û and û back to v̂; the nuclear norm is the one σ.
    const auto svd = svd_orthogonalize(a, false)[0];
    EXPECT_TRUE(all_close(at::mv(svd, v_hat), u_hat)) << m << "x" << k;
    EXPECT_TRUE(all_close(at::mv(svd.t(), u_hat), v_hat)) << m << "x" << k;
    const double sigma = 4.0 * u.norm().item<double>() * v.norm().item<double>();
    EXPECT_TRUE(all_close(at::mv(svd_orthogonalize(a, true)[0], v_hat), u_hat * sigma));
  }
}

TEST(NewtonSchulz, ConvergesToTheSvdDirectionTallAndWide) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  for (const auto& shape : std::vector<std::vector<int64_t>>{{3, 8, 5}, {3, 5, 8}, {2, 6, 6}}) {
    // Singular values in [1, 2]: well inside the iteration's basin after normalization.
    const auto q = at::linalg_qr(at::randn({shape[0], shape[1], shape[1]}, gen, kDouble));
    const auto r = at::linalg_qr(at::randn({shape[0], shape[2], shape[2]}, gen, kDouble));
    const int64_t rank = std::min(shape[1], shape[2]);
    const auto s = at::linspace(1.0, 2.0, rank, kDouble).expand({shape[0], rank});
    const auto a = at::bmm(std::get<0>(q).narrow(2, 0, rank) * s.unsqueeze(1),
                           std::get<0>(r).narrow(2, 0, rank).transpose(1, 2));
    const auto expected = svd_orthogonalize(a, false);
    EXPECT_TRUE(all_close(newton_schulz(a, 60, kConvergent), expected, {1e-9, 1e-9}))
        << at::IntArrayRef(shape);
    // The zero matrix stays zero (the norm is clamped, not divided by 0).
    EXPECT_TRUE(at::equal(newton_schulz(at::zeros_like(a), 5, kMuon), at::zeros_like(a)));
  }
}

TEST(StackedOrthogonalize, ScalesByTheAspectRatioAndMatchesOneMatrixAtATime) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const auto tall = at::randn({4, 8, 2}, gen);
  SpectralDescentConfig plain;
  SpectralDescentConfig scaled;
  scaled.scale = shampoo::OrthogonalizationScale::kSqrtAspectRatio;
  // sqrt(max(1, 8/2)) = 2 for tall blocks, 1 for wide ones.
  EXPECT_TRUE(
      at::equal(stacked_orthogonalize(tall, scaled), stacked_orthogonalize(tall, plain) * 2));
  const auto wide = tall.transpose(1, 2).contiguous();
  EXPECT_TRUE(at::equal(stacked_orthogonalize(wide, scaled), stacked_orthogonalize(wide, plain)));
  // Each matrix's result does not depend on the rest of its stack (bit for bit on the CPU).
  for (int64_t i = 0; i < 4; ++i) {
    EXPECT_TRUE(at::equal(stacked_orthogonalize(tall, plain)[i],
                          stacked_orthogonalize(tall.narrow(0, i, 1).clone(), plain)[0]))
        << "member " << i;
  }
}

class CudaOrthogonalize : public ::testing::TestWithParam<OrthogonalizationMethod> {};

TEST_P(CudaOrthogonalize, EqualsCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  SpectralDescentConfig settings;
  settings.method = GetParam();
  for (const auto& shape : std::vector<std::vector<int64_t>>{{6, 16, 9}, {3, 9, 16}}) {
    const auto blocks = at::randn(shape, gen);
    const auto cpu = stacked_orthogonalize(blocks, settings);
    // float32 matrix products over 5 iterations (cuBLAS vs CPU BLAS summation order), and
    // TF32 is not used: the float32 tolerance with a tenfold atol for the accumulated rounding.
    EXPECT_TRUE(
        all_close(stacked_orthogonalize(blocks.cuda(), settings).cpu(), cpu, {1.3e-6, 1e-4}));
  }
}

INSTANTIATE_TEST_SUITE_P(Algorithms, CudaOrthogonalize,
                         ::testing::Values(OrthogonalizationMethod::kNewtonSchulz,
                                           OrthogonalizationMethod::kSVD));

}  // namespace
