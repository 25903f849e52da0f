#pragma once
/// Diagonal methods (SGD, AdaGrad, RMSprop, Adam) on the preconditioner-list interface. Shampoo
/// uses them for grafting (each block's step takes the norm of the diagonal step) and as the
/// warm-up before preconditioning starts. Their statistics V live in stacks like the Kronecker
/// factors; in a Shampoo step they are updated by the fused elementwise chain
/// (preconditioners/elementwise_chain.h), which reads the coefficients from fill_chain_scalars().
/// The update()/precondition() methods here are the plain ATen formulation of the same math.

#include "preconditioners/elementwise_chain_kernels.h"
#include "preconditioners/preconditioner_list.h"

namespace shampoo::detail {

enum class DiagonalMethod { kNone, kSGD, kAdaGrad, kRMSprop, kAdam };

/// Float hyperparameters of a diagonal method (β2 is ignored by SGD and AdaGrad).
struct DiagonalHyperparams {
  double beta2 = 1.0;
  double epsilon = 1e-10;
};

/// Coefficients of V ← β2·V + w·G² and P = Ḡ / (sqrt(V / bc2) + ε) at step t (from 1).
struct DiagonalCoefficients {
  double beta2 = 1.0;
  double weight = 1.0;
  double bias_correction2 = 1.0;
  double epsilon = 0.0;
};
DiagonalCoefficients diagonal_coefficients(DiagonalMethod method, const DiagonalHyperparams& h,
                                           int64_t step);

/// Writes the diagonal fields of the chain scalars of one block.
void fill_chain_scalars(DiagonalMethod method, const DiagonalHyperparams& h, int64_t step,
                        kernels::ChainScalars& scalars);

class DiagonalPreconditionerList final : public PreconditionerList {
 public:
  DiagonalPreconditionerList(DiagonalMethod method, std::vector<StackSpec> stacks);

  DiagonalMethod method() const { return method_; }
  /// Whether the method keeps statistics V (AdaGrad, RMSprop, Adam).
  bool has_state() const;
  /// V of stack `stack` ([n, block_shape]); undefined without state.
  at::Tensor& state(int64_t stack) { return state_[stack]; }

  /// Per-row hyperparameters used by update()/precondition() (set before calling them).
  void set_row_hyperparams(std::vector<DiagonalHyperparams> h) { row_hyperparams_ = std::move(h); }

  void update(int64_t stack, const Rows& rows, const at::Tensor& gradients,
              const RowScalars& scalars, const std::vector<bool>& amortize) override;
  using PreconditionerList::precondition;
  void precondition(int64_t stack, const Rows& rows, const at::Tensor& filtered,
                    const RowScalars& scalars, at::Tensor& out) const override;
  std::map<std::string, at::Tensor> export_member(int64_t stack, int64_t row) const override;
  void import_member(int64_t stack, int64_t row,
                     const std::map<std::string, at::Tensor>& state) override;
  bool identity_before_amortization() const override { return false; }
  const AmortizedCounters& counters() const override { return counters_; }
  void set_counters(const AmortizedCounters& counters) override { counters_ = counters; }
  int64_t state_bytes() const override;

 private:
  DiagonalMethod method_;
  std::vector<StackSpec> stacks_;
  std::vector<at::Tensor> state_;
  std::vector<DiagonalHyperparams> row_hyperparams_;
  AmortizedCounters counters_;
};

}  // namespace shampoo::detail
