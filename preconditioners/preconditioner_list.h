#pragma once
/// The preconditioner-list interface: the state of one preconditioning family for all blocks of a
/// virtual group owned by this rank, organised in stacks of equal-shape blocks so the matrix work
/// runs batched. Every family's config names its list (preconditioner_configs.h, `List`); the
/// Kronecker-factor families share KroneckerFactorList (kronecker_factor_list.h). The stacks and
/// rows they work on are in rows.h; preconditioner_factory.h builds a list from a config.

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "preconditioners/diagonal_coefficients.h"
#include "preconditioners/memory_summary.h"
#include "preconditioners/preconditioner_configs.h"
#include "preconditioners/rows.h"

namespace shampoo::detail {

/// Counters of amortized computations (root inverses, eigenbases).
struct AmortizedCounters {
  int64_t computations = 0;
  int64_t failures = 0;
  /// Matrices whose decomposition failed in the factor dtype and was retried in float64.
  int64_t retried_in_double = 0;
  /// Roots an iterative solver left unconverged, computed by eigh instead.
  int64_t solver_fallbacks = 0;
  /// Batched calls of the amortized computation: one per stack (blocks of one shape), dim and
  /// chunk of rows, however many blocks each holds.
  int64_t batched_calls = 0;
};

/// Test seam: return true to make the amortized computation of (block name, dim) fail.
using FailureInjector = std::function<bool(const std::string& block, int64_t dim)>;

/// What every list is built with besides its family's config (preconditioner_configs.h): the
/// options of the virtual group that are not the family's own.
struct MatrixPreconditionerSettings {
  at::ScalarType factor_dtype = at::kFloat;
  /// Set by the factory from the config (factor_statistics): KL-Shampoo's configs say kKL.
  FactorStatistics statistics = FactorStatistics::kShampoo;
  int64_t tolerated_failures = 3;
  /// Trace scaling of the Kronecker factors before every amortized computation: A becomes
  /// A·max(tr A, ε)^(−exponent); 0 = off (ShampooOptions::use_trace_scaling).
  double trace_scaling_exponent = 0.0;
  /// Symmetric matrices (factors, inverse roots) as packed lower triangles (symmetric_matrices.h).
  bool symmetric_packing = true;
  /// How the inverse roots are kept (the factors stay in factor_dtype).
  CompactState compact = CompactState::kNone;
  FailureInjector inject_failure;
};

/// One block as a list's state-size estimate sees it (the static `estimated_state_bytes(config,
/// layout)` of every list): the bytes it allocates for that block when it is built.
struct BlockLayout {
  std::vector<int64_t> shape;
  /// Per dim: the root-inverse exponent, 0 = the dim is not preconditioned (StackSpec).
  std::vector<double> dim_exponents;
  int64_t factor_element_size = 4;             ///< bytes of an element of factor_matrix_dtype
  int64_t state_element_size = 4;              ///< bytes of an element of the blocks' compute dtype
  bool symmetric_packing = true;               ///< MatrixPreconditionerSettings::symmetric_packing
  CompactState compact = CompactState::kNone;  ///< MatrixPreconditionerSettings::compact
  int64_t numel() const;
};

/// The direction of a family that is one formula per element of Ḡ (the diagonal families and
/// sign descent with scale 1), for the elementwise chain's fused pass, which then does the
/// family's whole work (update() and precondition() are not called for the member).
struct ElementwiseDirection {
  enum class Kind {
    kDiagonal,  ///< V ← β2·V + w·G′², P = Ḡ / (sqrt(V / bc2) + ε); P = Ḡ without V (SGD)
    kSign,      ///< P = sign(Ḡ)
  };
  Kind kind = Kind::kDiagonal;
  /// The member's V ([block_shape], a view of the list's state that the chain updates in place);
  /// undefined without statistics.
  at::Tensor state;
  /// The coefficients at the step (kDiagonal).
  DiagonalCoefficients coefficients;
};

class PreconditionerList {
 public:
  virtual ~PreconditionerList() = default;

