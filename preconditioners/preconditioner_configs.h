#pragma once
/// The preconditioner families' public configs and the facts that belong to each family, in one
/// light header (standard library only) that the options, the lists and the kernel layer include:
///   - the config structs and the PreconditionerConfig variant (its order is the checkpoint code);
///   - `List`: the preconditioner list that runs the family (preconditioners/);
///   - `family_name`, the names of its enumerators, its fields (`visit_fields`: archive key, name
///     in messages, member), which are what options merging, fingerprints and checkpoints read;
///   - `check_config`: its range checks (preconditioner_configs.cpp);
/// Adding a family: docs/extending.md.

#include <array>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

namespace shampoo::detail {
// The lists that run the families (preconditioners/*_preconditioner_list*.h).
class ShampooPreconditionerList;
class EigendecomposedPreconditionerList;
class EigenvalueCorrectedPreconditionerList;
class DiagonalPreconditionerList;
class SpectralDescentPreconditionerList;
class SignDescentPreconditionerList;

/// What the Kronecker factors accumulate (docs/math.md, "Step 2" and "KL-Shampoo").
enum class FactorStatistics {
  /// Shampoo: C_k(G′), the gradient contracted with itself over every dim but k.
  kShampoo,
  /// KL-Shampoo: C_k of the gradient multiplied along every other preconditioned dim j by its
  /// current inverse root X_j.
  kKL,
};
}  // namespace shampoo::detail

namespace shampoo {

/// How the optimizer state may be kept in fewer bytes (ShampooOptions::compact_state). Every
/// computation stays in float32 (or the factor dtype): a compact state is decoded before use and
/// encoded after. docs/math.md#compact-state has the error of each and when to use it.
enum class CompactState {
  /// Everything in its compute dtype (the default).
  kNone,
  /// The inverse roots (root-inverse and KL-Shampoo) in bfloat16, rounded to nearest; the
  /// grafting second moment, the filtered gradient and momentum in bfloat16 with stochastic
  /// rounding (deterministic: the same bits at any world size).
  kBfloat16,
  /// As kBfloat16, but the inverse roots in 8 bits: each group of 64 stored entries shares a
  /// power-of-two scale, the diagonal stays in the factor dtype.
  kInt8,
};

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
  /// The reference's coupled higher-order iteration (its CoupledHigherOrderConfig): A is
  /// regularized with max(rel_epsilon·‖A‖∞, abs_epsilon)·I (‖A‖∞ the largest absolute row sum,
  /// an upper bound on λ_max), the Shampoo epsilon and relative_epsilon not entering; one Newton
  /// step, then steps of order `order` (Horner's rule on I − M). Integer roots only.
  kCoupledHigherOrder,
  /// The reference's Newton–Schulz inverse root (its NewtonSchulzRootInvConfig): A is regularized
  /// with max(relative_epsilon·‖A‖_F, ε)·I, then each of log2(p) square-root passes runs the
  /// coupled Newton–Schulz iteration for a fixed schedule of odd quintics (`coefficients`), with
  /// no convergence check. Roots that are powers of two (≥ 2) only: another root is an error at
  /// construction naming the parameter.
  kNewtonSchulz,
};

/// The reference's default schedule for kNewtonSchulz (its NewtonSchulzRootInvConfig: a 10-step
/// Polar Express schedule, arXiv 2505.16932): (a, b, c) of p(x) = a·x + b·x³ + c·x⁵ per iteration.
std::vector<std::array<double, 3>> default_newton_schulz_coefficients();

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
  using List = detail::ShampooPreconditionerList;
  bool retry_double_precision = true;
  RootSolver solver = RootSolver::kEigh;
  /// Iterative solvers: iteration budget per block (≥ 1). The reference's default.
  int64_t max_iterations = 100;
  /// Iterative solvers: convergence tolerance on max|M − I| (> 0). The reference's default.
  double tolerance = 1e-6;
  /// Iterative solvers on CUDA: TensorFloat-32 matrix products (about 5× faster, relative error
  /// near 1e-2; raise `tolerance` to ~3e-2 with it). No effect on CPU.
  bool tf32 = false;
  /// kCoupledHigherOrder: the order of the iteration (≥ 2; 2 is Newton's), and the relative and
  /// absolute regularization (≥ 0). The reference's defaults: order 3, tolerance 1e-8 (set it:
  /// this config's default tolerance is coupled Newton's 1e-6); its rel_epsilon and abs_epsilon
  /// have no defaults.
  int64_t order = 3;
  double rel_epsilon = 0.0;
  double abs_epsilon = 0.0;
  /// kNewtonSchulz: the ridge's floor relative to ‖A‖_F (≥ 0; the ridge is
  /// max(relative_epsilon·‖A‖_F, ε)), and the schedule: one (a, b, c) per iteration (non-empty,
  /// finite; a last triple that does not sum to 1 warns: the iteration then has no fixed point at
  /// the root). The reference's defaults. max_iterations and tolerance do not apply.
  double relative_epsilon = 1e-6;
  std::vector<std::array<double, 3>> coefficients = default_newton_schulz_coefficients();
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
  using List = detail::EigenvalueCorrectedPreconditionerList;
  EigenbasisMethod eigenbasis_method = EigenbasisMethod::kEigh;
  bool retry_double_precision = true;
  /// The reference's ignored_basis_change_dims: by block order (number of dims after blocking),
  /// the dims whose basis is not changed. Such a dim keeps no factor and no eigenbasis, the
  /// gradient is not rotated along it; the corrected eigenvalues keep the full block shape (a
  /// block with every dim ignored is Adam's). Orders ≥ 0, dims in [0, order − 1], no duplicates.
  std::map<int64_t, std::vector<int64_t>> ignored_basis_change_dims = {};
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
  using List = detail::SpectralDescentPreconditionerList;
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
  using List = detail::SignDescentPreconditionerList;
  SignDescentScale scale = SignDescentScale::kOne;
  bool operator==(const SignDescentConfig&) const = default;
};

