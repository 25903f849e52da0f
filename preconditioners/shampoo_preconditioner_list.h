#pragma once
/// Root-inverse Shampoo: each block is multiplied along every preconditioned dim k by
/// X_k = (L_k / bc + ε·I)^(−e_k), the roots recomputed at amortized steps and identity until then.
/// With FactorStatistics::kKL (root-inverse KL-Shampoo) the factors accumulate the gradient
/// multiplied along the other dims by their current roots X_j.

#include "preconditioners/kronecker_factor_list.h"

namespace shampoo::detail {

class ShampooPreconditionerList final : public KroneckerFactorList {
 public:
  ShampooPreconditionerList(std::vector<StackSpec> stacks, const RootInvShampooConfig& config,
                            MatrixPreconditionerSettings settings);

  /// A factor and its root per preconditioned dim (the root in the narrower of the factor and
  /// compute dtypes; KL-Shampoo's in the factor dtype).
  static int64_t estimated_state_bytes(const RootInvShampooConfig& /*config*/,
                                       const BlockLayout& layout) {
    return estimated_factor_bytes(layout, /*symmetric_per_dim=*/1, /*matrices_per_dim=*/0,
                                  /*vectors_per_dim=*/0, KeptDtype::kNarrowerOfFactorAndCompute);
  }
  static int64_t estimated_state_bytes(const RootInvKLShampooConfig& /*config*/,
                                       const BlockLayout& layout) {
    return estimated_factor_bytes(layout, /*symmetric_per_dim=*/1, /*matrices_per_dim=*/0,
                                  /*vectors_per_dim=*/0, KeptDtype::kFactor);
  }

  using PreconditionerList::precondition;
  void precondition(int64_t stack, const Rows& rows, const at::Tensor& filtered,
                    const RowScalars& scalars, at::Tensor& out) const override;
  bool identity_before_amortization() const override { return true; }

  /// The current inverse roots of stack `stack` along `dim`; for tests.
  const SymmetricMatrices& roots(int64_t stack, int64_t dim) const {
    return symmetric_state(roots_, stack, dim);
  }

 private:
  DimResult compute_dim(int64_t stack, const Rows& rows, int64_t dim,
                        const RowScalars& scalars) override;
  at::Tensor kl_operand(int64_t stack, const Rows& rows, int64_t dim,
                        const RowScalars& scalars) const override;

  RootInvShampooConfig config_;
  int roots_;  // symmetric dim state "root_<k>"
};

}  // namespace shampoo::detail
