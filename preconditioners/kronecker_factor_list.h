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

class KroneckerFactorList : public PreconditionerList {
 public:
  void update(int64_t stack, const Rows& rows, const at::Tensor& gradients,
              const RowScalars& scalars, const std::vector<bool>& amortize) final;
  std::map<std::string, at::Tensor> export_member(int64_t stack, int64_t row) const final;
  void import_member(int64_t stack, int64_t row,
                     const std::map<std::string, at::Tensor>& state) final;
  const AmortizedCounters& counters() const final { return factors_.counters(); }
  void set_counters(const AmortizedCounters& counters) final { factors_.set_counters(counters); }
  bool amortization_may_raise(int64_t stack, const Rows& rows, const RowScalars& scalars,
                              const std::vector<double>& gradient_bound) const final {
    return factors_.may_raise(stack, rows, scalars, gradient_bound);
  }
  int64_t state_bytes() const final;

 protected:
  KroneckerFactorList(std::vector<StackSpec> stacks, MatrixPreconditionerSettings settings);

  /// Bytes of a block's factors plus, per preconditioned dim of size d, `matrices_per_dim` more
  /// d×d and `vectors_per_dim` d-vectors, all in the factor dtype: the estimate of the kept
  /// per-dim state.
  static int64_t estimated_factor_bytes(const BlockLayout& layout, int64_t matrices_per_dim,
                                        int64_t vectors_per_dim);

  /// How a registered state starts.
  enum class Start { kIdentity, kOnes, kZeros };
  /// Registers a state kept per preconditioned dim k under "<prefix><k>": [n, d, d] when
  /// `matrix`, else [n, d], in the factor dtype. Returns its id (registration order).
  int add_dim_state(std::string prefix, bool matrix, Start start);
  /// Registers a state kept per block under `name`: [n, block_shape] in the blocks' dtype, zeros.
  int add_block_state(std::string name);
  const at::Tensor& dim_state(int id, int64_t stack, int64_t dim) const {
    return states_[id].tensors[stack][dim];
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
  /// The amortized computation of the due rows; by default amortize_rows at once (root-inverse
  /// Shampoo bounds its working set in chunks).
  virtual void amortize(int64_t stack, const Rows& rows, const RowScalars& scalars) {
    amortize_rows(stack, rows, scalars);
  }
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

  KroneckerFactors factors_;

 private:
  enum class Shape { kDimMatrix, kDimVector, kBlock };
  struct KeptState {
    std::string name;
    Shape shape;
    std::vector<std::vector<at::Tensor>> tensors;  // [stack][dim], or [stack][0] per block
  };
  std::string state_key(const KeptState& state, int64_t dim) const;
  std::vector<KeptState> states_;
};

}  // namespace shampoo::detail
