#pragma once
/// Kronecker factor statistics shared by the matrix preconditioners (root-inverse, eigendecomposed
/// and eigenvalue-corrected Shampoo, and KL-Shampoo): per stack and per preconditioned block dim, a
/// stack of factor matrices L [n, d, d] updated as L ← β2·L + w·(G contracted with itself over the
/// other dims; for KL-Shampoo G first multiplied along the other dims by their inverse roots), plus
/// the failure policy of the amortized computations on them.

#include <ATen/ATen.h>

#include <functional>
#include <vector>

#include "preconditioners/preconditioner_list.h"
#include "preconditioners/symmetric_matrices.h"

namespace shampoo::detail {

/// Bound of the outer products a factor update holds at once: 8 MiB on the CPU; 32 MiB on CUDA
/// (eight 1024×1024 float32 products per batched product: on an H100 the plain step of
/// bench_transformer took 7.90 ms against 8.24 at 8 MiB, 2026-11-26). On the CPU every block is
/// computed on its own, so the bound changes no result; on CUDA the batched products may round
/// differently with the batch size (within float32 tolerance, as for the step's chunks).
/// Benchmarks set it for both devices (≤ 0 = the defaults) to weigh launches against memory:
/// `bench_transformer --factor-chunk-mb`.
int64_t factor_update_chunk_bytes(const at::Device& device);
void set_factor_update_chunk_bytes_for_benchmarks(int64_t bytes);

class KroneckerFactors {
 public:
  KroneckerFactors(std::vector<StackSpec> stacks, MatrixPreconditionerSettings settings);

  int64_t num_stacks() const { return static_cast<int64_t>(stacks_.size()); }
  const StackSpec& spec(int64_t stack) const { return stacks_[stack].spec; }
  const MatrixPreconditionerSettings& settings() const { return settings_; }
  /// Block dims that carry a factor (exponent ≠ 0), ascending.
  const std::vector<int64_t>& preconditioned_dims(int64_t stack) const {
    return stacks_[stack].dims;
  }

  /// KL-Shampoo's hook: the matrices M_j ([count, d_j, d_j], factor dtype) of the members
  /// rows.rows[begin .. begin + count) along block dim j.
  using OtherDims = std::function<at::Tensor(int64_t j, int64_t begin, int64_t count)>;

  /// L ← β2·L + w·outer(G) for `rows`, every preconditioned dim, in chunks of rows. With
  /// `other_dims` the contribution to dim k is outer(G ×_j M_j over every preconditioned j ≠ k),
  /// the products in ascending j.
  void update(int64_t stack, const Rows& rows, const at::Tensor& gradients,
              const RowScalars& scalars, const OtherDims* other_dims = nullptr);

  /// The factors of `rows` along `dim` divided by their bias corrections, in the factor dtype
  /// ([rows, d, d], a new tensor). Checks that they are finite: a non-finite factor is an error
  /// naming the block, the dim and the step.
  at::Tensor corrected_factors(int64_t stack, const Rows& rows, int64_t dim,
                               const RowScalars& scalars) const;

  /// The raw factors of `dim`; undefined for an unpreconditioned dim.
  const SymmetricMatrices& factor(int64_t stack, int64_t dim) const {
    return stacks_[stack].factors[dim];
  }

  /// Whether the failure injector asks (block, dim) to fail.
  bool injected_failure(int64_t stack, int64_t row, int64_t dim) const;

  /// Records the outcome of one amortized computation of a member (failed = some dim failed):
  /// counts it, warns once per member, resets the consecutive count on success and raises when a
  /// member has failed more than `tolerated_failures` times in a row.
  void record_outcome(int64_t stack, int64_t row, bool failed, int64_t step);

  /// PreconditionerList::amortization_may_raise for the members `rows` due at this step: true
  /// when one of them has failed `tolerated_failures` times in a row already, or when
  /// β2·max|L| + w·(numel/d)·max|G'|², divided by the bias correction, may overflow the factor
  /// dtype (each entry of the contraction is at most (numel/d)·max|G'|²). Throws when a factor
  /// is non-finite already.
  bool may_raise(int64_t stack, const Rows& rows, const RowScalars& scalars,
                 const std::vector<double>& gradient_bound) const;

  const AmortizedCounters& counters() const { return counters_; }
  void set_counters(const AmortizedCounters& counters) { counters_ = counters; }
  void record_double_retries(int64_t count) { counters_.retried_in_double += count; }
  void record_solver_fallbacks(int64_t count) { counters_.solver_fallbacks += count; }
  void record_batched_call() { ++counters_.batched_calls; }

  void export_member(int64_t stack, int64_t row, std::map<std::string, at::Tensor>& out) const;
  void import_member(int64_t stack, int64_t row, const std::map<std::string, at::Tensor>& in);
  int64_t state_bytes() const;

 private:
  struct Stack {
    StackSpec spec;
    std::vector<int64_t> dims;
    std::vector<SymmetricMatrices> factors;  // per block dim; undefined when not preconditioned
    std::vector<int64_t> consecutive_failures;
    std::vector<bool> warned;
  };
  std::vector<Stack> stacks_;
  MatrixPreconditionerSettings settings_;
  AmortizedCounters counters_;
};

}  // namespace shampoo::detail
