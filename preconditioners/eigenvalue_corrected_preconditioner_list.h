#pragma once
/// Eigenvalue-corrected Shampoo (SOAP): per block dim k an eigenbasis Q_k of the Kronecker factor
/// (recomputed at amortized steps, by eigh of L_k / bc + ε·I or one QR step warm-started from the
/// previous basis), and an Adam-style second moment D of the gradient rotated into those bases
/// (block shape). Preconditioning rotates Ḡ in, divides by sqrt(D / bc2) + ε and rotates back.
/// With the identity bases of the first steps it is Adam (β2 < 1) or AdaGrad (β2 = 1).

#include "preconditioners/kronecker_factors.h"
#include "preconditioners/preconditioner_list.h"

namespace shampoo::detail {

enum class EigenbasisUpdate { kEigh, kQR };

class EigenvalueCorrectedPreconditionerList final : public PreconditionerList {
 public:
  EigenvalueCorrectedPreconditionerList(std::vector<StackSpec> stacks,
                                        MatrixPreconditionerSettings settings,
                                        EigenbasisUpdate method);

  void update(int64_t stack, const Rows& rows, const at::Tensor& gradients,
              const RowScalars& scalars, const std::vector<bool>& amortize) override;
  using PreconditionerList::precondition;
  void precondition(int64_t stack, const Rows& rows, const at::Tensor& filtered,
                    const RowScalars& scalars, at::Tensor& out) const override;
  std::map<std::string, at::Tensor> export_member(int64_t stack, int64_t row) const override;
  void import_member(int64_t stack, int64_t row,
                     const std::map<std::string, at::Tensor>& state) override;
  bool identity_before_amortization() const override { return false; }
  const AmortizedCounters& counters() const override { return factors_.counters(); }
  void set_counters(const AmortizedCounters& counters) override { factors_.set_counters(counters); }
  bool amortization_may_raise(int64_t stack, const Rows& rows, const RowScalars& scalars,
                              const std::vector<double>& gradient_bound) const override {
    return factors_.may_raise(stack, rows, scalars, gradient_bound);
  }
  int64_t state_bytes() const override;

  const at::Tensor& basis(int64_t stack, int64_t dim) const { return bases_[stack][dim]; }
  const at::Tensor& corrections(int64_t stack) const { return corrections_[stack]; }

 private:
  void compute_bases(int64_t stack, const Rows& rows, const RowScalars& scalars);
  /// Applies Q_kᵀ (into the bases, `inverse` false) or Q_k (back) along every rotated dim.
  at::Tensor rotate(int64_t stack, const Rows& rows, const at::Tensor& blocks, bool back) const;

  KroneckerFactors factors_;
  EigenbasisUpdate method_;
  std::vector<std::vector<at::Tensor>> bases_;  // [stack][dim] -> [n, d, d]
  std::vector<at::Tensor> corrections_;         // [stack] -> [n, block_shape]
};

}  // namespace shampoo::detail
