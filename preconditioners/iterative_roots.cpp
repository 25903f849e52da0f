#include "preconditioners/iterative_roots.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "preconditioners/rows.h"

namespace shampoo::detail {
namespace {

/// The host reads the batch's "still active" flag once every this many iterations.
constexpr int64_t kCheckEvery = 4;
/// Working-set bound of one CUDA batch: matrices alive per member times the member's bytes.
constexpr int64_t kWorkspaceBytes = int64_t{256} << 20;
constexpr int64_t kLiveMatricesPerMember = 8;
/// Power iteration of the Newton–DB scaling: vectors, iterations, seed of the fixed start
/// vectors (drawn from a private generator: the user's random stream is not touched), and the
/// margin over the estimate of λ_max.
constexpr int64_t kPowerVectors = 4;
constexpr int64_t kPowerIterations = 8;
constexpr uint64_t kPowerSeed = 0x5eed;
constexpr double kScaleMargin = 1.1;
/// Precision floors: a matrix whose error stops decreasing once at or below the floor has
/// converged as far as its arithmetic allows.
constexpr double kFloor = 1e-3;
constexpr double kFloorTf32 = 5e-2;
/// After its first iteration a convergent matrix has every eigenvalue of M (Z·Y) in (0, 1], so
/// max|M − I| < 1: an error above this bound from the second iteration on means an eigenvalue
/// went negative (an indefinite A + ε·I) and grows without bound. Such a matrix stops at once
/// (unconverged: eigh takes over) instead of iterating until it overflows.
constexpr double kDivergence = 1.1;
/// Newton–Schulz runs a fixed schedule: a result whose max|Z·Y − I| exceeds this after a pass
/// did not land on the root (an input outside the schedule's range, or indefinite) and is
/// computed by eigh. The reference's higher-order solver raises above the same 0.1.
constexpr double kNewtonSchulzResidual = 0.1;

/// Sets cuBLAS's TF32 mode for its lifetime and restores the previous mode.
class Tf32Mode {
 public:
  explicit Tf32Mode(bool enable) : previous_(at::globalContext().allowTF32CuBLAS()) {
    at::globalContext().setAllowTF32CuBLAS(enable);
  }
  ~Tf32Mode() { at::globalContext().setAllowTF32CuBLAS(previous_); }
  Tf32Mode(const Tf32Mode&) = delete;
  Tf32Mode& operator=(const Tf32Mode&) = delete;

 private:
  bool previous_;
};

/// max|P − I| per matrix of the stack: [n].
at::Tensor distance_to_identity(const at::Tensor& P, const at::Tensor& eye) {
  return (P - eye).abs().amax({1, 2});
}

at::Tensor per_member(const at::Tensor& values) { return values.view({-1, 1, 1}); }

/// Per-matrix stopping state of one batch, kept on the device.
class Progress {
 public:
  Progress(const at::Tensor& error, double tolerance, double floor)
      : error_(error), tolerance_(tolerance), floor_(floor) {
    const auto finite = at::isfinite(error);
    converged_ = at::logical_and(finite, error <= tolerance);
    active_ = at::logical_and(finite, error > tolerance);
    iterations_ = at::zeros(error.sizes(), error.options().dtype(at::kLong));
  }

  /// One iteration produced candidates with errors `error`: returns the members that take them
  /// ([n] bool). A member stops when it reaches the tolerance (converged), when its error stops
  /// decreasing at or below the floor (converged; the previous iterate is kept), or when the
  /// error is not finite or diverges (not converged). Above the floor the error need not
  /// decrease at every iteration (Newton's early iterations are not monotone), so the candidate
  /// is taken.
  at::Tensor advance(const at::Tensor& error) {
    const auto finite = at::isfinite(error);
    const auto stalled = active_ & finite & (error >= error_) & (error_ <= floor_);
    const auto diverged = active_ & (iterations_ >= 1) & (error > kDivergence);
    const auto accept = active_ & finite & ~stalled & ~diverged;
    error_ = at::where(accept, error, error_);
    iterations_ += accept.to(at::kLong);
    const auto reached = accept & (error <= tolerance_);
    converged_ = converged_ | stalled | reached;
    active_ = accept & ~reached;
    return accept;
  }

