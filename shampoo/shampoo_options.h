#pragma once
/// Options of DistributedShampoo: the per-group ShampooOptions (TORCH_ARG fluent setters, like
/// LibTorch's own optimizers) and the process-wide DistributedOptions. Defaults and meanings
/// follow the reference Python implementation; the math is in docs/math.md.

#include <c10/core/ScalarType.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <array>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <tuple>
#include <variant>

#include "update/grafting.h"

namespace shampoo {

// Grafting configs (SGDGraftingConfig, AdaGradGraftingConfig, RMSpropGraftingConfig,
// AdamGraftingConfig and the GraftingConfig variant) are in update/grafting.h, with the method
// table the step reads.

/// How root-inverse Shampoo computes its inverse roots (docs/math.md, "Inverse-root solvers").
enum class RootSolver {
  /// Symmetric eigendecomposition, retried in float64 when it fails: exact, the default (as the
  /// reference's default EigenConfig).
  kEigh,
  /// The reference's coupled inverse Newton iteration (its CoupledNewtonConfig): matrix products
  /// only, Frobenius-norm scaling. Needs integer roots (every exponent 1/p, p a positive integer).
  kCoupledNewton,
  /// Coupled Newton–Schulz (inverse-free Denman–Beavers) square-root iterations, scaled by a
  /// multi-vector power iteration; exponent 1/2^k in k passes. Other integer roots use coupled
  /// Newton.
  kNewtonDB,
};

/// Rank-deficient stability by perturbation (the default, the reference's PerturbationConfig with
/// its default perturb_before_computation = true): ε·I is added to the factor before the
/// eigendecomposition and eigenvalues below ε are shifted so the smallest is ε (docs/math.md
/// step 3). ShampooOptions::epsilon must be > 0.
struct PerturbationConfig {
  bool operator==(const PerturbationConfig&) const = default;
};

/// rank_rtol value meaning "d · machine epsilon of the factor dtype" (the reference's None).
inline constexpr double kDtypeRankRtol = -1.0;

/// Rank-deficient stability by pseudo-inverse (the reference's PseudoInverseConfig): no ε; every
/// eigenvalue λ ≤ max(rank_rtol · max(λ_max, 0), rank_atol) is dropped (its power is 0), the
/// others are raised to −e (docs/math.md, "Pseudo-inverse"). ShampooOptions::epsilon must be 0.
/// Only for eigenvalue-based roots: root-inverse Shampoo with RootSolver::kEigh and
/// eigendecomposed Shampoo (not eigenvalue-corrected Shampoo, as in the reference).
struct PseudoInverseConfig {
  /// Absolute threshold (≥ 0). The reference's default.
  double rank_atol = 0.0;
  /// Relative threshold (≥ 0), or kDtypeRankRtol. The reference's default.
  double rank_rtol = 0.0;
  bool operator==(const PseudoInverseConfig&) const = default;
};

/// How eigenvalue-based inverse roots treat rank-deficient factors (the reference's
/// rank_deficient_stability_config). Index = code in checkpoints: only append.
using RankDeficientStabilityConfig = std::variant<PerturbationConfig, PseudoInverseConfig>;

/// Root-inverse Shampoo (the default): each block is preconditioned by A_k^(−e_k) along every dim
/// k, A_k the Kronecker factor, the root computed every `precondition_frequency` steps by
/// `solver`. The iterative solvers run all same-size blocks of a stack as one batch and stop a
/// block when max|M − I| ≤ tolerance (or at its precision floor); a block that has not converged
/// after `max_iterations` (or diverges) is computed by eigh instead.
struct RootInvShampooConfig {
  bool retry_double_precision = true;
  RootSolver solver = RootSolver::kEigh;
  /// Iterative solvers: iteration budget per block (≥ 1). The reference's default.
  int64_t max_iterations = 100;
  /// Iterative solvers: convergence tolerance on max|M − I| (> 0). The reference's default.
  double tolerance = 1e-6;
  /// Iterative solvers on CUDA: TensorFloat-32 matrix products (about 5× faster, relative error
  /// near 1e-2; raise `tolerance` to ~3e-2 with it). No effect on CPU.
  bool tf32 = false;
  /// Perturbation by ε (default) or pseudo-inverse (RootSolver::kEigh only).
  RankDeficientStabilityConfig rank_deficient_stability = PerturbationConfig{};
  bool operator==(const RootInvShampooConfig&) const = default;
};

/// How the eigenbases of eigenvalue-corrected Shampoo are recomputed at amortized steps.
enum class EigenbasisMethod {
  kEigh,  ///< full symmetric eigendecomposition (float64 retry on failure)
  kQR,    ///< one step of QR (subspace) iteration warm-started from the previous basis
};

/// Eigenvalue-corrected Shampoo (SOAP): an Adam-style second moment kept in the eigenbases of the
/// Kronecker factors. `epsilon` and betas[1] of ShampooOptions apply to the corrected eigenvalues.
struct EigenvalueCorrectedShampooConfig {
  EigenbasisMethod eigenbasis_method = EigenbasisMethod::kEigh;
  bool retry_double_precision = true;
  bool operator==(const EigenvalueCorrectedShampooConfig&) const = default;
};

/// How spectral descent orthogonalizes a block.
enum class OrthogonalizationMethod {
  /// The quintic Newton–Schulz iteration X ← a·X + b·(X·Xᵀ)·X + c·(X·Xᵀ)²·X from X₀ = G/‖G‖_F:
  /// matrix products only (the reference's default).
  kNewtonSchulz,
  /// U·Vᵀ from the reduced SVD G = U·S·Vᵀ (exact; a zero block gives an arbitrary orthogonal
  /// direction, as in the reference).
  kSVD,
};

/// The factor spectral descent multiplies its direction by, from the block's rows (d_out) and
/// columns (d_in). The reference takes any function of (d_in, d_out); these are the common ones.
enum class OrthogonalizationScale {
  kOne,             ///< 1: the reference's default
  kSqrtAspectRatio  ///< sqrt(max(1, d_out / d_in)), the scaling of Muon
};

/// Spectral descent (Muon-style): each 2-D block's filtered gradient Ḡ = U·S·Vᵀ is replaced by
/// its orthogonal direction U·Vᵀ (docs/math.md, "Spectral descent"). No statistics, no amortized
/// computation (precondition_frequency has no effect). Only for 2-D blocks: with it, blocking
/// merges dims down to two (not one), and a parameter whose blocks are not 2-D is an error at
/// construction. Defaults: the reference's default Newton–Schulz config.
struct SpectralDescentConfig {
  OrthogonalizationMethod method = OrthogonalizationMethod::kNewtonSchulz;
  /// Newton–Schulz iterations (≥ 1).
  int64_t num_iterations = 5;
  /// Newton–Schulz coefficients (a, b, c) of the quintic polynomial; Muon's. Finite.
  std::array<double, 3> coefficients = {3.4445, -4.7750, 2.0315};
  /// kSVD only: multiply the direction by the nuclear norm Σ s_i of the block.
  bool scale_by_nuclear_norm = false;
  OrthogonalizationScale scale = OrthogonalizationScale::kOne;
  bool operator==(const SpectralDescentConfig&) const = default;
};

/// The scale of sign descent's direction sign(Ḡ)·scale, per block.
enum class SignDescentScale {
  kOne,     ///< 1: the reference's default scale function
  kL1Norm,  ///< Σ|Ḡ| of the block: steepest descent under the L∞ norm (the reference's example)
};

/// Sign descent: P = sign(Ḡ)·scale per block (docs/math.md, "Sign descent"). No statistics, no
/// amortized computation; any block order.
struct SignDescentConfig {
  SignDescentScale scale = SignDescentScale::kOne;
  bool operator==(const SignDescentConfig&) const = default;
};

/// SGD as the main preconditioner: P = Ḡ (docs/math.md, "Diagonal main preconditioners").
struct SGDPreconditionerConfig {
  bool operator==(const SGDPreconditionerConfig&) const = default;
};

/// AdaGrad as the main preconditioner: V ← V + G′², P = Ḡ / (sqrt(V) + epsilon). `epsilon` (> 0)
/// replaces ShampooOptions.epsilon, which does not enter.
struct AdaGradPreconditionerConfig {
  double epsilon = 1e-10;
  bool operator==(const AdaGradPreconditionerConfig&) const = default;
};

/// RMSprop as the main preconditioner: V ← beta2·V + (1 − beta2)·G′², P = Ḡ / (sqrt(V) + epsilon),
/// no bias correction. drop_weighting_factor_on_gsquare: V ← beta2·V + G′². beta2 in (0, 1]
/// (replaces ShampooOptions.betas[1]); epsilon > 0.
struct RMSpropPreconditionerConfig {
  double beta2 = 0.99;
  double epsilon = 1e-10;
  bool drop_weighting_factor_on_gsquare = false;
  bool operator==(const RMSpropPreconditionerConfig&) const = default;
};

/// Adam as the main preconditioner: RMSprop's V with the bias correction 1 − beta2^t (always, when
/// beta2 < 1, whatever use_bias_correction says), P = Ḡ / (sqrt(V / (1 − beta2^t)) + epsilon).
/// drop_weighting_factor_on_gsquare: V ← beta2·V + G′² and no bias correction. Adam's beta1 is
/// ShampooOptions.betas[0] (the filter of Ḡ).
struct AdamPreconditionerConfig {
  double beta2 = 0.999;
  double epsilon = 1e-10;
  bool drop_weighting_factor_on_gsquare = false;
  bool operator==(const AdamPreconditionerConfig&) const = default;
};

/// Eigendecomposed Shampoo (the reference's EigendecomposedShampooPreconditionerConfig): keeps the
/// eigendecomposition Q_k·diag(λ_k)·Q_kᵀ of every factor A_k + ε·I (recomputed at amortized
/// steps) and applies X_k = Q_k·diag(f(λ_k))·Q_kᵀ at every preconditioning, f the inverse root
/// −e_k after the ε shift (or the pseudo-inverse). Exponents and inverse_exponent_override as
/// root-inverse Shampoo. Eigenvectors and eigenvalues are kept in factor_matrix_dtype (the
/// reference's separate eigenvector / eigenvalue dtypes, float32 by default, are not offered).
/// Eigenvalues start at 1 and eigenvectors at I, so X_k starts as I (ε^(−e_k)·I when ε > 1).
struct EigendecomposedShampooConfig {
  /// kEigh (default): eigh of A + ε·I with the float64 retry; kQR: one QR (subspace) iteration
  /// warm-started from the previous eigenvectors, eigenvalues its Rayleigh quotients.
  EigenbasisMethod eigenbasis_method = EigenbasisMethod::kEigh;
  bool retry_double_precision = true;
  RankDeficientStabilityConfig rank_deficient_stability = PerturbationConfig{};
  bool operator==(const EigendecomposedShampooConfig&) const = default;
};

/// Root-inverse KL-Shampoo (the reference's RootInvKLShampooPreconditionerConfig): root-inverse
/// Shampoo whose factor along dim k accumulates the gradient multiplied along every other
/// preconditioned dim j by the current inverse root X_j (docs/math.md, "KL-Shampoo"). Roots,
/// exponents, solvers, rank-deficient stability and preconditioning are root-inverse Shampoo's:
/// the fields are inherited (set them through the base, e.g.
/// `RootInvKLShampooConfig{RootInvShampooConfig{.solver = RootSolver::kCoupledNewton}}`).
/// Before the first amortized computation every X_j is I, so the factors are Shampoo's.
struct RootInvKLShampooConfig : RootInvShampooConfig {
  bool operator==(const RootInvKLShampooConfig&) const = default;
};

/// Eigendecomposed KL-Shampoo (the reference's EigendecomposedKLShampooPreconditionerConfig):
/// eigendecomposed Shampoo whose factors accumulate KL-Shampoo's statistics, the inverse roots of
/// the other dims formed from the kept eigendecompositions with the step's ε (docs/math.md,
/// "KL-Shampoo"). The fields are eigendecomposed Shampoo's, inherited (e.g.
/// `EigendecomposedKLShampooConfig{EigendecomposedShampooConfig{.eigenbasis_method = kQR}}`).
/// Before the first decomposition the roots are f(1)·I (I for ε ≤ 1).
struct EigendecomposedKLShampooConfig : EigendecomposedShampooConfig {
  bool operator==(const EigendecomposedKLShampooConfig&) const = default;
};

/// The preconditioner family. The index of the alternative is the kind written to checkpoints:
/// append new families at the end, never reorder.
using PreconditionerConfig =
    std::variant<RootInvShampooConfig, EigenvalueCorrectedShampooConfig, SpectralDescentConfig,
                 SignDescentConfig, SGDPreconditionerConfig, AdaGradPreconditionerConfig,
                 RMSpropPreconditionerConfig, AdamPreconditionerConfig,
                 EigendecomposedShampooConfig, RootInvKLShampooConfig,
                 EigendecomposedKLShampooConfig>;

/// The root-inverse settings of root-inverse Shampoo and root-inverse KL-Shampoo; null for the
/// other families.
const RootInvShampooConfig* root_inverse_config(const PreconditionerConfig& config);

/// The eigendecomposed settings of eigendecomposed Shampoo and eigendecomposed KL-Shampoo; null
/// for the other families.
const EigendecomposedShampooConfig* eigendecomposed_config(const PreconditionerConfig& config);

/// The rank-deficient stability of a preconditioner config: that of root-inverse and
/// eigendecomposed Shampoo and of KL-Shampoo; null for eigenvalue-corrected Shampoo, which has
/// none, and the families without factors.
const RankDeficientStabilityConfig* rank_deficient_stability(const PreconditionerConfig& config);

/// True when `config` applies the pseudo-inverse (PseudoInverseConfig).
bool uses_pseudo_inverse(const PreconditionerConfig& config);

/// Generalized primal averaging (docs/math.md, "Iterate averaging"; the reference's
/// GeneralizedPrimalAveragingConfig, arXiv 2512.17131). Keeps per block the sequence Z of plain
/// descent steps; the parameters hold the training sequence y, where gradients are taken, and
/// DistributedShampoo::eval() moves them to the averaged sequence x. eval_interp_coeff μx in
/// [0, 1) weighs the previous x in the average; train_interp_coeff μy in (0, 1] places y between
/// Z (μy = 0) and x (μy = 1). μy = 1: heavy-ball momentum μx at lr·(1 − μx); μy = μx: Nesterov.
struct GeneralizedPrimalAveragingConfig {
  double eval_interp_coeff = 0.9;
  double train_interp_coeff = 0.8;
  bool operator==(const GeneralizedPrimalAveragingConfig&) const = default;
};

/// Schedule-Free (the reference's ScheduleFreeConfig, arXiv 2405.15682): primal averaging with
/// μy = train_interp_coeff (in (0, 1]) and, at step t, μx = 1 − lr_t^p / Σ_{i≤t} lr_i^p with
/// p = eval_coeff_lr_power (finite, ≥ 0), the sum kept per param group (saved in checkpoints).
struct ScheduleFreeConfig {
  double train_interp_coeff = 0.8;
  double eval_coeff_lr_power = 2.0;
  bool operator==(const ScheduleFreeConfig&) const = default;
};

/// Iterate averaging of a param group: none (std::monostate, the default), GPA or Schedule-Free.
/// The index of the alternative is the code written to checkpoints: append, never reorder.
using IterateAveragingConfig =
    std::variant<std::monostate, GeneralizedPrimalAveragingConfig, ScheduleFreeConfig>;

enum class WeightDecayType {
  kL2,         ///< G ← G + wd·W before everything else
  kDecoupled,  ///< P ← P + wd·W after preconditioning (AdamW-style)
};

/// Exponent overrides for root-inverse Shampoo, keyed by the order of the block (number of dims)
/// and then by dim; dim kAllDims applies to every dim of that order not named explicitly. The
/// factor along that dim is raised to −exponent; exponent 0 leaves the dim unpreconditioned.
/// Default exponent: 1 / (2·order).
using InverseExponentOverride = std::map<int64_t, std::map<int64_t, double>>;
inline constexpr int64_t kAllDims = -1;

/// Never start preconditioning: with grafting this is the pure diagonal method.
inline constexpr int64_t kNeverStartPreconditioning = std::numeric_limits<int64_t>::max();

/// (beta1, beta2), as torch::optim::AdamOptions::betas.
using Betas = std::tuple<double, double>;

/// Options of one parameter group. Float fields (lr, betas, beta3, epsilon, weight_decay,
/// momentum, dampening, the grafting betas and epsilons) may differ between groups that are still
/// merged into one virtual group; the other fields are structural. Which is which, and how each
/// field is compared and serialized, is the table of shampoo/option_fields.cpp: a new option is
/// its TORCH_ARG here and one row there.
struct ShampooOptions : public torch::optim::OptimizerCloneableOptions<ShampooOptions> {
  ShampooOptions() = default;
  explicit ShampooOptions(double lr) : lr_(lr) {}

