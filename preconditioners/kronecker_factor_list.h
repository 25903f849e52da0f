#pragma once
/// The base of the Kronecker-factor lists (root-inverse, eigendecomposed and eigenvalue-corrected
/// Shampoo, and KL-Shampoo). It owns the factors (KroneckerFactors) and the state each family
/// keeps from its amortized computations, registered by name (per preconditioned dim, e.g. the
/// roots "root_<k>", or per block, e.g. SOAP's "corrections"), and does once what every such list
/// does: the update order (KL operands, factors, amortized computation of the due rows, the
/// family's after-update), the failure policy of the amortized computation, export and import of
/// a member's state, the counters and the state size. A family implements compute_dim (its
/// amortized computation along one dim), precondition, and where it applies kl_operand,
/// amortize and after_update.

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "preconditioners/kronecker_factors.h"
#include "preconditioners/preconditioner_list.h"

namespace shampoo::detail {

/// Bound of the factor bytes one amortized computation works on at once: 32 MiB, eight 1024×1024
/// float32 factors, enough to fill the eight concurrent eigh lanes on CUDA. The chunks never
/// change a result (every matrix is computed on its own); benchmarks set the bound (≤ 0 = the
/// default) to weigh the peak memory against the roots' time.
int64_t amortize_chunk_bytes();
void set_amortize_chunk_bytes_for_benchmarks(int64_t bytes);

class KroneckerFactorList : public PreconditionerList {
 public:
  void update(int64_t stack, const Rows& rows, const at::Tensor& gradients,
              const RowScalars& scalars, const std::vector<bool>& amortize) final;
  std::map<std::string, at::Tensor> export_member(int64_t stack, int64_t row) const final;
  void import_member(int64_t stack, int64_t row,
                     const std::map<std::string, at::Tensor>& state) final;
  std::map<std::string, at::Tensor> export_changing(int64_t stack, int64_t row,
                                                    bool amortized) const final;
  void import_changing(int64_t stack, int64_t row,
                       const std::map<std::string, at::Tensor>& state) final;
  const AmortizedCounters& counters() const final { return factors_.counters(); }
  void set_counters(const AmortizedCounters& counters) final { factors_.set_counters(counters); }
  bool amortization_may_raise(int64_t stack, const Rows& rows, const RowScalars& scalars,
                              const std::vector<double>& gradient_bound) const final {
    return factors_.may_raise(stack, rows, scalars, gradient_bound);
  }
  void add_memory(MemorySummary& out) const final;

 protected:
  KroneckerFactorList(std::vector<StackSpec> stacks, MatrixPreconditionerSettings settings);

  /// The dtype a per-dim state is kept in: the factor dtype, or the narrower of the factor dtype
  /// and the blocks' compute dtype (a state that is only ever read cast to the compute dtype, such
  /// as root-inverse Shampoo's roots: with float64 factors and float32 parameters they are
  /// rounded to float32 once, when computed, not at every step, and take half the memory; the
  /// same bits reach the step). Compact states keep the factor dtype (their encoding rounds from
  /// it).
  enum class KeptDtype { kFactor, kNarrowerOfFactorAndCompute };
  /// Bytes of a block's factors plus, per preconditioned dim of size d, `symmetric_per_dim` more
  /// symmetric d×d (packed with layout.symmetric_packing), `matrices_per_dim` d×d and
  /// `vectors_per_dim` d-vectors, all in the factor dtype (the symmetric ones in `symmetric_in`,
  /// see add_dim_state): the estimate of the kept per-dim state.
  static int64_t estimated_factor_bytes(const BlockLayout& layout, int64_t symmetric_per_dim,
                                        int64_t matrices_per_dim, int64_t vectors_per_dim,
                                        KeptDtype symmetric_in = KeptDtype::kFactor);

