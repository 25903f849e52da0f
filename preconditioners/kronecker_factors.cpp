#include "preconditioners/kronecker_factors.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <functional>
#include <limits>
#include <numeric>

#include "preconditioners/byte_bound.h"
#include "preconditioners/kronecker_contractions.h"
#include "preconditioners/matrix_functions.h"

namespace shampoo::detail {

KroneckerFactors::KroneckerFactors(std::vector<StackSpec> stacks,
                                   MatrixPreconditionerSettings settings)
    : settings_(std::move(settings)) {
  for (auto& spec : stacks) {
    Stack s;
    const auto order = static_cast<int64_t>(spec.block_shape.size());
    TORCH_INTERNAL_ASSERT(static_cast<int64_t>(spec.dim_exponents.size()) == order);
    s.factors.resize(order);
    const auto factor_options = spec.options.dtype(settings_.factor_dtype);
    for (int64_t k = 0; k < order; ++k) {
      if (spec.dim_exponents[k] == 0.0) continue;
      s.dims.push_back(k);
      s.factors[k] = SymmetricMatrices(spec.size(), spec.block_shape[k], factor_options,
                                       settings_.symmetric_packing, /*identity=*/false);
    }
    s.consecutive_failures.assign(spec.size(), 0);
    s.warned.assign(spec.size(), false);
    s.spec = std::move(spec);
    stacks_.push_back(std::move(s));
  }
}

namespace {

/// KL-Shampoo's gradient for the factor of dim k: `g` ([count, block_shape], the members
/// begin..begin + count) multiplied along every preconditioned dim j ≠ k by its matrices, in
/// ascending j; `g` itself for Shampoo.
at::Tensor contribution_operand(const at::Tensor& g, const std::vector<int64_t>& dims, int64_t k,
                                const KroneckerFactors::OtherDims* other_dims, int64_t begin,
                                int64_t count) {
  if (other_dims == nullptr) return g;
  auto out = g;
  for (const int64_t j : dims) {
    if (j == k) continue;
    out = stacked_multiply_along_dim(out, (*other_dims)(j, begin, count), j);
  }
  return out;
}

}  // namespace

namespace {
ByteBound factor_update_chunk_limit{int64_t{8} << 20};
ByteBound factor_update_chunk_limit_cuda{int64_t{32} << 20};
}  // namespace

int64_t factor_update_chunk_bytes(const at::Device& device) {
  return device.is_cuda() ? factor_update_chunk_limit_cuda.get() : factor_update_chunk_limit.get();
}

void set_factor_update_chunk_bytes_for_benchmarks(int64_t bytes) {
  factor_update_chunk_limit.set(bytes);
  factor_update_chunk_limit_cuda.set(bytes);
}

void KroneckerFactors::update(int64_t stack, const Rows& rows, const at::Tensor& gradients,
                              const RowScalars& scalars, const OtherDims* other_dims) {
  auto& s = stacks_[stack];
  if (s.dims.empty() || rows.size() == 0) return;
  const auto options = s.spec.options.dtype(settings_.factor_dtype);
  const auto g = gradients.to(settings_.factor_dtype);
  const auto weight = row_scalars(scalars.factor_weight, options, 3);
  // Against the stored entries: [rows, 1] packed, [rows, 1, 1] dense (every factor alike).
  const auto beta2 = row_scalars(scalars.beta2, options, s.factors[s.dims.front()].stored_dims());
  // In chunks of rows, so the outer products of a large stack never all exist at once (the
  // result per block is the same whatever the chunks). The update acts on the stored entries:
  // packed, the lower triangles of the outer products (dense, the products mirrored).
  const int64_t chunk_bytes = factor_update_chunk_bytes(g.device());
  // The rows are a slice of the stack (all of it, or a step chunk's consecutive rows).
  const bool slice = rows.all || rows.consecutive();
  for (const int64_t k : s.dims) {
    auto& factor = s.factors[k];
    const int64_t d = s.spec.block_shape[k];
    const int64_t bytes_per_row =
        d * d * static_cast<int64_t>(c10::elementSize(settings_.factor_dtype));
    const int64_t chunk = std::max<int64_t>(1, chunk_bytes / bytes_per_row);
    for (int64_t begin = 0; begin < rows.size(); begin += chunk) {
      const int64_t count = std::min(chunk, rows.size() - begin);
      const auto operand =
          contribution_operand(g.narrow(0, begin, count), s.dims, k, other_dims, begin, count);
      auto outer = stacked_outer_product_lower(operand, k);
      const auto weight_chunk = weight.narrow(0, begin, count);
      const auto beta2_chunk = beta2.narrow(0, begin, count);
      if (slice && factor.packed()) {
        // One pass, the same bits as the ATen sequence below (symmetric_matrices.h).
        auto target = factor.stored().narrow(0, rows.rows[begin], count);
        if (decay_add_packed_(target, outer, beta2_chunk, weight_chunk)) continue;
      }
      outer.mul_(weight_chunk);
      const auto contribution = factor.to_stored(outer);
      if (rows.all) {
        factor.stored().narrow(0, begin, count).mul_(beta2_chunk).add_(contribution);
      } else {
        Rows part;
        part.rows.assign(rows.rows.begin() + begin, rows.rows.begin() + begin + count);
        auto sub = gather_rows(factor.stored(), part);
        sub.mul_(beta2_chunk).add_(contribution);
        scatter_rows(factor.stored(), part, sub);
      }
    }
  }
}

at::Tensor KroneckerFactors::corrected_factors(int64_t stack, const Rows& rows, int64_t dim,
                                               const RowScalars& scalars) const {
  const auto& s = stacks_[stack];
  const auto& factor = s.factors[dim];
  TORCH_INTERNAL_ASSERT(factor.defined());
  // Divided as stored (packed: half the entries), then unpacked.
  const auto bias =
      row_scalars(scalars.bias_correction2, factor.stored().options(), factor.stored_dims());
  const auto divided = gather_rows(factor.stored(), rows) / bias;
  auto corrected = factor.packed() ? unpack_symmetric(divided, factor.dim()) : divided;
  if (settings_.trace_scaling_exponent != 0.0) {
    // docs/math.md "Trace scaling": A·max(tr A, ε)^(−e), the trace of the corrected factor.
    const auto epsilon = row_scalars(scalars.epsilon, corrected.options(), 2);
    const auto trace = corrected.diagonal(0, -2, -1).sum(-1, /*keepdim=*/true);
    const auto scale = at::maximum(trace, epsilon).pow(-settings_.trace_scaling_exponent);
    corrected = corrected * scale.unsqueeze(-1);
  }
  const auto finite = stacked_all_finite(corrected);
  for (int64_t i = 0; i < rows.size(); ++i) {
    TORCH_CHECK(finite[i], "Shampoo: the Kronecker factor of ", s.spec.names[rows.rows[i]],
                " along dim ", dim, " has non-finite entries at step ", scalars.step[i],
                " (a non-finite gradient reached the optimizer)");
  }
  return corrected;
}

bool KroneckerFactors::may_raise(int64_t stack, const Rows& rows, const RowScalars& scalars,
                                 const std::vector<double>& gradient_bound) const {
  const auto& s = stacks_[stack];
  if (rows.size() == 0 || s.dims.empty()) return false;
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(gradient_bound.size()) == rows.size());
  bool may_raise = false;
  for (const int64_t row : rows.rows) {
    may_raise |= s.consecutive_failures[row] >= settings_.tolerated_failures;
  }
  // Half the largest finite value: the bound is exact arithmetic, the update rounds.
  const double limit = 0.5 * (settings_.factor_dtype == at::kDouble
                                  ? std::numeric_limits<double>::max()
                                  : static_cast<double>(std::numeric_limits<float>::max()));
  const int64_t numel = std::accumulate(s.spec.block_shape.begin(), s.spec.block_shape.end(),
                                        int64_t{1}, std::multiplies<>());
  for (const int64_t k : s.dims) {
    // max |L| of every member: one reduction over the stack, no copy of the rows.
    const auto norms = s.factors[k].max_abs().to(at::kCPU);
    const auto* max_abs = norms.data_ptr<double>();
    const double contracted = static_cast<double>(numel / s.spec.block_shape[k]);
    for (int64_t i = 0; i < rows.size(); ++i) {
      const int64_t row = rows.rows[i];
      TORCH_CHECK(std::isfinite(max_abs[row]), "Shampoo: the Kronecker factor of ",
                  s.spec.names[row], " along dim ", k, " has non-finite entries before step ",
                  scalars.step[i], " (a non-finite gradient reached the optimizer earlier)");
      const double g = gradient_bound[i];
      const double bound =
          (scalars.beta2[i] * max_abs[row] + scalars.factor_weight[i] * contracted * g * g) /
          scalars.bias_correction2[i];
      may_raise |= !(bound <= limit);
    }
  }
  return may_raise;
}