  /// Learning rate (≥ 0).
  TORCH_ARG(double, lr) = 1e-2;
  /// (beta1, beta2): beta1 filters the gradient (0 = off), beta2 the Kronecker factors
  /// (1 = AdaGrad-style sum).
  TORCH_ARG(Betas, betas) = std::make_tuple(0.9, 1.0);
  /// Filter coefficient of the gradient used in the step; −1 means beta1.
  TORCH_ARG(double, beta3) = -1.0;
  /// Added to the factors before the root (> 0; exactly 0 with PseudoInverseConfig).
  TORCH_ARG(double, epsilon) = 1e-12;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(WeightDecayType, weight_decay_type) = WeightDecayType::kDecoupled;
  TORCH_ARG(double, momentum) = 0.0;
  TORCH_ARG(double, dampening) = 0.0;
  TORCH_ARG(bool, use_nesterov) = false;
  /// Largest block size along any dim (≥ 1); larger dims are split into blocks.
  TORCH_ARG(int64_t, max_preconditioner_dim) = 1024;
  /// Merge small trailing dims while their product stays ≤ max_preconditioner_dim.
  TORCH_ARG(bool, use_merge_dims) = true;
  /// Recompute roots every this many steps (≥ 1).
  TORCH_ARG(int64_t, precondition_frequency) = 1;
  /// First step that preconditions; −1 = precondition_frequency; kNeverStartPreconditioning.
  TORCH_ARG(int64_t, start_preconditioning_step) = -1;
  TORCH_ARG(bool, use_bias_correction) = true;
  TORCH_ARG(GraftingConfig, grafting) = std::monostate{};
  /// dtype of the Kronecker factors and roots (Float or Double).
  TORCH_ARG(c10::ScalarType, factor_matrix_dtype) = c10::ScalarType::Float;
  TORCH_ARG(PreconditionerConfig, preconditioner) = RootInvShampooConfig{};
  TORCH_ARG(InverseExponentOverride, inverse_exponent_override) = {};
  /// Consecutive failed root computations of a block tolerated before the step raises (≥ 0).
  TORCH_ARG(int64_t, num_tolerated_failed_amortized_computations) = 3;
  /// Iterate averaging (GPA or Schedule-Free; none by default). Structural. Needs momentum 0
  /// (the reference's classic momentum and averaging are alternatives); decoupled weight decay
  /// then shrinks the averaging sequence Z instead of entering the direction.
  TORCH_ARG(IterateAveragingConfig, iterate_averaging) = std::monostate{};

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  void serialize(torch::serialize::OutputArchive& archive) const override;
  void serialize(torch::serialize::InputArchive& archive) override;

