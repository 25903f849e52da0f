#pragma once
/// Diagonal methods as the main preconditioner: SGD (P = Ḡ), AdaGrad, RMSprop and Adam, one
/// second moment V per block (block shape, the parameter's dtype) updated every step from G′
/// (after L2 weight decay) and applied to the filtered gradient Ḡ:
///   V ← β2·V + w·G′²,  P = Ḡ / (sqrt(V / bc2) + ε),  bc2 = 1 − β2^t with bias correction, else 1.
/// docs/math.md, "Diagonal main preconditioners".

#include "preconditioners/preconditioner_list.h"

namespace shampoo::detail {

class DiagonalPreconditionerList final : public PreconditionerList {
 public:
  /// SGD, AdaGrad, RMSprop or Adam (the family's coefficients: diagonal_coefficients).
  DiagonalPreconditionerList(std::vector<StackSpec> stacks, const DiagonalConfig& config,
                             const MatrixPreconditionerSettings& settings = {});

  /// The second moment V (the block's size in the blocks' dtype); none for SGD.
  static int64_t estimated_state_bytes(const DiagonalConfig& config, const BlockLayout& layout) {
    return diagonal_coefficients(config, 1).has_state ? layout.numel() * layout.state_element_size
                                                      : 0;
  }

  /// Every diagonal family is one formula per element.
  bool elementwise() const override { return true; }
  ElementwiseDirection elementwise_direction(int64_t stack, int64_t row, int64_t step) override;

  void update(int64_t stack, const Rows& rows, const at::Tensor& gradients,
              const RowScalars& scalars, const std::vector<bool>& amortize) override;
  using PreconditionerList::precondition;
  void precondition(int64_t stack, const Rows& rows, const at::Tensor& filtered,
                    const RowScalars& scalars, at::Tensor& out) const override;
  std::map<std::string, at::Tensor> export_member(int64_t stack, int64_t row) const override;
  void import_member(int64_t stack, int64_t row,
                     const std::map<std::string, at::Tensor>& state) override;
  /// AdaGrad/RMSprop/Adam divide by their second moment from the first step on; SGD is the
  /// identity but has no amortized computation that would ever change it, so it runs as well.
  bool identity_before_amortization() const override { return false; }
  const AmortizedCounters& counters() const override { return counters_; }
  void set_counters(const AmortizedCounters& counters) override { counters_ = counters; }
  void add_memory(MemorySummary& out) const override;

  /// The second moment of stack `stack` ([n, block_shape]; undefined for SGD); for tests.
  const at::Tensor& second_moment(int64_t stack) const { return second_moments_[stack]; }

 private:
  std::vector<StackSpec> stacks_;
  DiagonalConfig config_;
  DiagonalCoefficients coefficients_;       // at step 1: what does not depend on the step
  std::vector<at::Tensor> second_moments_;  // [stack] -> [n, block_shape]
  AmortizedCounters counters_;
};

}  // namespace shampoo::detail