bool KroneckerFactors::injected_failure(int64_t stack, int64_t row, int64_t dim) const {
  return settings_.inject_failure && settings_.inject_failure(stacks_[stack].spec.names[row], dim);
}

void KroneckerFactors::record_outcome(int64_t stack, int64_t row, bool failed, int64_t step) {
  auto& s = stacks_[stack];
  ++counters_.computations;
  if (!failed) {
    s.consecutive_failures[row] = 0;
    return;
  }
  ++counters_.failures;
  const int64_t count = ++s.consecutive_failures[row];
  if (!s.warned[row]) {
    s.warned[row] = true;
    TORCH_WARN("Shampoo: the amortized computation of ", s.spec.names[row], " failed at step ",
               step, "; keeping its previous preconditioner (warned once per block)");
  }
  TORCH_CHECK(
      count <= settings_.tolerated_failures, "Shampoo: the amortized computation of ",
      s.spec.names[row], " failed ", count, " times in a row (last at step ", step,
      "), more than num_tolerated_failed_amortized_computations = ", settings_.tolerated_failures);
}

void KroneckerFactors::export_member(int64_t stack, int64_t row,
                                     std::map<std::string, at::Tensor>& out) const {
  const auto& s = stacks_[stack];
  for (const int64_t k : s.dims) {
    out["factor_" + std::to_string(k)] = s.factors[k].export_row(row);
  }
  out["consecutive_failures"] = at::tensor(s.consecutive_failures[row]);
}

void KroneckerFactors::import_member(int64_t stack, int64_t row,
                                     const std::map<std::string, at::Tensor>& in) {
  auto& s = stacks_[stack];
  for (const int64_t k : s.dims) {
    const auto key = "factor_" + std::to_string(k);
    s.factors[k].import_row(row, checked_entry(in, key, s.spec.names[row]), key, s.spec.names[row]);
  }
  const auto it = in.find("consecutive_failures");
  s.consecutive_failures[row] = it == in.end() ? 0 : it->second.item<int64_t>();
}

int64_t KroneckerFactors::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& s : stacks_) {
    for (const auto& f : s.factors) bytes += f.bytes();
  }
  return bytes;
}

}  // namespace shampoo::detail