  /// beta3 with −1 resolved to beta1.
  double resolved_beta3() const;
  /// start_preconditioning_step with −1 resolved to precondition_frequency.
  int64_t resolved_start_preconditioning_step() const;

  /// Throws c10::Error naming the field, the value and what is allowed.
  void validate() const;
};

/// True when `a` and `b` can live in one virtual group: every structural field is equal (they may
/// differ in the float fields: lr, betas, beta3, epsilon, weight decay, momentum, dampening and
/// the grafting floats).
bool structurally_equal(const ShampooOptions& a, const ShampooOptions& b);

/// Options of the distributed engine (the same for every group).
struct DistributedOptions {
  /// Process group to distribute over; null = single process.
  TORCH_ARG(c10::intrusive_ptr<c10d::ProcessGroup>, process_group) = {};
  /// dtype of the AllGather buffer: Float, BFloat16 or Half.
  TORCH_ARG(c10::ScalarType, communication_dtype) = c10::ScalarType::Float;
  /// Ranks that share the blocks of one model copy (consecutive ranks); −1 = all ranks.
  TORCH_ARG(int64_t, num_trainers_per_group) = -1;
  /// AllGather the updated parameters instead of the updates.
  TORCH_ARG(bool, communicate_params) = false;
  /// Fold groups that differ only in float hyperparameters into one virtual group.
  TORCH_ARG(bool, merge_param_groups) = true;
  /// Owners are assigned to whole parameters (every block of a parameter on one rank, balanced
  /// by the sum of the blocks' costs) instead of to blocks. Gradient sharding
  /// (GradientSynchronizer::shard_gradients) needs it: each rank then needs the gradients of its
  /// own parameters only. The results do not depend on it (ownership never changes the math);
  /// the balance is coarser. Not with num_trainers_per_group.
  TORCH_ARG(bool, shard_by_parameter) = false;

 public:
  void validate() const;
};

}  // namespace shampoo
