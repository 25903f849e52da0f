#pragma once
/// Matrix functions of stacks of symmetric matrices: inverse roots and eigenbases through a
/// symmetric eigendecomposition with a float64 retry, and one QR (subspace) iteration step.
/// All functions take stacks [n, d, d] and treat each matrix independently: the result for one
/// matrix does not depend on the others in the stack (the distributed engine relies on that).

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "preconditioners/iterative_roots.h"
#include "preconditioners/preconditioner_configs.h"

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

/// Eigendecompositions of a stack [n, d, d]: eigenvalues [n, d] ascending and eigenvectors
/// [n, d, d] (columns), both in the stack's dtype (a float64 retry is cast back). `failed[i]`:
/// rows of matrix i unspecified, the caller keeps its previous decomposition.
struct StackedEigendecomposition {
  at::Tensor eigenvalues;
  at::Tensor eigenvectors;
  std::vector<bool> failed;
  int64_t retried_in_double = 0;
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
///
/// With `pseudo_inverse` (eigh only, `iterative` must be null; the epsilons are 0): the powers
/// of the eigenvalues of A are those of the pseudo-inverse, no shift.
/// The ε of every matrix of A [n, d, d] (positive semidefinite factors): epsilons[i] +
/// relative[i]·tr(A_i) (relative empty or 0: epsilons[i] as given). The trace is summed on the
/// host in float64 in index order, so a matrix's ε does not depend on the stack it sits in.
std::vector<double> regularization(const at::Tensor& A, const std::vector<double>& epsilons,
                                   const std::vector<double>& relative);

StackedMatrixResult stacked_inverse_root(const at::Tensor& A, const std::vector<double>& epsilons,
                                         const std::vector<double>& exponents,
                                         bool retry_double_precision,
                                         const RootInvShampooConfig* iterative = nullptr,
                                         const PseudoInverseConfig* pseudo_inverse = nullptr);

/// Eigenvalues and eigenvectors of every matrix of A [n, d, d] by eigh, retried in float64 when
/// allowed and cast back to A's dtype.
StackedEigendecomposition stacked_eigendecomposition(const at::Tensor& A,
                                                     bool retry_double_precision);
/// stacked_eigenbasis_qr's basis with its Rayleigh quotients qᵀ·A·q as eigenvalues (ascending).
StackedEigendecomposition stacked_eigendecomposition_qr(const at::Tensor& A,
                                                        const at::Tensor& previous_basis);

/// X_i = Q_i·diag(f(λ_i))·Q_iᵀ from kept eigendecompositions (λ [n, d] ascending, Q [n, d, d]):
/// f(λ) = λ^(−exponent_i) after step 3's shift where λ_min < ε_i, or with `pseudo_inverse` the
/// pseudo-inverse powers (ε unused). `exponents[i] == 0` gives the identity. On the CPU every
/// matrix is computed on its own (results independent of the stack); CUDA stacks at once.
at::Tensor stacked_inverse_root_from_eigendecomposition(
    const at::Tensor& eigenvalues, const at::Tensor& eigenvectors,
    const std::vector<double>& epsilons, const std::vector<double>& exponents,
    const PseudoInverseConfig* pseudo_inverse = nullptr);

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
