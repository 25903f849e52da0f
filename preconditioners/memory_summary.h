#pragma once
/// The bytes of an optimizer's state by kind: DistributedShampoo::memory_summary() (what this rank
/// holds), the large-state warning (the estimate before the state exists) and the trainer's log.

#include <cstdint>
#include <string>
#include <vector>

namespace shampoo {

/// What one parameter gets from DistributedShampoo: which dims keep Kronecker factors, or the
/// grafting update (shampoo/factor_choice.h), and its share of the state.
struct ParamPreconditioning {
  int64_t param = -1;  ///< index over all groups, as in BlockId
  int64_t group = -1;
  std::vector<int64_t> shape;
  /// "Kronecker factors on every dim", "Kronecker factors on dims 1 (dim 0: 10000 >
  /// max_factored_dim 4096)", "the grafting method's update (a 1-D parameter; ...)", ...
  std::string treatment;
  int64_t param_bytes = 0;
  /// Estimated from its block plan over all its blocks, whichever rank owns them: factors, their
  /// roots or eigenbases, and the grafting state (the β1 filter and momentum, each at most the
  /// parameter's size, come on top).
  int64_t state_bytes = 0;
};

struct MemorySummary {
  /// Kronecker factors L (packed lower triangles with use_symmetric_packing).
  int64_t factors = 0;
  /// Inverse roots of root-inverse Shampoo and KL-Shampoo (packed as the factors).
  int64_t inverse_roots = 0;
  /// Eigenvectors and eigenvalues (eigendecomposed Shampoo), eigenbases (eigenvalue-corrected).
  int64_t eigenvectors = 0;
  /// Other statistics of the preconditioner: eigenvalue-corrected Shampoo's second moment, the
  /// diagonal families' second moment.
  int64_t preconditioner_other = 0;
  /// Grafting's second moment V.
  int64_t grafting = 0;
  /// The β1 filter of the gradient M.
  int64_t filtered_gradient = 0;
  /// Momentum B.
  int64_t momentum = 0;
  /// Iterate averaging's sequence Z.
  int64_t averaging = 0;
  /// Not state: what the last step copied to be able to undo itself (its journal; equals
  /// ShampooStats::rollback_bytes_last_step).
  int64_t scratch_last_step = 0;

  /// Per parameter, in index order (every parameter of the optimizer, not only this rank's).
  std::vector<ParamPreconditioning> params;

  /// Every kind of state, without the scratch.
  int64_t state_total() const {
    return factors + inverse_roots + eigenvectors + preconditioner_other + grafting +
           filtered_gradient + momentum + averaging;
  }
  MemorySummary& operator+=(const MemorySummary& o) {
    factors += o.factors;
    inverse_roots += o.inverse_roots;
    eigenvectors += o.eigenvectors;
    preconditioner_other += o.preconditioner_other;
    grafting += o.grafting;
    filtered_gradient += o.filtered_gradient;
    momentum += o.momentum;
    averaging += o.averaging;
    scratch_last_step += o.scratch_last_step;
    params.insert(params.end(), o.params.begin(), o.params.end());
    return *this;
  }
  /// One line per non-zero kind, "  factors            163.7 MB", then the total; in MB (1e6);
  /// then a line per parameter (params_to_string()).
  std::string to_string() const;
  /// A line per parameter: "  parameter 0 [10000, 128]: Kronecker factors on dims 1 (...);
  /// 5.1 MB, state 5.2 MB".
  std::string params_to_string() const;
  /// The same on one line: "163.7 MB factors, 163.7 MB inverse roots, ...; state 562.5 MB".
  std::string to_line() const;
};

}  // namespace shampoo
