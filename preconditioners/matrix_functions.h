#pragma once
/// Matrix functions of stacks of symmetric matrices: inverse roots and eigenbases through a
/// symmetric eigendecomposition with a float64 retry, and one QR (subspace) iteration step.
/// All functions take stacks [n, d, d] and treat each matrix independently: the result for one
/// matrix does not depend on the others in the stack (the distributed engine relies on that).

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "preconditioners/iterative_roots.h"

namespace shampoo::detail {

/// Outcome of a stacked matrix function: `values` [n, d, d] in the input dtype; `failed[i]` when
/// matrix i could be decomposed neither in its own dtype nor (when allowed) in float64, in which
/// case values[i] is unspecified and the caller keeps its previous result.
struct StackedMatrixResult {
  at::Tensor values;
  std::vector<bool> failed;
  /// Matrices that needed the float64 retry (diagnostics).
  int64_t retried_in_double = 0;
  /// Matrices an iterative solver left unconverged, computed by eigh instead (diagnostics).
  int64_t solver_fallbacks = 0;
};

/// X_i = (A_i + ε_i·I)^(−exponent_i) for every matrix of the stack A [n, d, d].
/// Where the smallest eigenvalue λ_min of A + ε·I is below ε, every eigenvalue is shifted in two
/// steps, λ ← λ − λ_min then λ ← λ + ε, so the smallest is exactly ε (docs/math.md). A non-finite
/// input matrix is an error (c10::Error naming the matrix index); the caller checks its own
/// context first to give a better message. `exponents[i] == 0` gives the identity.
///
/// With `iterative`, the matrices whose root p = 1/exponent is an integer are computed by that
/// matmul-only solver (iterative_roots.h; Newton–DB routes roots that are not powers of two to
/// coupled Newton), no eigenvalue shift: X = (A + ε·I)^(−1/p). Matrices it leaves unconverged,
/// and non-integer roots, are computed by eigh as above.
StackedMatrixResult stacked_inverse_root(const at::Tensor& A, const std::vector<double>& epsilons,
                                         const std::vector<double>& exponents,
                                         bool retry_double_precision,
                                         const IterativeRootSettings* iterative = nullptr);

/// Eigenvectors Q_i (ascending eigenvalues) of every matrix of the stack A [n, d, d].
StackedMatrixResult stacked_eigenbasis(const at::Tensor& A, bool retry_double_precision);

/// One warm-started orthogonal (QR) iteration per matrix: Q_i ← qr(A_i · Q_prev_i) with the
/// previous columns taken by descending eigenvalue, the result ordered by ascending Rayleigh
/// quotient so it is a drop-in replacement for an eigh basis. Repeated, it converges to the
/// eigenbasis (the reference's single step in ascending order does not; see the test).
StackedMatrixResult stacked_eigenbasis_qr(const at::Tensor& A, const at::Tensor& previous_basis);

/// Per matrix: true when every entry of A[i] is finite. One reduction for the whole stack.
std::vector<bool> stacked_all_finite(const at::Tensor& A);

}  // namespace shampoo::detail
