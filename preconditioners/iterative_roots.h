#pragma once
/// Matmul-only inverse roots of stacks of symmetric positive definite matrices (docs/math.md,
/// "Inverse-root solvers"): the coupled inverse Newton iteration with the reference's semantics,
/// coupled Newton–Schulz (inverse-free Denman–Beavers) square-root passes scaled by a power
/// iteration, the reference's coupled higher-order iteration, and the reference's fixed-schedule
/// Newton–Schulz passes (no convergence check, no host read during the iteration). Every matrix of
/// a batch iterates on its own: a matrix stops when it has converged (or reached its precision
/// floor) and is then frozen, so its result and iteration count do not depend on the other matrices
/// of the batch. Convergence is checked on the device; the host reads the batch's "anyone still
/// active" flag once every few iterations, never per matrix.

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "preconditioners/preconditioner_configs.h"

namespace shampoo::detail {

struct IterativeRootResult {
  /// [n, d, d] in the input dtype; rows of matrices that did not converge are unspecified.
  at::Tensor values;
  /// Converged within the budget to the tolerance or to the precision floor, and finite.
  std::vector<bool> converged;
  /// Iterations each matrix took (all passes).
  std::vector<int64_t> iterations;
};

/// X_i ≈ (A_i + ε_i·I)^(−1/root) for the stack A [n, d, d], ε [n] (as `epsilons`), root ≥ 1, by
/// `settings.solver` (kCoupledNewton, kNewtonDB, kCoupledHigherOrder or kNewtonSchulz) with its
/// max_iterations (per pass for Newton–DB), tolerance on max|M − I| and tf32 (Newton–Schulz: its
/// schedule, no tolerance). Newton–DB and Newton–Schulz need root a power of two; callers route
/// Newton–DB's other roots to coupled Newton, Newton–Schulz's are refused at construction.
IterativeRootResult iterative_inverse_root(const at::Tensor& A, const std::vector<double>& epsilons,
                                           int64_t root, const RootInvShampooConfig& settings);

/// Whether `root` is a power of two ≥ 2: the roots Newton–DB and Newton–Schulz compute.
bool power_of_two_root(int64_t root);

/// The integer root p with exponent == 1/p (up to rounding), or 0 when 1/exponent is not an
/// integer.
int64_t integer_root(double exponent);

}  // namespace shampoo::detail
