#include "preconditioners/shampoo_preconditioner_list.h"

#include <algorithm>

#include "preconditioners/kronecker_contractions.h"
#include "preconditioners/matrix_functions.h"

namespace shampoo::detail {

ShampooPreconditionerList::ShampooPreconditionerList(std::vector<StackSpec> stacks,
                                                     MatrixPreconditionerSettings settings)
    : factors_(std::move(stacks), std::move(settings)) {
  roots_.resize(factors_.num_stacks());
  for (int64_t s = 0; s < factors_.num_stacks(); ++s) {
    const auto& spec = factors_.spec(s);
    roots_[s].resize(spec.block_shape.size());
    const auto options = spec.options.dtype(factors_.settings().factor_dtype);
    for (const int64_t k : factors_.preconditioned_dims(s)) {
      const int64_t d = spec.block_shape[k];
      // Inverse roots start as the identity (docs/math.md).
      roots_[s][k] = at::eye(d, options).expand({spec.size(), d, d}).contiguous();
    }
  }
}

void ShampooPreconditionerList::update(int64_t stack, const Rows& rows, const at::Tensor& gradients,
                                       const RowScalars& scalars,
                                       const std::vector<bool>& amortize) {
  if (factors_.settings().statistics == FactorStatistics::kKL) {
    // KL-Shampoo: every factor sees the gradient preconditioned along the other dims by the roots
    // of the last amortized computation (identity before the first), all before this step's roots.
    std::vector<at::Tensor> roots(roots_[stack].size());
    for (const int64_t k : factors_.preconditioned_dims(stack)) {
      roots[k] = gather_rows(roots_[stack][k], rows);
    }
    factors_.update(stack, rows, gradients, scalars, &roots);
  } else {
    factors_.update(stack, rows, gradients, scalars);
  }
  const auto [due, due_scalars] = select_rows(rows, scalars, amortize);
  compute_roots(stack, due, due_scalars);
}

void ShampooPreconditionerList::compute_roots(int64_t stack, const Rows& rows,
                                              const RowScalars& scalars) {
  // In chunks of at most kRootChunkBytes per factor: the bias-corrected copies and the solvers'
  // working sets are then bounded by the chunk, not by the stack (a stack of 28 1024×1024
  // factors would otherwise hold several 112 MB copies at once). Every matrix is computed on its
  // own, so the chunking does not change a result.
  const auto& spec = factors_.spec(stack);
  int64_t largest = 1;
  for (const int64_t k : factors_.preconditioned_dims(stack)) {
    largest = std::max(largest, spec.block_shape[k] * spec.block_shape[k]);
  }
  const int64_t element = static_cast<int64_t>(c10::elementSize(factors_.settings().factor_dtype));
  const int64_t per_chunk = std::max<int64_t>(1, kRootChunkBytes / (largest * element));
  for (int64_t start = 0; start < rows.size(); start += per_chunk) {
    std::vector<bool> selected(rows.size(), false);
    std::fill(selected.begin() + start, selected.begin() + std::min(rows.size(), start + per_chunk),
              true);
    const auto [chunk, chunk_scalars] = select_rows(rows, scalars, selected);
    compute_root_chunk(stack, chunk, chunk_scalars);
  }
}

void ShampooPreconditionerList::compute_root_chunk(int64_t stack, const Rows& rows,
                                                   const RowScalars& scalars) {
  if (rows.size() == 0) return;
  const auto& spec = factors_.spec(stack);
  std::vector<bool> member_failed(rows.size(), false);
  for (const int64_t k : factors_.preconditioned_dims(stack)) {
    const auto corrected = factors_.corrected_factors(stack, rows, k, scalars);
    const std::vector<double> exponents(rows.size(), spec.dim_exponents[k]);
    const auto& solver = factors_.settings().root_solver;
    const auto& pseudo_inverse = factors_.settings().pseudo_inverse;
    auto result = stacked_inverse_root(
        corrected, scalars.epsilon, exponents, factors_.settings().retry_double_precision,
        solver ? &*solver : nullptr, pseudo_inverse ? &*pseudo_inverse : nullptr);
    factors_.record_double_retries(result.retried_in_double);
    factors_.record_solver_fallbacks(result.solver_fallbacks);
    for (int64_t i = 0; i < rows.size(); ++i) {
      if (factors_.injected_failure(stack, rows.rows[i], k)) result.failed[i] = true;
    }
    // A non-finite root (e.g. ε^(−e) overflowing the factor dtype for a large exponent) counts
    // as a failed computation, as a failed decomposition does: the previous root is kept and the
    // failure policy decides.
    const auto finite = stacked_all_finite(result.values);
    for (int64_t i = 0; i < rows.size(); ++i) {
      const int64_t row = rows.rows[i];
      if (result.failed[i] || !finite[i]) {
        member_failed[i] = true;
        continue;  // keep the previous root
      }
      roots_[stack][k][row].copy_(result.values[i]);
    }
  }
  for (int64_t i = 0; i < rows.size(); ++i) {
    factors_.record_outcome(stack, rows.rows[i], member_failed[i], scalars.step[i]);
  }
}

void ShampooPreconditionerList::precondition(int64_t stack, const Rows& rows,
                                             const at::Tensor& filtered,
                                             const RowScalars& /*scalars*/, at::Tensor& out) const {
  const auto dtype = filtered.scalar_type();
  const auto& dims = factors_.preconditioned_dims(stack);
  if (rows.size() == 0) return;
  if (filtered.is_cuda()) {
    // Batched, in chunks of at most kRootChunkBytes of blocks: each dim's product is a new
    // tensor, so a whole stack at once would hold two stack-sized temporaries.
    const int64_t block_bytes = filtered[0].numel() * static_cast<int64_t>(filtered.element_size());
    const int64_t per_chunk =
        std::max<int64_t>(1, kRootChunkBytes / std::max<int64_t>(1, block_bytes));
    for (int64_t start = 0; start < rows.size(); start += per_chunk) {
      const int64_t count = std::min(per_chunk, rows.size() - start);
      Rows part;
      part.rows.assign(rows.rows.begin() + start, rows.rows.begin() + start + count);
      part.all = rows.all && count == rows.size();
      auto result = filtered.narrow(0, start, count);
      for (const int64_t k : dims) {
        const auto roots = part.all   ? roots_[stack][k]
                           : rows.all ? roots_[stack][k].narrow(0, start, count)
                                      : gather_rows(roots_[stack][k], part);
        result = stacked_multiply_along_dim(result, roots.to(dtype), k);
      }
      auto target = out.narrow(0, start, count);
      if (!result.is_same(target)) target.copy_(result);
    }
    return;
  }
  // One block at a time: the temporaries are block-sized, never a whole stack.
  for (int64_t i = 0; i < rows.size(); ++i) {
    auto block = filtered[i];
    for (const int64_t k : dims) {
      block = block_multiply_along_dim(block, roots_[stack][k][rows.rows[i]].to(dtype), k);
    }
    if (!block.is_same(out[i])) out[i].copy_(block);
  }
}

std::map<std::string, at::Tensor> ShampooPreconditionerList::export_member(int64_t stack,
                                                                           int64_t row) const {
  std::map<std::string, at::Tensor> out;
  factors_.export_member(stack, row, out);
  for (const int64_t k : factors_.preconditioned_dims(stack)) {
    out["root_" + std::to_string(k)] = roots_[stack][k][row].clone();
  }
  return out;
}

void ShampooPreconditionerList::import_member(int64_t stack, int64_t row,
                                              const std::map<std::string, at::Tensor>& state) {
  factors_.import_member(stack, row, state);
  const auto& spec = factors_.spec(stack);
  for (const int64_t k : factors_.preconditioned_dims(stack)) {
    const int64_t d = spec.block_shape[k];
    roots_[stack][k][row].copy_(checked_state(state, "root_" + std::to_string(k), {d, d},
                                              roots_[stack][k].options(), spec.names[row]));
  }
}

int64_t ShampooPreconditionerList::state_bytes() const {
  int64_t bytes = factors_.state_bytes();
  for (const auto& stack : roots_) {
    for (const auto& r : stack) {
      if (r.defined()) bytes += r.numel() * static_cast<int64_t>(r.element_size());
    }
  }
  return bytes;
}

}  // namespace shampoo::detail
