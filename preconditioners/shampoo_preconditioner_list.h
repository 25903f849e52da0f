#pragma once
/// Root-inverse Shampoo: each block is multiplied along every preconditioned dim k by
/// X_k = (L_k / bc + ε·I)^(−e_k), the roots recomputed at amortized steps and identity until then.
/// With FactorStatistics::kKL (root-inverse KL-Shampoo) the factors accumulate the gradient
/// multiplied along the other dims by their current roots X_j.

#include "preconditioners/kronecker_factors.h"
#include "preconditioners/preconditioner_list.h"

namespace shampoo::detail {

class ShampooPreconditionerList final : public PreconditionerList {
 public:
  ShampooPreconditionerList(std::vector<StackSpec> stacks, MatrixPreconditionerSettings settings);

  void update(int64_t stack, const Rows& rows, const at::Tensor& gradients,
              const RowScalars& scalars, const std::vector<bool>& amortize) override;
  using PreconditionerList::precondition;
  void precondition(int64_t stack, const Rows& rows, const at::Tensor& filtered,
                    const RowScalars& scalars, at::Tensor& out) const override;
  std::map<std::string, at::Tensor> export_member(int64_t stack, int64_t row) const override;
  void import_member(int64_t stack, int64_t row,
                     const std::map<std::string, at::Tensor>& state) override;
  bool identity_before_amortization() const override { return true; }
  const AmortizedCounters& counters() const override { return factors_.counters(); }
  void set_counters(const AmortizedCounters& counters) override { factors_.set_counters(counters); }
  bool amortization_may_raise(int64_t stack, const Rows& rows, const RowScalars& scalars,
                              const std::vector<double>& gradient_bound) const override {
    return factors_.may_raise(stack, rows, scalars, gradient_bound);
  }
  int64_t state_bytes() const override;

  /// The current inverse roots of stack `stack` along `dim` ([n, d, d]); for tests.
  const at::Tensor& roots(int64_t stack, int64_t dim) const { return roots_[stack][dim]; }

 private:
  /// Bound of the factor bytes one root computation works on at once.
  static constexpr int64_t kRootChunkBytes = int64_t{32} << 20;

  void compute_roots(int64_t stack, const Rows& rows, const RowScalars& scalars);
  void compute_root_chunk(int64_t stack, const Rows& rows, const RowScalars& scalars);

  KroneckerFactors factors_;
  std::vector<std::vector<at::Tensor>> roots_;  // [stack][dim] -> [n, d, d]
};

}  // namespace shampoo::detail
