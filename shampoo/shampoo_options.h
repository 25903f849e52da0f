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

#include "preconditioners/preconditioner_configs.h"

namespace shampoo {

// The preconditioner families' configs (RootInvShampooConfig, ..., the PreconditionerConfig
// variant) and the grafting configs (the diagonal families' configs, GraftingConfig) are in
// preconditioners/preconditioner_configs.h, with the facts of each family.

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

/// Where weight decay enters (docs/math.md, "Weight decay"). The value is the code written to
/// checkpoints: append, never reorder.
enum class WeightDecayType {
  kL2,         ///< G ← G + wd·W before everything else
  kDecoupled,  ///< P ← P + wd·W after preconditioning (AdamW-style)
  /// P ← P + wd·(lr_t / peak_lr)·W: decoupled decay whose factor follows the schedule's lr_t
  /// relative to its peak, so a step shrinks W by lr_t²·wd / peak_lr (the reference's CORRECTED;
  /// Defazio 2025, "AdamC").
  kCorrected,
  /// P ← P + (wd / peak_lr)·W: a factor that does not follow the schedule, so a step shrinks W by
  /// lr_t·wd / peak_lr (the reference's INDEPENDENT).
  kIndependent,
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
///
/// The defaults are settings that train well as they are, written as one writes
/// torch::optim::AdamOptions(1e-3): lr 1e-3, betas (0.9, 0.999), inverse roots every 50 steps
/// (from step 50 on), Adam grafting (β2 0.999, ε 1e-8), ε 1e-12 for the factors, float64
/// factors, blocks of at most 1024, no factor for 1-D parameters and dims above 4096. The
/// reference implementation's defaults (lr 1e-2, betas (0.9, 1.0), roots every step, no
/// grafting, float32 factors, every dim factored), for parity work and for recipes written for
/// it, are ShampooOptions::reference_defaults().
struct ShampooOptions : public torch::optim::OptimizerCloneableOptions<ShampooOptions> {
  ShampooOptions() = default;
  explicit ShampooOptions(double lr) : lr_(lr) {}
  /// The reference implementation's defaults (facebookresearch/optimizers, DistributedShampoo's
  /// constructor): lr `lr` (its default 1e-2), betas (0.9, 1.0), roots every step, no grafting,
  /// float32 factors, every dim factored, an absolute ε; every other field as ShampooOptions().
  /// Checkpoints written by optimizers built with ShampooOptions() before version 2026-11-28 (when
  /// these were the defaults) load into an optimizer built with these.
  static ShampooOptions reference_defaults(double lr = 1e-2);

