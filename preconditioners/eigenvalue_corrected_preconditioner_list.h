#pragma once
/// Eigenvalue-corrected Shampoo (SOAP): per block dim k an eigenbasis Q_k of the Kronecker factor
/// (recomputed at amortized steps, by eigh of L_k / bc + ε·I or one QR step warm-started from the
/// previous basis), and an Adam-style second moment D of the gradient rotated into those bases
/// (block shape). Preconditioning rotates Ḡ in, divides by sqrt(D / bc2) + ε and rotates back.
/// With the identity bases of the first steps it is Adam (β2 < 1) or AdaGrad (β2 = 1).

#include "preconditioners/kronecker_factor_list.h"

namespace shampoo::detail {

class EigenvalueCorrectedPreconditionerList final : public KroneckerFactorList {
 public:
  EigenvalueCorrectedPreconditionerList(std::vector<StackSpec> stacks,
                                        const EigenvalueCorrectedShampooConfig& config,
                                        MatrixPreconditionerSettings settings);

  /// A factor and its eigenbasis per preconditioned dim, and the corrected second moment (the
  /// block's size in the blocks' dtype).
  static int64_t estimated_state_bytes(const EigenvalueCorrectedShampooConfig& /*config*/,
                                       const BlockLayout& layout) {
    return estimated_factor_bytes(layout, /*symmetric_per_dim=*/0, /*matrices_per_dim=*/1,
                                  /*vectors_per_dim=*/0) +
           layout.numel() * layout.state_element_size;
  }

  using PreconditionerList::precondition;
  void precondition(int64_t stack, const Rows& rows, const at::Tensor& filtered,
                    const RowScalars& scalars, at::Tensor& out) const override;
  bool identity_before_amortization() const override { return false; }

  const at::Tensor& basis(int64_t stack, int64_t dim) const {
    return dim_state(bases_, stack, dim);
  }
  const at::Tensor& corrections(int64_t stack) const { return block_state(corrections_, stack); }

 private:
  DimResult compute_dim(int64_t stack, const Rows& rows, int64_t dim,
                        const RowScalars& scalars) override;
  /// The second moment of the gradient rotated into the (new) bases.
  void after_update(int64_t stack, const Rows& rows, const at::Tensor& gradients,
                    const RowScalars& scalars) override;
  /// Applies Q_kᵀ (into the bases, `back` false) or Q_k (back) along every rotated dim.
  at::Tensor rotate(int64_t stack, const Rows& rows, const at::Tensor& blocks, bool back) const;

  EigenvalueCorrectedShampooConfig config_;
  int bases_;        // dim state "basis_<k>": [n, d, d]
  int corrections_;  // block state "corrections": [n, block_shape]
};

}  // namespace shampoo::detail
