#pragma once
/// Eigendecomposed Shampoo (docs/math.md, "Eigendecomposed Shampoo"): per preconditioned block dim
/// k the eigendecomposition Q_k·diag(λ_k)·Q_kᵀ of the factor A_k + ε·I (A_k = L_k / bc2),
/// recomputed at amortized steps by eigh or one warm-started QR step. Preconditioning forms
/// X_k = Q_k·diag(f(λ_k))·Q_kᵀ with the ε and exponent of the call (f: step 3's shift and power,
/// or the pseudo-inverse) and multiplies along every dim, as root-inverse Shampoo does with its
/// roots. Eigenvalues start at 1 and eigenvectors at I. With FactorStatistics::kKL (eigendecomposed
/// KL-Shampoo) the factors accumulate the gradient multiplied along the other dims by those X_j.

#include "preconditioners/kronecker_factors.h"
#include "preconditioners/preconditioner_list.h"

namespace shampoo::detail {

enum class EigendecompositionUpdate { kEigh, kQR };

class EigendecomposedPreconditionerList final : public PreconditionerList {
 public:
  EigendecomposedPreconditionerList(std::vector<StackSpec> stacks,
                                    MatrixPreconditionerSettings settings,
                                    EigendecompositionUpdate method);

  void update(int64_t stack, const Rows& rows, const at::Tensor& gradients,
              const RowScalars& scalars, const std::vector<bool>& amortize) override;
  using PreconditionerList::precondition;
  void precondition(int64_t stack, const Rows& rows, const at::Tensor& filtered,
                    const RowScalars& scalars, at::Tensor& out) const override;
  std::map<std::string, at::Tensor> export_member(int64_t stack, int64_t row) const override;
  void import_member(int64_t stack, int64_t row,
                     const std::map<std::string, at::Tensor>& state) override;
  /// False: the preconditioner before the first decomposition is X_k = f(1)·I, which is I only
  /// for ε ≤ 1 (and no pseudo-inverse cut-off at 1); it is computed like any other.
  bool identity_before_amortization() const override { return false; }
  const AmortizedCounters& counters() const override { return factors_.counters(); }
  void set_counters(const AmortizedCounters& counters) override { factors_.set_counters(counters); }
  bool amortization_may_raise(int64_t stack, const Rows& rows, const RowScalars& scalars,
                              const std::vector<double>& gradient_bound) const override {
    return factors_.may_raise(stack, rows, scalars, gradient_bound);
  }
  int64_t state_bytes() const override;

  /// X_k of `rows` along `dim` from the kept decompositions with the rows' ε ([rows, d, d],
  /// factor dtype). Used by precondition() and by KL-Shampoo's statistics; for tests.
  at::Tensor inverse_roots(int64_t stack, const Rows& rows, int64_t dim,
                           const RowScalars& scalars) const;
  const at::Tensor& eigenvalues(int64_t stack, int64_t dim) const {
    return eigenvalues_[stack][dim];
  }
  const at::Tensor& eigenvectors(int64_t stack, int64_t dim) const {
    return eigenvectors_[stack][dim];
  }

 private:
  void compute_decompositions(int64_t stack, const Rows& rows, const RowScalars& scalars);
  StackedEigendecomposition decompose_dim(int64_t stack, const Rows& rows, int64_t dim,
                                          const RowScalars& scalars) const;

  KroneckerFactors factors_;
  EigendecompositionUpdate method_;
  std::vector<std::vector<at::Tensor>> eigenvalues_;   // [stack][dim] -> [n, d]
  std::vector<std::vector<at::Tensor>> eigenvectors_;  // [stack][dim] -> [n, d, d]
};

}  // namespace shampoo::detail