  /// Learning rate (≥ 0).
  TORCH_ARG(double, lr) = 1e-3;
  /// (beta1, beta2): beta1 filters the gradient (0 = off), beta2 the Kronecker factors
  /// (1 = AdaGrad-style sum).
  TORCH_ARG(Betas, betas) = std::make_tuple(0.9, 0.999);
  /// Filter coefficient of the gradient used in the step; −1 means beta1.
  TORCH_ARG(double, beta3) = -1.0;
  /// Added to the factors before the root (> 0; exactly 0 with PseudoInverseConfig).
  TORCH_ARG(double, epsilon) = 1e-12;
  /// Relative regularization of root-inverse Shampoo's factors (≥ 0): a factor A is regularized
  /// with ε + relative_epsilon·tr(A) (tr(A) ≥ λ_max(A) for the positive semidefinite factors),
  /// summed on the host in float64 (docs/math.md, "Factors in float64, a relative epsilon").
  /// The default 1e-7 goes with the default float64 factors: about the floor that float32
  /// rounding used to put under the small eigenvalues, now deterministic. With float32 factors,
  /// 1e-5 keeps runs that differ in rounding together. 0 = the absolute ε alone, as the
  /// reference.
  TORCH_ARG(double, relative_epsilon) = 1e-7;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(WeightDecayType, weight_decay_type) = WeightDecayType::kDecoupled;
  /// The lr that kCorrected and kIndependent divide by (> 0). −1 (the default): the group's lr
  /// when it is added to the optimizer; an lr set later (by hand or by a scheduler) leaves it as
  /// it is, as the reference's param_group["peak_lr"]. A float field: groups may differ in it.
  TORCH_ARG(double, peak_lr) = -1.0;
  TORCH_ARG(double, momentum) = 0.0;
  TORCH_ARG(double, dampening) = 0.0;
  TORCH_ARG(bool, use_nesterov) = false;
  /// Largest block size along any dim (≥ 1); larger dims are split into blocks.
  TORCH_ARG(int64_t, max_preconditioner_dim) = 1024;
  /// Merge small trailing dims while their product stays ≤ max_preconditioner_dim.
  TORCH_ARG(bool, use_merge_dims) = true;
  /// Kronecker factors for 1-D parameters (every dim but one of size 1: biases, norm scales).
  /// false: they take the grafting method's update (AdamW's with Adam grafting), whose state is
  /// the size of the parameter, where factors would cost up to max_preconditioner_dim times it
  /// (shampoo/factor_choice.h). true: the reference's behaviour. Structural.
  TORCH_ARG(bool, precondition_1d) = false;
  /// A parameter dim larger than this (after size-1 dims are dropped and small dims merged,
  /// before blocking) keeps no Kronecker factor in any block: the vocabulary dim of an embedding
  /// (-1 = no limit, the reference's behaviour; else ≥ 1). A block left with no factor takes the
  /// grafting method's update. Structural.
  TORCH_ARG(int64_t, max_factored_dim) = 4096;
  /// Recompute roots every this many steps (≥ 1).
  TORCH_ARG(int64_t, precondition_frequency) = 50;
  /// First step that preconditions; −1 = precondition_frequency; kNeverStartPreconditioning.
  TORCH_ARG(int64_t, start_preconditioning_step) = -1;
  TORCH_ARG(bool, use_bias_correction) = true;
  /// The first-order method whose per-block step size the preconditioned direction takes
  /// (and which steps alone before preconditioning starts); std::monostate = none. Default: Adam
  /// grafting (β2 0.999, ε 1e-8). With a diagonal main preconditioner (SGD, AdaGrad, RMSprop,
  /// Adam), which is its own first-order method, the default is an error (validate()): set
  /// std::monostate{} for the method itself, or the grafting wanted.
 public:
  ShampooOptions& grafting(const GraftingConfig& grafting) {
    grafting_ = grafting;
    grafting_given_ = true;
    return *this;
  }
  const GraftingConfig& grafting() const noexcept { return grafting_; }
  /// Whether grafting was set (by its setter, reference_defaults or a checkpoint) rather than
  /// left at its default.
  bool grafting_given() const noexcept { return grafting_given_; }
  /// Keep the grafting second moment V of a 2-D block that has a Kronecker factor as its row and
  /// column sums (Adafactor's factorization): such a block takes only the grafting norm, and V
  /// then costs m + k numbers instead of m·k, so that the state stays within twice the
  /// parameters (docs/math.md, "Factored grafting statistics"). Blocks without a factor keep V
  /// exact (AdamW's update). false: V exact everywhere, as the reference. Checkpoints load
  /// across its values (V converts).
  TORCH_ARG(bool, factored_grafting) = true;
  /// dtype of the Kronecker factors and their roots (Float or Double); the preconditioning itself
  /// runs in the parameters' dtype. Double (the default) keeps the factors' accumulation and
  /// roots free of float32 rounding, which the small eigenvalues would otherwise amplify: a run
  /// then ends where the same run with other micro-batches or another world size ends, as with
  /// AdamW (docs/math.md, "Factors in float64, a relative epsilon"). Float: the reference's
  /// choice, half the bytes. Checkpoints load across its values.
  TORCH_ARG(c10::ScalarType, factor_matrix_dtype) = c10::ScalarType::Double;
  /// Keep the symmetric matrices of the state (Kronecker factors, inverse roots) as packed lower
  /// triangles: d(d+1)/2 entries instead of d², the same results bit for bit. Structural.
  TORCH_ARG(bool, use_symmetric_packing) = true;
  /// Keep the inverse roots, the grafting second moment, the filtered gradient and momentum in
  /// fewer bytes (bfloat16, or 8-bit roots); compute stays float32. Opt-in: it changes the
  /// results (docs/math.md#compact-state). Structural; checkpoints load across its values.
  TORCH_ARG(CompactState, compact_state) = CompactState::kNone;
  TORCH_ARG(PreconditionerConfig, preconditioner) = RootInvShampooConfig{};
  TORCH_ARG(InverseExponentOverride, inverse_exponent_override) = {};
  /// Kronecker families: before every amortized computation the bias-corrected factor A becomes
  /// A·max(tr A, epsilon)^(−trace_scaling_exponent), which brings the factors of different
  /// blocks to one scale (the reference's use_trace_scaling, arXiv 2506.03595); epsilon is then
  /// added as usual. Structural.
  TORCH_ARG(bool, use_trace_scaling) = false;
  /// The exponent of the trace with use_trace_scaling, in (0, 1]. Structural.
  TORCH_ARG(double, trace_scaling_exponent) = 0.5;
  /// Consecutive failed root computations of a block tolerated before the step raises (≥ 0).
  TORCH_ARG(int64_t, num_tolerated_failed_amortized_computations) = 3;
  /// Iterate averaging (GPA or Schedule-Free; none by default). Structural. Needs momentum 0
  /// (the reference's classic momentum and averaging are alternatives); decoupled weight decay
  /// then shrinks the averaging sequence Z instead of entering the direction.
  TORCH_ARG(IterateAveragingConfig, iterate_averaging) = std::monostate{};

