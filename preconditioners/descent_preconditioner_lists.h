#pragma once
/// The stateless descent methods: spectral descent (the orthogonalized direction U·Vᵀ of each
/// 2-D block, Muon-style) and sign descent (sign(Ḡ) times a per-block scale). Neither keeps
/// statistics nor has an amortized computation: update() does nothing, precondition() maps Ḡ to
/// the direction. docs/math.md, "Spectral descent" and "Sign descent".

#include "preconditioners/orthogonalization.h"
#include "preconditioners/preconditioner_list.h"

namespace shampoo::detail {

/// What the stateless lists share: no state, no amortized computation, zero counters.
class StatelessPreconditionerList : public PreconditionerList {
 public:
  explicit StatelessPreconditionerList(std::vector<StackSpec> stacks)
      : stacks_(std::move(stacks)) {}

  void update(int64_t /*stack*/, const Rows& /*rows*/, const at::Tensor& /*gradients*/,
              const RowScalars& /*scalars*/, const std::vector<bool>& /*amortize*/) override {}
  std::map<std::string, at::Tensor> export_member(int64_t /*stack*/,
                                                  int64_t /*row*/) const override {
    return {};
  }
  void import_member(int64_t /*stack*/, int64_t /*row*/,
                     const std::map<std::string, at::Tensor>& /*state*/) override {}
  /// The direction is never Ḡ itself, from the first step on.
  bool identity_before_amortization() const override { return false; }
  const AmortizedCounters& counters() const override { return counters_; }
  void set_counters(const AmortizedCounters& counters) override { counters_ = counters; }
  void add_memory(MemorySummary& /*out*/) const override {}

 protected:
  int64_t num_stacks() const { return static_cast<int64_t>(stacks_.size()); }
  const StackSpec& spec(int64_t stack) const { return stacks_[stack]; }

 private:
  std::vector<StackSpec> stacks_;
  AmortizedCounters counters_;
};

/// Spectral descent: P = U·Vᵀ (times the configured scale) of each block Ḡ = U·S·Vᵀ. Every
/// stack must hold 2-D blocks (checked here as an invariant; the engine reports a user's
/// non-2-D parameter by name at construction).
class SpectralDescentPreconditionerList final : public StatelessPreconditionerList {
 public:
  SpectralDescentPreconditionerList(std::vector<StackSpec> stacks,
                                    const SpectralDescentConfig& config,
                                    const MatrixPreconditionerSettings& settings = {});

  static int64_t estimated_state_bytes(const SpectralDescentConfig& /*config*/,
                                       const BlockLayout& /*layout*/) {
    return 0;
  }
  /// Blocking merges a parameter's dims down to matrices (distributor/block_plan.h), as the
  /// reference requires a target dimensionality of 2 with it.
  static constexpr int64_t kBlockOrder = 2;

  using PreconditionerList::precondition;
  void precondition(int64_t stack, const Rows& rows, const at::Tensor& filtered,
                    const RowScalars& scalars, at::Tensor& out) const override;

 private:
  SpectralDescentConfig config_;
};

/// Sign descent: P = sign(Ḡ)·scale, scale 1 or Σ|Ḡ| of the block; any block order.
class SignDescentPreconditionerList final : public StatelessPreconditionerList {
 public:
  SignDescentPreconditionerList(std::vector<StackSpec> stacks, const SignDescentConfig& config,
                                const MatrixPreconditionerSettings& /*settings*/ = {})
      : StatelessPreconditionerList(std::move(stacks)), scale_(config.scale) {}

  static int64_t estimated_state_bytes(const SignDescentConfig& /*config*/,
                                       const BlockLayout& /*layout*/) {
    return 0;
  }

  /// With scale 1, sign(Ḡ) is one formula per element; Σ|Ḡ| needs the whole block.
  bool elementwise() const override { return scale_ == SignDescentScale::kOne; }
  ElementwiseDirection elementwise_direction(int64_t /*stack*/, int64_t /*row*/,
                                             int64_t /*step*/) override {
    TORCH_INTERNAL_ASSERT(elementwise());
    return {ElementwiseDirection::Kind::kSign, {}, {}};
  }

  using PreconditionerList::precondition;
  void precondition(int64_t stack, const Rows& rows, const at::Tensor& filtered,
                    const RowScalars& scalars, at::Tensor& out) const override;

 private:
  SignDescentScale scale_;
};

}  // namespace shampoo::detail