/// SGD as the main preconditioner: P = Ḡ (docs/math.md, "Diagonal main preconditioners").
struct SGDPreconditionerConfig {
  using List = detail::DiagonalPreconditionerList;
  bool operator==(const SGDPreconditionerConfig&) const = default;
};

/// AdaGrad as the main preconditioner: V ← V + G′², P = Ḡ / (sqrt(V) + epsilon). `epsilon` (> 0)
/// replaces ShampooOptions.epsilon, which does not enter.
struct AdaGradPreconditionerConfig {
  using List = detail::DiagonalPreconditionerList;
  double epsilon = 1e-10;
  bool operator==(const AdaGradPreconditionerConfig&) const = default;
};

/// RMSprop and Adam as the main preconditioner (one definition, kBiasCorrected tells them apart):
///   RMSprop: V ← beta2·V + (1 − beta2)·G′², P = Ḡ / (sqrt(V) + epsilon), no bias correction;
///   Adam: the same V with the bias correction 1 − beta2^t (always, when beta2 < 1, whatever
///   use_bias_correction says), P = Ḡ / (sqrt(V / (1 − beta2^t)) + epsilon). Adam's beta1 is
///   ShampooOptions.betas[0] (the filter of Ḡ).
/// drop_weighting_factor_on_gsquare: V ← beta2·V + G′² and no bias correction. beta2 in (0, 1]
/// (replaces ShampooOptions.betas[1]; default 0.99 for RMSprop, 0.999 for Adam); epsilon > 0.
template <bool kBiasCorrected>
struct MovingAveragePreconditionerConfig {
  using List = detail::DiagonalPreconditionerList;
  static constexpr bool kAdam = kBiasCorrected;
  double beta2 = kBiasCorrected ? 0.999 : 0.99;
  double epsilon = 1e-10;
  bool drop_weighting_factor_on_gsquare = false;
  bool operator==(const MovingAveragePreconditionerConfig&) const = default;
};
using RMSpropPreconditionerConfig = MovingAveragePreconditionerConfig<false>;
using AdamPreconditionerConfig = MovingAveragePreconditionerConfig<true>;

/// Eigendecomposed Shampoo (the reference's EigendecomposedShampooPreconditionerConfig): keeps the
/// eigendecomposition Q_k·diag(λ_k)·Q_kᵀ of every factor A_k + ε·I (recomputed at amortized
/// steps) and applies X_k = Q_k·diag(f(λ_k))·Q_kᵀ at every preconditioning, f the inverse root
/// −e_k after the ε shift (or the pseudo-inverse). Exponents and inverse_exponent_override as
/// root-inverse Shampoo. Eigenvectors and eigenvalues are kept in factor_matrix_dtype (the
/// reference's separate eigenvector / eigenvalue dtypes, float32 by default, are not offered).
/// Eigenvalues start at 1 and eigenvectors at I, so X_k starts as I (ε^(−e_k)·I when ε > 1).
struct EigendecomposedShampooConfig {
  using List = detail::EigendecomposedPreconditionerList;
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

/// The grafting methods are the diagonal families (as in the reference): the same configs, the
/// same coefficients (diagonal_coefficients). GraftingConfig's order is the checkpoint code of
/// the grafting kind: append, never reorder.
using SGDGraftingConfig = SGDPreconditionerConfig;
using AdaGradGraftingConfig = AdaGradPreconditionerConfig;
using RMSpropGraftingConfig = RMSpropPreconditionerConfig;
using AdamGraftingConfig = AdamPreconditionerConfig;
/// std::monostate = no grafting.
using GraftingConfig =
    std::variant<std::monostate, SGDPreconditionerConfig, AdaGradPreconditionerConfig,
                 RMSpropPreconditionerConfig, AdamPreconditionerConfig>;

}  // namespace shampoo