 private:
  GraftingConfig grafting_ = AdamGraftingConfig{0.999, 1e-8};
  bool grafting_given_ = false;

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
  void serialize(torch::serialize::OutputArchive& archive) const override;
  void serialize(torch::serialize::InputArchive& archive) override;

  /// beta3 with −1 resolved to beta1.
  double resolved_beta3() const;
  /// start_preconditioning_step with −1 resolved to precondition_frequency.
  int64_t resolved_start_preconditioning_step() const;
  /// The factor of W added to the preconditioned direction at this lr: wd for kDecoupled,
  /// wd·lr / peak_lr for kCorrected, wd / peak_lr for kIndependent, 0 for kL2. Throws when
  /// peak_lr is needed and not resolved (−1).
  double decoupled_weight_decay() const;

  /// Throws c10::Error naming the field, the value and what is allowed.
  void validate() const;

  /// Every field equal, as LibTorch's options compare (e.g. after a load): the fields of the
  /// options table (shampoo/option_fields.cpp), floats by value (−0 equals 0, a NaN its own bits).
  bool operator==(const ShampooOptions& other) const;
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
  /// Before an ordinary distributed step changes any state, the ranks of the trainer group agree
  /// that every one of them can take it (one all-reduce of three ints per rank, besides the
  /// AllGather): a step that fails on one rank then changes nothing on any rank without a copy of
  /// the state. A step keeps its undo journal (the state it changes) only where some rank
  /// foresees that it may raise after changing state (an amortized computation past its tolerated
  /// failures, DistributedShampoo::stats().rollback_bytes_last_step). The agreement also carries
  /// fingerprints of the param groups' float options (lr, betas, epsilon, weight decay, ...): set
  /// apart on some ranks (a scheduler stepped on one rank, ReduceLROnPlateau on a local loss), the
  /// step is an error on every rank that changes nothing. false: no agreement and no such check;
  /// every distributed step journals what it changes, as a step in backward always does (steps
  /// in backward do not agree and are not checked either).
  TORCH_ARG(bool, agree_before_update) = true;
  /// A step in backward (apply_optimizer_in_backward) saves the state of the blocks it steps
  /// before changing it, so that an error later in the same backward pass (another parameter's
  /// bad gradient, another rank's failure) can undo the whole step: the undo journal, a copy of
  /// the state changed. false: no copy (the memory of a step equals an ordinary step's); such an
  /// error then leaves the optimizer refusing steps, with a message saying why, until a
  /// checkpoint is loaded. Keep true where a failed backward step is expected and skipped (a
  /// GradScaler with fp16 in backward).
  TORCH_ARG(bool, undo_in_backward) = true;

 public:
  void validate() const;
  /// Every field equal (the process group by identity).
  bool operator==(const DistributedOptions&) const = default;
};

}  // namespace shampoo