  /// Whether every member's direction is elementwise (elementwise_direction gives it).
  virtual bool elementwise() const { return false; }
  /// The elementwise direction of member `row` of stack `stack` at step `step`, for lists whose
  /// elementwise() is true.
  virtual ElementwiseDirection elementwise_direction(int64_t /*stack*/, int64_t /*row*/,
                                                     int64_t /*step*/) {
    TORCH_INTERNAL_ASSERT(false, "elementwise_direction of a list that is not elementwise");
    return {};
  }

  /// Updates the statistics of `rows` of stack `stack` with the gradients `gradients`
  /// [rows, block_shape] (after L2 weight decay) and, for the rows with `amortize[i]`, recomputes
  /// the amortized quantities (roots, eigenbases) from the updated statistics, applying the
  /// failure policy (keep the previous result, warn once, raise after too many consecutive
  /// failures).
  virtual void update(int64_t stack, const Rows& rows, const at::Tensor& gradients,
                      const RowScalars& scalars, const std::vector<bool>& amortize) = 0;
  /// Preconditions the filtered gradients [rows, block_shape] of `rows` into `out` (same shape;
  /// it may be `filtered` itself: each block is read before its result is written).
  virtual void precondition(int64_t stack, const Rows& rows, const at::Tensor& filtered,
                            const RowScalars& scalars, at::Tensor& out) const = 0;
  /// The same into a new tensor.
  at::Tensor precondition(int64_t stack, const Rows& rows, const at::Tensor& filtered,
                          const RowScalars& scalars) const {
    auto out = at::empty_like(filtered, at::MemoryFormat::Contiguous);
    precondition(stack, rows, filtered, scalars, out);
    return out;
  }

  /// True when the preconditioner is the identity until its first amortized computation (root
  /// inverse: roots start as I), so callers may skip precondition() before then. Eigenvalue-
  /// corrected Shampoo divides by its second moment from the first step on: false.
  virtual bool identity_before_amortization() const = 0;

  /// Per-member state for checkpoints and for rebuilding stacks: name -> tensor (copies).
  virtual std::map<std::string, at::Tensor> export_member(int64_t stack, int64_t row) const = 0;
  /// Restores what export_member produced; throws naming the missing or mismatched entry.
  virtual void import_member(int64_t stack, int64_t row,
                             const std::map<std::string, at::Tensor>& state) = 0;
  /// For an undo journal: what a step can change of the member. With `amortized` false (the
  /// step does not run the member's amortized computation) without the state only that
  /// computation changes (inverse roots, eigenbases); import_changing restores it.
  virtual std::map<std::string, at::Tensor> export_changing(int64_t stack, int64_t row,
                                                            bool /*amortized*/) const {
    return export_member(stack, row);
  }
  virtual void import_changing(int64_t stack, int64_t row,
                               const std::map<std::string, at::Tensor>& state) {
    import_member(stack, row, state);
  }

  /// Whether the amortized computation of `rows` (those due at this step, with their scalars)
  /// could raise: a member at the limit of its tolerated consecutive failures, or a factor that
  /// the update with gradients bounded by `gradient_bound[i]` (max |G'| of row i) may make
  /// non-finite. Called before anything of the step changes, so a step that may raise can be
  /// protected (its state saved); throws at once, naming the block, when a factor already is
  /// non-finite. Methods without amortized computations never raise.
  virtual bool amortization_may_raise(int64_t /*stack*/, const Rows& /*rows*/,
                                      const RowScalars& /*scalars*/,
                                      const std::vector<double>& /*gradient_bound*/) const {
    return false;
  }

  virtual const AmortizedCounters& counters() const = 0;
  /// Puts back counters saved before a step that was rolled back.
  virtual void set_counters(const AmortizedCounters& counters) = 0;
  /// Adds the bytes of state held (factors, roots, ...) to `out` by kind.
  virtual void add_memory(MemorySummary& out) const = 0;
  /// Bytes of state held that are derived from what export_member gives and formed again after
  /// an import (eigendecomposed Shampoo's kept roots): state_bytes() is the exported bytes plus
  /// these.
  virtual int64_t derived_state_bytes() const { return 0; }
  /// Bytes of state held: the sum of add_memory's kinds.
  int64_t state_bytes() const {
    MemorySummary memory;
    add_memory(memory);
    return memory.state_total();
  }
};

}  // namespace shampoo::detail