namespace shampoo::detail {

template <typename C>
using Plain = std::remove_cvref_t<C>;

// ---- family names --------------------------------------------------------------------------

constexpr const char* family_name(const RootInvShampooConfig&) { return "root-inverse Shampoo"; }
constexpr const char* family_name(const RootInvKLShampooConfig&) {
  return "root-inverse KL-Shampoo";
}
constexpr const char* family_name(const EigenvalueCorrectedShampooConfig&) {
  return "eigenvalue-corrected Shampoo";
}
constexpr const char* family_name(const EigendecomposedShampooConfig&) {
  return "eigendecomposed Shampoo";
}
constexpr const char* family_name(const EigendecomposedKLShampooConfig&) {
  return "eigendecomposed KL-Shampoo";
}
constexpr const char* family_name(const SpectralDescentConfig&) { return "spectral descent"; }
constexpr const char* family_name(const SignDescentConfig&) { return "sign descent"; }
constexpr const char* family_name(const SGDPreconditionerConfig&) { return "SGD preconditioner"; }
constexpr const char* family_name(const AdaGradPreconditionerConfig&) {
  return "AdaGrad preconditioner";
}
template <bool kAdam>
constexpr const char* family_name(const MovingAveragePreconditionerConfig<kAdam>&) {
  return kAdam ? "Adam preconditioner" : "RMSprop preconditioner";
}

/// What the factors of a Kronecker family accumulate: KL-Shampoo's configs say kKL.
constexpr FactorStatistics factor_statistics(const RootInvShampooConfig&) {
  return FactorStatistics::kShampoo;
}
constexpr FactorStatistics factor_statistics(const RootInvKLShampooConfig&) {
  return FactorStatistics::kKL;
}
constexpr FactorStatistics factor_statistics(const EigendecomposedShampooConfig&) {
  return FactorStatistics::kShampoo;
}
constexpr FactorStatistics factor_statistics(const EigendecomposedKLShampooConfig&) {
  return FactorStatistics::kKL;
}
constexpr FactorStatistics factor_statistics(const EigenvalueCorrectedShampooConfig&) {
  return FactorStatistics::kShampoo;
}

// ---- enumerator names (value order), for messages ---------------------------------------------

inline std::array<const char*, 5> enumerator_names(RootSolver) {
  return {"kEigh", "kCoupledNewton", "kNewtonDB", "kCoupledHigherOrder", "kNewtonSchulz"};
}
inline std::array<const char*, 2> enumerator_names(EigenbasisMethod) { return {"kEigh", "kQR"}; }
inline std::array<const char*, 2> enumerator_names(OrthogonalizationMethod) {
  return {"kNewtonSchulz", "kSVD"};
}
inline std::array<const char*, 2> enumerator_names(OrthogonalizationScale) {
  return {"kOne", "kSqrtAspectRatio"};
}
inline std::array<const char*, 2> enumerator_names(SignDescentScale) { return {"kOne", "kL1Norm"}; }

// ---- fields ----------------------------------------------------------------------------------
// visit_fields(config, f) calls f(archive key, name in messages, member) for every field of a
// family, in a fixed order. Options merging (two configs merge when every field is equal),
// fingerprints, descriptions and checkpoints are made from it (shampoo/option_fields.cpp).
// Keys shared by several families (retry, eigenbasis method, rank-deficient stability) are one
// archive entry. Member types: bool, int64_t, double, std::array<double, 3>, an enum with
// enumerator_names, RankDeficientStabilityConfig, a list of (a, b, c) triples, SOAP's ignored dims.

template <typename C, typename F>
requires std::is_base_of_v<RootInvShampooConfig, Plain<C>>
void visit_fields(C& c, F&& f) {
  f("preconditioner_retry_double_precision", "retry_double_precision", c.retry_double_precision);
  f("preconditioner_root_solver", "solver", c.solver);
  f("preconditioner_max_iterations", "max_iterations", c.max_iterations);
  f("preconditioner_tolerance", "tolerance", c.tolerance);
  f("preconditioner_tf32", "tf32", c.tf32);
  f("preconditioner_rank_deficient_stability", "rank_deficient_stability",
    c.rank_deficient_stability);
  f("preconditioner_higher_order", "order", c.order);
  f("preconditioner_rel_epsilon", "rel_epsilon", c.rel_epsilon);
  f("preconditioner_abs_epsilon", "abs_epsilon", c.abs_epsilon);
  f("preconditioner_relative_epsilon", "relative_epsilon", c.relative_epsilon);
  f("preconditioner_newton_schulz_coefficients", "coefficients", c.coefficients);
}
template <typename C, typename F>
requires std::is_base_of_v<EigendecomposedShampooConfig, Plain<C>>
void visit_fields(C& c, F&& f) {
  f("preconditioner_eigenbasis_method", "eigenbasis_method", c.eigenbasis_method);
  f("preconditioner_retry_double_precision", "retry_double_precision", c.retry_double_precision);
  f("preconditioner_rank_deficient_stability", "rank_deficient_stability",
    c.rank_deficient_stability);
}
template <typename C, typename F>
requires std::is_same_v<Plain<C>, EigenvalueCorrectedShampooConfig>
void visit_fields(C& c, F&& f) {
  f("preconditioner_eigenbasis_method", "eigenbasis_method", c.eigenbasis_method);
  f("preconditioner_retry_double_precision", "retry_double_precision", c.retry_double_precision);
  f("preconditioner_ignored_basis_change_dims", "ignored_basis_change_dims",
    c.ignored_basis_change_dims);
}
template <typename C, typename F>
requires std::is_same_v<Plain<C>, SpectralDescentConfig>
void visit_fields(C& c, F&& f) {
  f("preconditioner_spectral_method", "method", c.method);
  f("preconditioner_spectral_num_iterations", "num_iterations", c.num_iterations);
  f("preconditioner_spectral_coefficients", "coefficients", c.coefficients);
  f("preconditioner_spectral_scale_by_nuclear_norm", "scale_by_nuclear_norm",
    c.scale_by_nuclear_norm);
  f("preconditioner_spectral_scale", "scale", c.scale);
}
template <typename C, typename F>
requires std::is_same_v<Plain<C>, SignDescentConfig>
void visit_fields(C& c, F&& f) { f("preconditioner_sign_scale", "scale", c.scale); }
template <typename C, typename F>
requires std::is_same_v<Plain<C>, SGDPreconditionerConfig>
void visit_fields(C& /*c*/, F&& /*f*/) {}
template <typename C, typename F>
requires std::is_same_v<Plain<C>, AdaGradPreconditionerConfig>
void visit_fields(C& c, F&& f) { f("preconditioner_adagrad_epsilon", "epsilon", c.epsilon); }
template <typename C, typename F>
requires std::is_same_v<Plain<C>, RMSpropPreconditionerConfig> ||
    std::is_same_v<Plain<C>, AdamPreconditionerConfig>
void visit_fields(C& c, F&& f) {
  constexpr bool adam = Plain<C>::kAdam;
  f(adam ? "preconditioner_adam_beta2" : "preconditioner_rmsprop_beta2", "beta2", c.beta2);
  f(adam ? "preconditioner_adam_epsilon" : "preconditioner_rmsprop_epsilon", "epsilon", c.epsilon);
  f(adam ? "preconditioner_adam_drop_weighting_factor_on_gsquare"
         : "preconditioner_rmsprop_drop_weighting_factor_on_gsquare",
    "drop_weighting_factor_on_gsquare", c.drop_weighting_factor_on_gsquare);
}

// ---- range checks (preconditioner_configs.cpp) -------------------------------------------------
// Each throws c10::Error "<where>.<field>: got <value>, expected <range> (<config>)"; `where` is
// e.g. "ShampooOptions.preconditioner" or "ShampooOptions.grafting (Adam)".

void check_config(const RootInvShampooConfig& c, const std::string& where);
void check_config(const EigendecomposedShampooConfig& c, const std::string& where);
void check_config(const EigenvalueCorrectedShampooConfig& c, const std::string& where);
void check_config(const SpectralDescentConfig& c, const std::string& where);
void check_config(const SignDescentConfig& c, const std::string& where);
void check_config(const SGDPreconditionerConfig& c, const std::string& where);
void check_config(const AdaGradPreconditionerConfig& c, const std::string& where);
template <bool kAdam>
void check_config(const MovingAveragePreconditionerConfig<kAdam>& c, const std::string& where);

}  // namespace shampoo::detail

namespace shampoo {

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

}  // namespace shampoo