  /// How a registered state starts.
  enum class Start { kIdentity, kOnes, kZeros };
  /// What a per-dim state holds: a d×d matrix, a symmetric d×d matrix (stored packed with
  /// MatrixPreconditionerSettings::symmetric_packing), or a d-vector.
  enum class DimState { kMatrix, kSymmetric, kVector };
  /// What a kept state counts as in memory_summary().
  using MemoryKind = int64_t MemorySummary::*;
  /// Registers a state kept per preconditioned dim k under "<prefix><k>": [n, d, d] or [n, d]
  /// in `dtype`. Returns its id (registration order).
  int add_dim_state(std::string prefix, DimState kind, Start start, MemoryKind memory,
                    KeptDtype dtype = KeptDtype::kFactor);
  /// Registers a state kept per block under `name`: [n, block_shape] in the blocks' dtype, zeros.
  int add_block_state(std::string name, MemoryKind memory);
  /// A kMatrix or kVector state.
  const at::Tensor& dim_state(int id, int64_t stack, int64_t dim) const {
    return states_[id].tensors[stack][dim];
  }
  /// A kSymmetric state.
  const SymmetricMatrices& symmetric_state(int id, int64_t stack, int64_t dim) const {
    return states_[id].symmetric[stack][dim];
  }
  const at::Tensor& block_state(int id, int64_t stack) const {
    return states_[id].tensors[stack][0];
  }
  at::Tensor& block_state(int id, int64_t stack) { return states_[id].tensors[stack][0]; }

  /// The amortized computation of `rows` along `dim`: one stack [rows, ...] per registered
  /// per-dim state, in registration order, and the rows that failed (their state is kept).
  struct DimResult {
    std::vector<at::Tensor> values;
    std::vector<bool> failed;
  };
  virtual DimResult compute_dim(int64_t stack, const Rows& rows, int64_t dim,
                                const RowScalars& scalars) = 0;
  /// The amortized computation of the due rows, in chunks of at most amortize_chunk_bytes() of the
  /// largest factor: the unpacked, bias-corrected copies and the solvers' working sets are then
  /// bounded by the chunk, not by the stack. Every matrix is computed on its own, so the chunks
  /// do not change a result.
  void amortize(int64_t stack, const Rows& rows, const RowScalars& scalars);
  /// compute_dim for every preconditioned dim, committing what succeeded and recording each
  /// member's outcome (the failure policy of KroneckerFactors::record_outcome).
  void amortize_rows(int64_t stack, const Rows& rows, const RowScalars& scalars);
  /// KL-Shampoo: the matrix X_j of `rows` along `dim` that the other dims' statistics multiply
  /// by ([rows, d, d], factor dtype). Only called with FactorStatistics::kKL.
  virtual at::Tensor kl_operand(int64_t stack, const Rows& rows, int64_t dim,
                                const RowScalars& scalars) const;
  /// After the amortized computation of an update (eigenvalue-corrected Shampoo's second moment).
  virtual void after_update(int64_t /*stack*/, const Rows& /*rows*/,
                            const at::Tensor& /*gradients*/, const RowScalars& /*scalars*/) {}
  /// After the registered states of member `row` may have changed (its amortized computation, an
  /// import): for what a family derives from them and keeps (eigendecomposed Shampoo's roots).
  virtual void states_changed(int64_t /*stack*/, int64_t /*row*/) {}

  KroneckerFactors factors_;

 private:
  enum class Shape { kDimMatrix, kDimSymmetric, kDimVector, kBlock };
  struct KeptState {
    std::string name;
    Shape shape;
    MemoryKind memory;
    std::vector<std::vector<at::Tensor>> tensors;           // [stack][dim], or [stack][0] per block
    std::vector<std::vector<SymmetricMatrices>> symmetric;  // [stack][dim] (kDimSymmetric)
  };
  std::string state_key(const KeptState& state, int64_t dim) const;
  void import_state(int64_t stack, int64_t row, const std::map<std::string, at::Tensor>& in,
                    bool require_all);
  std::vector<KeptState> states_;
};

}  // namespace shampoo::detail
