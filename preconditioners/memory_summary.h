#pragma once
/// The bytes of an optimizer's state by kind: DistributedShampoo::memory_summary() (what this rank
/// holds), the large-state warning (the estimate before the state exists) and the trainer's log.

#include <cstdint>
#include <string>

namespace shampoo {

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
    return *this;
  }
  /// One line per non-zero kind, "  factors            163.7 MB", then the total; in MB (1e6).
  std::string to_string() const;
  /// The same on one line: "163.7 MB factors, 163.7 MB inverse roots, ...; state 562.5 MB".
  std::string to_line() const;
};

}  // namespace shampoo
