#include "preconditioners/kronecker_factor_list.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

#include "preconditioners/byte_bound.h"

namespace shampoo::detail {
namespace {
ByteBound amortize_chunk_limit{int64_t{32} << 20};
}  // namespace

int64_t amortize_chunk_bytes() { return amortize_chunk_limit.get(); }

void set_amortize_chunk_bytes_for_benchmarks(int64_t bytes) { amortize_chunk_limit.set(bytes); }

int64_t BlockLayout::numel() const {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

KroneckerFactorList::KroneckerFactorList(std::vector<StackSpec> stacks,
                                         MatrixPreconditionerSettings settings)
    : factors_(std::move(stacks), std::move(settings)) {}

namespace {

/// The narrower of two floating dtypes (float32 against float64: float32).
at::ScalarType narrower(at::ScalarType a, at::ScalarType b) {
  return c10::elementSize(a) <= c10::elementSize(b) ? a : b;
}

}  // namespace

int64_t KroneckerFactorList::estimated_factor_bytes(const BlockLayout& layout,
                                                    int64_t symmetric_per_dim,
                                                    int64_t matrices_per_dim,
                                                    int64_t vectors_per_dim,
                                                    KeptDtype symmetric_in) {
  const int64_t kept_element =
      symmetric_in == KeptDtype::kFactor || layout.compact != CompactState::kNone
          ? layout.factor_element_size
          : std::min(layout.factor_element_size, layout.state_element_size);
  int64_t bytes = 0;
  for (size_t k = 0; k < layout.shape.size(); ++k) {
    if (layout.dim_exponents[k] == 0.0) continue;  // no factor, no kept state
    const int64_t d = layout.shape[k];
    const int64_t symmetric = layout.symmetric_packing ? packed_size(d) : d * d;
    // The kept symmetric states (inverse roots) as SymmetricMatrices stores them.
    int64_t kept_symmetric = symmetric * kept_element;
    if (layout.compact == CompactState::kBfloat16) kept_symmetric = symmetric * 2;
    if (layout.compact == CompactState::kInt8) {
      const int64_t groups = (symmetric + kCompactGroup - 1) / kCompactGroup;
      kept_symmetric = groups * (kCompactGroup + 4) + d * layout.factor_element_size;
    }
    bytes +=
        symmetric_per_dim * kept_symmetric +
        (symmetric + matrices_per_dim * d * d + vectors_per_dim * d) * layout.factor_element_size;
  }
  return bytes;
}

int KroneckerFactorList::add_dim_state(std::string prefix, DimState kind, Start start,
                                       MemoryKind memory, KeptDtype dtype) {
  const Shape shape = kind == DimState::kMatrix      ? Shape::kDimMatrix
                      : kind == DimState::kSymmetric ? Shape::kDimSymmetric
                                                     : Shape::kDimVector;
  KeptState state{std::move(prefix), shape, memory, {}, {}};
  state.tensors.resize(factors_.num_stacks());
  state.symmetric.resize(factors_.num_stacks());
  for (int64_t s = 0; s < factors_.num_stacks(); ++s) {
    const auto& spec = factors_.spec(s);
    state.tensors[s].resize(spec.block_shape.size());
    state.symmetric[s].resize(spec.block_shape.size());
    const auto factor_dtype = factors_.settings().factor_dtype;
    const bool narrow = dtype == KeptDtype::kNarrowerOfFactorAndCompute &&
                        factors_.settings().compact == CompactState::kNone;
    const auto options = spec.options.dtype(
        narrow ? narrower(factor_dtype, spec.options.dtype().toScalarType()) : factor_dtype);
    for (const int64_t k : factors_.preconditioned_dims(s)) {
      const int64_t d = spec.block_shape[k];
      if (shape == Shape::kDimSymmetric) {
        TORCH_INTERNAL_ASSERT(start != Start::kOnes);
        state.symmetric[s][k] =
            SymmetricMatrices(spec.size(), d, options, factors_.settings().symmetric_packing,
                              /*identity=*/start == Start::kIdentity, factors_.settings().compact);
        continue;
      }
      const bool matrix = shape == Shape::kDimMatrix;
      at::Tensor t;
      if (matrix && start == Start::kIdentity) {
        t = at::eye(d, options).expand({spec.size(), d, d}).contiguous();
      } else {
        const auto sizes =
            matrix ? std::vector<int64_t>{spec.size(), d, d} : std::vector<int64_t>{spec.size(), d};
        t = start == Start::kZeros ? at::zeros(sizes, options) : at::ones(sizes, options);
      }
      state.tensors[s][k] = std::move(t);
    }
  }
  states_.push_back(std::move(state));
  return static_cast<int>(states_.size()) - 1;
}

int KroneckerFactorList::add_block_state(std::string name, MemoryKind memory) {
  KeptState state{std::move(name), Shape::kBlock, memory, {}, {}};
  state.tensors.resize(factors_.num_stacks());
  for (int64_t s = 0; s < factors_.num_stacks(); ++s) {
    const auto& spec = factors_.spec(s);
    std::vector<int64_t> shape{spec.size()};
    shape.insert(shape.end(), spec.block_shape.begin(), spec.block_shape.end());
    state.tensors[s] = {at::zeros(shape, spec.options)};
  }
  states_.push_back(std::move(state));
  return static_cast<int>(states_.size()) - 1;
}

std::string KroneckerFactorList::state_key(const KeptState& state, int64_t dim) const {
  return state.shape == Shape::kBlock ? state.name : state.name + std::to_string(dim);
}

void KroneckerFactorList::update(int64_t stack, const Rows& rows, const at::Tensor& gradients,
                                 const RowScalars& scalars, const std::vector<bool>& amortize) {
  if (rows.size() == 0) return;
  if (factors_.settings().statistics == FactorStatistics::kKL) {
    // KL-Shampoo: every factor sees the gradient multiplied along the other dims by the roots
    // kept before this step (identity, or f(1)·I, before the first amortized computation).
    // Per chunk of the factor update, so unpacked roots never exist for the whole stack.
    const KroneckerFactors::OtherDims operands = [&](int64_t j, int64_t begin, int64_t count) {
      Rows part;
      part.rows.assign(rows.rows.begin() + begin, rows.rows.begin() + begin + count);
      part.all = rows.all && count == rows.size();
      return kl_operand(stack, part, j, scalars);
    };
    factors_.update(stack, rows, gradients, scalars, &operands);
  } else {
    factors_.update(stack, rows, gradients, scalars);
  }
  const auto [due, due_scalars] = select_rows(rows, scalars, amortize);
  this->amortize(stack, due, due_scalars);
  after_update(stack, rows, gradients, scalars);
}

void KroneckerFactorList::amortize(int64_t stack, const Rows& rows, const RowScalars& scalars) {
  const auto& spec = factors_.spec(stack);
  int64_t largest = 1;
  for (const int64_t k : factors_.preconditioned_dims(stack)) {
    largest = std::max(largest, spec.block_shape[k] * spec.block_shape[k]);
  }
  const int64_t element = static_cast<int64_t>(c10::elementSize(factors_.settings().factor_dtype));
  const int64_t per_chunk = std::max<int64_t>(1, amortize_chunk_bytes() / (largest * element));
  for (int64_t start = 0; start < rows.size(); start += per_chunk) {
    std::vector<bool> selected(rows.size(), false);
    std::fill(selected.begin() + start, selected.begin() + std::min(rows.size(), start + per_chunk),
              true);
    const auto [chunk, chunk_scalars] = select_rows(rows, scalars, selected);
    amortize_rows(stack, chunk, chunk_scalars);
  }
}

void KroneckerFactorList::amortize_rows(int64_t stack, const Rows& rows,
                                        const RowScalars& scalars) {
  if (rows.size() == 0) return;
  std::vector<bool> member_failed(rows.size(), false);
  for (const int64_t k : factors_.preconditioned_dims(stack)) {
    const auto result = compute_dim(stack, rows, k, scalars);
    factors_.record_batched_call();
    for (int64_t i = 0; i < rows.size(); ++i) {
      const int64_t row = rows.rows[i];
      if (result.failed[i] || factors_.injected_failure(stack, row, k)) {
        member_failed[i] = true;
        continue;  // keep the previous result
      }
      size_t v = 0;
      for (auto& state : states_) {
        if (state.shape == Shape::kBlock) continue;
        const auto& value = result.values.at(v++)[i];
        if (state.shape == Shape::kDimSymmetric) {
          state.symmetric[stack][k].assign_row(row, value);
        } else {
          state.tensors[stack][k][row].copy_(value);
        }
      }
    }
  }
  for (int64_t i = 0; i < rows.size(); ++i) {
    factors_.record_outcome(stack, rows.rows[i], member_failed[i], scalars.step[i]);
    states_changed(stack, rows.rows[i]);
  }
}

at::Tensor KroneckerFactorList::kl_operand(int64_t /*stack*/, const Rows& /*rows*/, int64_t /*dim*/,
                                           const RowScalars& /*scalars*/) const {
  TORCH_INTERNAL_ASSERT(false, "this Kronecker-factor family has no KL-Shampoo statistics");
}

std::map<std::string, at::Tensor> KroneckerFactorList::export_member(int64_t stack,
                                                                     int64_t row) const {
  return export_changing(stack, row, /*amortized=*/true);
}

std::map<std::string, at::Tensor> KroneckerFactorList::export_changing(int64_t stack, int64_t row,
                                                                       bool amortized) const {
  std::map<std::string, at::Tensor> out;
  factors_.export_member(stack, row, out);
  for (const auto& state : states_) {
    if (state.shape == Shape::kBlock) {
      out[state.name] = state.tensors[stack][0][row].clone();
      continue;
    }
    if (!amortized) continue;  // per-dim states change only in an amortized computation
    for (const int64_t k : factors_.preconditioned_dims(stack)) {
      out[state_key(state, k)] = state.shape == Shape::kDimSymmetric
                                     ? state.symmetric[stack][k].export_row(row)
                                     : state.tensors[stack][k][row].clone();
    }
  }
  return out;
}

void KroneckerFactorList::import_member(int64_t stack, int64_t row,
                                        const std::map<std::string, at::Tensor>& in) {
  import_state(stack, row, in, /*require_all=*/true);
}

void KroneckerFactorList::import_changing(int64_t stack, int64_t row,
                                          const std::map<std::string, at::Tensor>& in) {
  import_state(stack, row, in, /*require_all=*/false);
}

void KroneckerFactorList::import_state(int64_t stack, int64_t row,
                                       const std::map<std::string, at::Tensor>& in,
                                       bool require_all) {
  factors_.import_member(stack, row, in);
  const auto& spec = factors_.spec(stack);
  for (auto& state : states_) {
    if (state.shape == Shape::kBlock) {
      auto& t = state.tensors[stack][0];
      t[row].copy_(checked_state(in, state.name, spec.block_shape, t.options(), spec.names[row]));
      continue;
    }
    for (const int64_t k : factors_.preconditioned_dims(stack)) {
      // Without `require_all` (an undo journal of a step that did not amortize the member) the
      // per-dim states may be absent: they did not change.
      if (!require_all && in.count(state_key(state, k)) == 0) continue;
      if (state.shape == Shape::kDimSymmetric) {
        const auto key = state_key(state, k);
        state.symmetric[stack][k].import_row(row, checked_entry(in, key, spec.names[row]), key,
                                             spec.names[row]);
        continue;
      }
      const int64_t d = spec.block_shape[k];
      auto& t = state.tensors[stack][k];
      const auto shape =
          state.shape == Shape::kDimMatrix ? std::vector<int64_t>{d, d} : std::vector<int64_t>{d};
      t[row].copy_(checked_state(in, state_key(state, k), shape, t.options(), spec.names[row]));
    }
  }
  states_changed(stack, row);
}

void KroneckerFactorList::add_memory(MemorySummary& out) const {
  out.factors += factors_.state_bytes();
  for (const auto& state : states_) {
    int64_t bytes = 0;
    for (const auto& stack : state.symmetric) {
      for (const auto& m : stack) bytes += m.bytes();
    }
    for (const auto& stack : state.tensors) {
      for (const auto& t : stack) {
        if (t.defined()) bytes += t.numel() * static_cast<int64_t>(t.element_size());
      }
    }
    out.*state.memory += bytes;
  }
  // What a family derives from those states and keeps: eigendecomposed Shampoo's roots.
  out.inverse_roots += derived_state_bytes();
}

}  // namespace shampoo::detail