  bool any_active() const { return active_.any().item<bool>(); }
  const at::Tensor& converged() const { return converged_; }
  const at::Tensor& iterations() const { return iterations_; }

 private:
  at::Tensor error_, converged_, active_, iterations_;
  double tolerance_, floor_;
};

/// Runs `step(iteration)` until no member is active or the budget is spent; the host checks the
/// batch once every kCheckEvery iterations.
template <typename Step>
void iterate(Progress& progress, int64_t max_iterations, Step&& step) {
  if (!progress.any_active()) return;
  for (int64_t k = 1; k <= max_iterations; ++k) {
    step();
    if (k % kCheckEvery == 0 && !progress.any_active()) return;
  }
}

at::Tensor keep(const at::Tensor& accept, const at::Tensor& candidate, const at::Tensor& current) {
  return at::where(per_member(accept), candidate, current);
}

/// M^p by repeated squaring, p ≥ 1.
at::Tensor batched_power(const at::Tensor& M, int64_t p) {
  at::Tensor result;
  at::Tensor base = M;
  while (true) {
    if (p & 1) result = result.defined() ? at::bmm(result, base) : base;
    p >>= 1;
    if (p == 0) return result;
    base = at::bmm(base, base);
  }
}

double floor_of(const RootInvShampooConfig& s, const at::Tensor& A) {
  return s.tf32 && A.is_cuda() ? kFloorTf32 : kFloor;
}

struct BatchOutcome {
  at::Tensor values;
  at::Tensor converged;   // [n] bool
  at::Tensor iterations;  // [n] long
};

/// The coupled iteration for the root p of A (already regularized) from the scale z ([n, 1, 1]):
/// X ← z^(1/p)·I, M ← z·A, then X ← X·M_p, M ← M_p^p·M with M_p = polynomial(M, I, k) at
/// iteration k (from 0), until max|M − I| ≤ tolerance.
template <typename Polynomial>
BatchOutcome coupled_iteration(const at::Tensor& A, int64_t p, const at::Tensor& z,
                               const RootInvShampooConfig& s, Polynomial&& polynomial) {
  const auto eye = at::eye(A.size(1), A.options());
  auto X = eye * at::pow(z, 1.0 / static_cast<double>(p));
  auto M = A * z;
  Progress progress(distance_to_identity(M, eye), s.tolerance, floor_of(s, A));
  int64_t k = 0;
  iterate(progress, s.max_iterations, [&] {
    const auto Mp = polynomial(M, eye, k++);
    const auto X_next = at::bmm(X, Mp);
    const auto M_next = at::bmm(batched_power(Mp, p), M);
    const auto accept = progress.advance(distance_to_identity(M_next, eye));
    X = keep(accept, X_next, X);
    M = keep(accept, M_next, M);
  });
  return {X, progress.converged(), progress.iterations()};
}

/// Newton's step polynomial M_p = (1 + 1/p)·I − M/p.
at::Tensor newton_polynomial(const at::Tensor& M, const at::Tensor& eye, int64_t p) {
  const double alpha = -1.0 / static_cast<double>(p);
  return M * alpha + eye * (1.0 - alpha);
}

/// The reference's coupled inverse Newton iteration: z = (p + 1) / (2‖A‖_F), Newton's step
/// polynomial throughout.
BatchOutcome coupled_newton(const at::Tensor& A, int64_t p, const RootInvShampooConfig& s) {
  const auto z = per_member((p + 1.0) / (2.0 * at::linalg_vector_norm(A, 2, {1, 2})));
  return coupled_iteration(A, p, z, s, [p](const at::Tensor& M, const at::Tensor& eye, int64_t) {
    return newton_polynomial(M, eye, p);
  });
}

/// The coefficients b_0..b_{order−1} of the reference's higher-order step for the root p: the
/// first terms of the binomial series of (1 − x)^(−1/p), b_i = Π_{j<i} (1 + j·p) / ((j + 1)·p).
std::vector<double> higher_order_coefficients(int64_t order, int64_t p) {
  std::vector<double> b{1.0};
  double numerator = 1.0;
  double denominator = 1.0;
  for (int64_t i = 1; i < order; ++i) {
    numerator *= 1.0 + static_cast<double>((i - 1) * p);
    denominator *= static_cast<double>(i * p);
    b.push_back(numerator / denominator);
  }
  return b;
}

/// The reference's coupled higher-order iteration (docs/math.md "Coupled higher order"):
/// z = 1/tr(A); the first step is Newton's, every later one M_p = Σ_i b_i·(I − M)^i by Horner's
/// rule.
BatchOutcome coupled_higher_order(const at::Tensor& A, int64_t p, const RootInvShampooConfig& s) {
  const auto z = per_member(1.0 / A.diagonal(0, 1, 2).sum(1));
  const auto b = higher_order_coefficients(s.order, p);
  return coupled_iteration(A, p, z, s, [&](const at::Tensor& M, const at::Tensor& eye, int64_t k) {
    if (k == 0) return newton_polynomial(M, eye, p);
    const auto base = eye - M;
    auto Mp = base * b[s.order - 1] + eye * b[s.order - 2];
    for (int64_t i = s.order - 3; i >= 0; --i) Mp = at::bmm(Mp, base) + eye * b[i];
    return Mp;
  });
}

/// λ_max estimate per matrix (≤ λ_max) by a power iteration on kPowerVectors fixed vectors:
/// the largest ‖A·v‖ over the unit vectors v of the last iteration. [n].
at::Tensor power_iteration_estimate(const at::Tensor& A) {
  const int64_t n = A.size(0);
  const int64_t d = A.size(1);
  auto generator = at::make_generator<at::CPUGeneratorImpl>(kPowerSeed);
  auto V = at::randn({d, kPowerVectors}, generator, at::TensorOptions().dtype(at::kDouble))
               .to(A.options())
               .expand({n, d, kPowerVectors});
  at::Tensor norms;
  for (int64_t k = 0; k < kPowerIterations; ++k) {
    const auto W = at::bmm(A, V.contiguous());
    norms = at::linalg_vector_norm(W, 2, {1}, /*keepdim=*/true);  // [n, 1, r]
    V = W / norms;
  }
  return norms.amax({1, 2});
}

/// One coupled Newton–Schulz pass for the square root of B (eigenvalues in (0, 3)):
/// Y ← Y·T, Z ← T·Z, T = (3·I − Z·Y)/2, Y₀ = B, Z₀ = I; Y → B^(1/2), Z → B^(−1/2).
struct SquareRoots {
  at::Tensor root, inverse_root;
  BatchOutcome outcome;
};
SquareRoots newton_db_pass(const at::Tensor& B, const RootInvShampooConfig& s) {
  const auto eye = at::eye(B.size(1), B.options());
  auto Y = B;
  auto Z = eye.expand(B.sizes()).contiguous();
  auto P = B;  // Z·Y
  Progress progress(distance_to_identity(P, eye), s.tolerance, floor_of(s, B));
  iterate(progress, s.max_iterations, [&] {
    const auto T = eye * 1.5 - P * 0.5;
    const auto Y_next = at::bmm(Y, T);
    const auto Z_next = at::bmm(T, Z);
    const auto P_next = at::bmm(Z_next, Y_next);
    const auto accept = progress.advance(distance_to_identity(P_next, eye));
    Y = keep(accept, Y_next, Y);
    Z = keep(accept, Z_next, Z);
    P = keep(accept, P_next, P);
  });
  return {Y, Z, {at::Tensor(), progress.converged(), progress.iterations()}};
}

/// A^(−1/p), p = 2^k: scale B = A/s with s = min(‖A‖_F, margin·λ̂_max), then k square-root
/// passes (each on the previous pass's root), X = s^(−1/p)·Z_k.
BatchOutcome newton_db(const at::Tensor& A, int64_t p, const RootInvShampooConfig& s) {
  const auto frobenius = at::linalg_vector_norm(A, 2, {1, 2});
  const auto scale = per_member(at::minimum(frobenius, power_iteration_estimate(A) * kScaleMargin));
  auto B = A / scale;
  at::Tensor converged, iterations, Z;
  for (int64_t q = 1; q < p; q *= 2) {
    auto pass = newton_db_pass(B, s);
    converged = converged.defined() ? converged & pass.outcome.converged : pass.outcome.converged;
    iterations =
        iterations.defined() ? iterations + pass.outcome.iterations : pass.outcome.iterations;
    B = pass.root;
    Z = pass.inverse_root;
  }
  return {Z * at::pow(scale, -1.0 / static_cast<double>(p)), converged, iterations};
}

/// The reference's Newton–Schulz inverse root of A (regularized), p = 2^k, k ≥ 1
/// (docs/math.md "Newton–Schulz"): k passes; each scales B by α = max(‖B‖_F, 1e-8), starts
/// Y = B/α, Z = I, and for every (a, b, c) of the schedule sets T = Z·Y, P = b·T + c·T²,
/// Y ← a·Y + Y·P, Z ← a·Z + P·Z (p(x) = a·x + b·x³ + c·x⁵ on the square roots of Y's
/// eigenvalues); the next pass takes B = √α·Y (B^(1/2)), the last returns Z/√α. No convergence
/// check: a member is accepted when its result is finite and max|Z·Y − I| ≤ kNewtonSchulzResidual
/// after every pass (the reference keeps any result; a rejected one is computed by eigh).
BatchOutcome newton_schulz(const at::Tensor& A, int64_t p, const RootInvShampooConfig& s) {
  const auto eye = at::eye(A.size(1), A.options());
  auto B = A;
  at::Tensor Z;
  auto accepted = at::ones({A.size(0)}, A.options().dtype(at::kBool));
  int64_t passes = 0;
  for (int64_t q = p; q > 1; q /= 2, ++passes) {
    const auto alpha = per_member(at::clamp_min(at::linalg_vector_norm(B, 2, {1, 2}), 1e-8));
    auto Y = B / alpha;
    Z = eye.expand(B.sizes()).contiguous();
    for (const auto& [a, b, c] : s.coefficients) {
      const auto T = at::bmm(Z, Y);
      const auto P = at::baddbmm(T, T, T, b, c);
      Y = at::baddbmm(Y, Y, P, a, 1.0);
      Z = at::baddbmm(Z, P, Z, a, 1.0);
    }
    const auto residual = distance_to_identity(at::bmm(Z, Y), eye);
    accepted = accepted & (residual <= kNewtonSchulzResidual);
    if (q > 2) {
      B = Y * at::sqrt(alpha);
    } else {
      Z = Z / at::sqrt(alpha);
    }
  }
  const auto steps = passes * static_cast<int64_t>(s.coefficients.size());
  return {Z, accepted, at::full({A.size(0)}, steps, A.options().dtype(at::kLong))};
}

BatchOutcome solve_batch(const at::Tensor& A, const at::Tensor& eps, int64_t root,
                         const RootInvShampooConfig& s) {
  const auto eye = at::eye(A.size(1), A.options());
  if (s.solver == RootSolver::kCoupledHigherOrder) {
    // The reference's regularization: max(rel·‖A‖∞, abs)·I, ‖A‖∞ the largest absolute row sum;
    // the Shampoo ε (`eps`) does not enter.
    const auto norm = A.abs().sum(2).amax(1);
    const auto ridge = per_member(at::clamp_min(norm * s.rel_epsilon, s.abs_epsilon));
    auto out = coupled_higher_order(A + eye * ridge, root, s);
    out.converged = out.converged & at::isfinite(out.values).flatten(1).all(1);
    return out;
  }
  if (s.solver == RootSolver::kNewtonSchulz) {
    // The reference's ridge: the Shampoo ε floored at relative_epsilon·‖A‖_F.
    const auto floor = per_member(at::linalg_vector_norm(A, 2, {1, 2})) * s.relative_epsilon;
    auto out = newton_schulz(A + eye * at::maximum(floor, eps), root, s);
    out.converged = out.converged & at::isfinite(out.values).flatten(1).all(1);
    return out;
  }
  const auto regularized = A + eye * eps;
  auto out = s.solver == RootSolver::kNewtonDB ? newton_db(regularized, root, s)
                                               : coupled_newton(regularized, root, s);
  out.converged = out.converged & at::isfinite(out.values).flatten(1).all(1);
  return out;
}

/// Members per batch: one on CPU (every matrix alone, from its own aligned allocation, so that
/// the result cannot depend on the batch), a workspace-bounded share on CUDA.
int64_t batch_size(const at::Tensor& A) {
  if (!A.is_cuda()) return 1;
  const int64_t member = A.size(1) * A.size(1) * static_cast<int64_t>(A.element_size());
  return std::max<int64_t>(1, kWorkspaceBytes / (kLiveMatricesPerMember * member));
}

}  // namespace

bool power_of_two_root(int64_t root) { return root >= 2 && (root & (root - 1)) == 0; }

int64_t integer_root(double exponent) {
  if (!(exponent > 0.0)) return 0;
  const double p = 1.0 / exponent;
  const double rounded = std::round(p);
  return rounded >= 1.0 && std::abs(p - rounded) <= 1e-9 * rounded ? static_cast<int64_t>(rounded)
                                                                   : 0;
}

IterativeRootResult iterative_inverse_root(const at::Tensor& A, const std::vector<double>& epsilons,
                                           int64_t root, const RootInvShampooConfig& settings) {
  TORCH_INTERNAL_ASSERT(A.dim() == 3 && A.size(1) == A.size(2) && root >= 1);
  TORCH_INTERNAL_ASSERT(
      (settings.solver != RootSolver::kNewtonDB && settings.solver != RootSolver::kNewtonSchulz) ||
      power_of_two_root(root));
  const int64_t n = A.size(0);
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(epsilons.size()) == n);
  const Tf32Mode tf32(settings.tf32 && A.is_cuda());
  const auto eps = per_member(host_to_device(
      at::tensor(epsilons, at::TensorOptions().dtype(at::kDouble)), A.device(), A.scalar_type()));
  IterativeRootResult result{at::empty_like(A), {}, {}};
  std::vector<at::Tensor> converged, iterations;
  const int64_t step = batch_size(A);
  for (int64_t start = 0; start < n; start += step) {
    const int64_t len = std::min(step, n - start);
    auto member = A.narrow(0, start, len);
    if (!A.is_cuda()) member = member.clone();  // a fresh, aligned allocation
    auto out = solve_batch(member, eps.narrow(0, start, len), root, settings);
    result.values.narrow(0, start, len).copy_(out.values);
    converged.push_back(out.converged);
    iterations.push_back(out.iterations);
  }
  if (n == 0) return result;
  // One copy to the host for the whole stack, read there (not one tensor per matrix).
  const auto all_converged = at::cat(converged).cpu().contiguous();
  const auto all_iterations = at::cat(iterations).cpu().contiguous();
  const bool* converged_data = all_converged.data_ptr<bool>();
  const int64_t* iterations_data = all_iterations.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    result.converged.push_back(converged_data[i]);
    result.iterations.push_back(iterations_data[i]);
  }
  return result;
}

}  // namespace shampoo::detail
