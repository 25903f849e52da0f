#pragma once
/// Eigendecomposed Shampoo (docs/math.md, "Eigendecomposed Shampoo"): per preconditioned block dim
/// k the eigendecomposition Q_k·diag(λ_k)·Q_kᵀ of the factor A_k + ε·I (A_k = L_k / bc2),
/// recomputed at amortized steps by eigh or one warm-started QR step. Preconditioning forms
/// X_k = Q_k·diag(f(λ_k))·Q_kᵀ with the ε and exponent of the call (f: step 3's shift and power,
/// or the pseudo-inverse) and multiplies along every dim, as root-inverse Shampoo does with its
/// roots. Eigenvalues start at 1 and eigenvectors at I. With FactorStatistics::kKL (eigendecomposed
/// KL-Shampoo) the factors accumulate the gradient multiplied along the other dims by those X_j.
///
/// X_k changes only when the decomposition does (an amortized computation, an import) or the
/// member's ε does, so it is formed then and kept: a step between amortized computations
/// multiplies by the kept X_k, as root-inverse Shampoo does with its roots, instead of forming it
/// again (a d³ product per dim and step). The kept X_k are the very matrices a fresh computation
/// gives (the same operations), so the results do not change. They take a dense d×d matrix per
/// dim and member in the factor dtype (counted as inverse roots in memory_summary and in the
/// state-size estimate; not part of checkpoints, which keep the decompositions). With a compact
/// state (MatrixPreconditionerSettings::compact) nothing is kept and X_k is formed at every step,
/// as before: memory over time.

#include "preconditioners/kronecker_factor_list.h"

namespace shampoo::detail {

class EigendecomposedPreconditionerList final : public KroneckerFactorList {
 public:
  EigendecomposedPreconditionerList(std::vector<StackSpec> stacks,
                                    const EigendecomposedShampooConfig& config,
                                    MatrixPreconditionerSettings settings);

  /// A factor, its eigenvectors, its eigenvalues and (without a compact state) the kept X_k per
  /// preconditioned dim.
  static int64_t estimated_state_bytes(const EigendecomposedShampooConfig& /*config*/,
                                       const BlockLayout& layout) {
    const int64_t matrices = layout.compact == CompactState::kNone ? 2 : 1;
    return estimated_factor_bytes(layout, /*symmetric_per_dim=*/0, matrices,
                                  /*vectors_per_dim=*/1);
  }

  using PreconditionerList::precondition;
  void precondition(int64_t stack, const Rows& rows, const at::Tensor& filtered,
                    const RowScalars& scalars, at::Tensor& out) const override;
  /// False: the preconditioner before the first decomposition is X_k = f(1)·I, which is I only
  /// for ε ≤ 1 (and no pseudo-inverse cut-off at 1); it is computed like any other.
  bool identity_before_amortization() const override { return false; }
  /// The kept X_k.
  int64_t derived_state_bytes() const override;

  /// X_k of `rows` along `dim` formed from the kept decompositions with the rows' ε ([rows, d, d],
  /// factor dtype): what the kept X_k are set to; for tests.
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
    return kept_inverse_roots(stack, rows, dim, scalars);
  }
  void states_changed(int64_t stack, int64_t row) override;
  /// X_k of `rows` along `dim` ([rows, d, d]): the kept ones, formed first where stale (formed
  /// anew without kept ones).
  at::Tensor kept_inverse_roots(int64_t stack, const Rows& rows, int64_t dim,
                                const RowScalars& scalars) const;

  EigendecomposedShampooConfig config_;
  int eigenvalues_;   // dim state "eigenvalues_<k>": [n, d]
  int eigenvectors_;  // dim state "eigenvectors_<k>": [n, d, d]
  /// The kept X_k of a stack: per preconditioned dim [n, d, d] (undefined with a compact state),
  /// and per dim and member the ε it was formed with, or NaN when stale.
  struct KeptRoots {
    std::vector<at::Tensor> roots;
    std::vector<std::vector<double>> epsilon;
  };
  mutable std::vector<KeptRoots> kept_;
};

}  // namespace shampoo::detail
