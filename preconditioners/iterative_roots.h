#pragma once
/// Matmul-only inverse roots of stacks of symmetric positive definite matrices (docs/math.md,
/// "Inverse-root solvers"): the coupled inverse Newton iteration with the reference's semantics,
/// and coupled Newton–Schulz (inverse-free Denman–Beavers) square-root passes scaled by a power
/// iteration. Every matrix of a batch iterates on its own: a matrix stops when it has converged
/// (or reached its precision floor) and is then frozen, so its result and iteration count do not
/// depend on the other matrices of the batch. Convergence is checked on the device; the host
/// reads the batch's "anyone still active" flag once every few iterations, never per matrix.

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace shampoo::detail {

enum class IterativeRootMethod {
  kCoupledNewton,  ///< X ← X·M_p, M ← M_p^p·M with M_p = (1 + 1/p)·I − M/p (Frobenius scaling)
  kNewtonDB,       ///< Y ← Y·T, Z ← T·Z with T = (3·I − Z·Y)/2, log2(p) passes
};

struct IterativeRootSettings {
  IterativeRootMethod method = IterativeRootMethod::kCoupledNewton;
  /// Iteration budget per matrix (per pass for Newton–DB).
  int64_t max_iterations = 100;
  /// A matrix has converged when max|M − I| ≤ tolerance (M = Z·Y for Newton–DB).
  double tolerance = 1e-6;
  /// TensorFloat-32 matrix products on CUDA (no effect on CPU).
  bool tf32 = false;
};

struct IterativeRootResult {
  /// [n, d, d] in the input dtype; rows of matrices that did not converge are unspecified.
  at::Tensor values;
  /// Converged within the budget to the tolerance or to the precision floor, and finite.
  std::vector<bool> converged;
  /// Iterations each matrix took (all passes).
  std::vector<int64_t> iterations;
};

/// X_i ≈ (A_i + ε_i·I)^(−1/root) for the stack A [n, d, d], ε [n] (as `epsilons`), root ≥ 1.
/// Newton–DB needs root a power of two; callers route other roots to coupled Newton.
IterativeRootResult iterative_inverse_root(const at::Tensor& A, const std::vector<double>& epsilons,
                                           int64_t root, const IterativeRootSettings& settings);

/// Whether Newton–DB computes the root `root` (a power of two ≥ 2).
bool newton_db_supports(int64_t root);

/// The integer root p with exponent == 1/p (up to rounding), or 0 when 1/exponent is not an
/// integer.
int64_t integer_root(double exponent);

}  // namespace shampoo::detail
