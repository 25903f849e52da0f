#pragma once
/// Eigendecomposed Shampoo (docs/math.md, "Eigendecomposed Shampoo"): per preconditioned block dim
/// k the eigendecomposition Q_k·diag(λ_k)·Q_kᵀ of the factor A_k + ε·I (A_k = L_k / bc2),
/// recomputed at amortized steps by eigh or one warm-started QR step. Preconditioning forms
/// X_k = Q_k·diag(f(λ_k))·Q_kᵀ with the ε and exponent of the call (f: step 3's shift and power,
/// or the pseudo-inverse) and multiplies along every dim, as root-inverse Shampoo does with its
/// roots. Eigenvalues start at 1 and eigenvectors at I. With FactorStatistics::kKL (eigendecomposed
/// KL-Shampoo) the factors accumulate the gradient multiplied along the other dims by those X_j.

#include "preconditioners/kronecker_factor_list.h"

namespace shampoo::detail {

class EigendecomposedPreconditionerList final : public KroneckerFactorList {
 public:
  EigendecomposedPreconditionerList(std::vector<StackSpec> stacks,
                                    const EigendecomposedShampooConfig& config,
                                    MatrixPreconditionerSettings settings);

  /// A factor, its eigenvectors and its eigenvalues per preconditioned dim.
  static int64_t estimated_state_bytes(const EigendecomposedShampooConfig& /*config*/,
                                       const BlockLayout& layout) {
    return estimated_factor_bytes(layout, /*symmetric_per_dim=*/0, /*matrices_per_dim=*/1,
                                  /*vectors_per_dim=*/1);
  }

  using PreconditionerList::precondition;
  void precondition(int64_t stack, const Rows& rows, const at::Tensor& filtered,
                    const RowScalars& scalars, at::Tensor& out) const override;
  /// False: the preconditioner before the first decomposition is X_k = f(1)·I, which is I only
  /// for ε ≤ 1 (and no pseudo-inverse cut-off at 1); it is computed like any other.
  bool identity_before_amortization() const override { return false; }

  /// X_k of `rows` along `dim` from the kept decompositions with the rows' ε ([rows, d, d],
  /// factor dtype). Used by precondition() and by KL-Shampoo's statistics; for tests.
  at::Tensor inverse_roots(int64_t stack, const Rows& rows, int64_t dim,
                           const RowScalars& scalars) const;
  const at::Tensor& eigenvalues(int64_t stack, int64_t dim) const {
    return dim_state(eigenvalues_, stack, dim);
  }
  const at::Tensor& eigenvectors(int64_t stack, int64_t dim) const {
    return dim_state(eigenvectors_, stack, dim);
  }

 private:
  DimResult compute_dim(int64_t stack, const Rows& rows, int64_t dim,
                        const RowScalars& scalars) override;
  at::Tensor kl_operand(int64_t stack, const Rows& rows, int64_t dim,
                        const RowScalars& scalars) const override {
    return inverse_roots(stack, rows, dim, scalars);
  }

  EigendecomposedShampooConfig config_;
  int eigenvalues_;   // dim state "eigenvalues_<k>": [n, d]
  int eigenvectors_;  // dim state "eigenvectors_<k>": [n, d, d]
};

}  // namespace shampoo::detail
