#include "update/elementwise_state.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <limits>

namespace shampoo::detail {
namespace {

at::Tensor zeros_for(const StackSpec& spec, bool compact) {
  std::vector<int64_t> shape{spec.size()};
  shape.insert(shape.end(), spec.block_shape.begin(), spec.block_shape.end());
  return at::zeros(shape, compact ? spec.options.dtype(at::kBFloat16) : spec.options);
}

/// The random bits' key of one (block, step, state).
uint32_t rounding_key(int64_t block, int64_t step, int kind) {
  uint64_t k = static_cast<uint64_t>(block) * 0x9E3779B1u + static_cast<uint64_t>(step);
  k = k * 4 + static_cast<uint64_t>(kind);
  return static_cast<uint32_t>(k ^ (k >> 32));
}

int64_t tensor_bytes(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

}  // namespace

namespace {

/// The rounding's 16 random bits for element `index`: a 32-bit multiply-xorshift hash of the
/// index and the key (arithmetic mod 2^32).
inline uint32_t rounding_bits(uint32_t index, uint32_t key) {
  uint32_t h = index * 0x9E3779B1u + key;
  h = (h ^ (h >> 16)) * 0x045D9F3Bu;
  h = (h ^ (h >> 16)) * 0x045D9F3Bu;
  return (h ^ (h >> 16)) & 0xFFFFu;
}

}  // namespace

at::Tensor round_bfloat16_stochastic_aten(const at::Tensor& x, uint32_t key) {
  const auto f = x.to(at::kFloat).contiguous().view(-1);
  // rounding_bits in int64 tensor arithmetic that never overflows (every product stays below
  // 2^63), masked to 32 bits after each product.
  const auto mask = int64_t{0xFFFFFFFF};
  auto h = at::arange(f.numel(), f.options().dtype(at::kLong));
  h = (h * int64_t{0x9E3779B1} + int64_t{key}).bitwise_and_(mask);
  for (int round = 0; round < 2; ++round) {
    h = h.bitwise_xor(h.bitwise_right_shift(16));
    h = (h * int64_t{0x045D9F3B}).bitwise_and_(mask);
  }
  h = h.bitwise_xor(h.bitwise_right_shift(16)).bitwise_and_(0xFFFF);
  // Adding 16 random bits to the float's bit pattern and truncating to the upper 16 bits rounds
  // the magnitude up with probability (cut-off bits) / 2^16; the sign bit is untouched for
  // finite values.
  const auto bits = f.view(at::kInt).add(h.to(at::kInt)).bitwise_and_(int32_t{-65536});
  return bits.view(at::kFloat).view(x.sizes()).to(at::kBFloat16);
}

void round_bfloat16_stochastic_into(at::Tensor& out, const at::Tensor& x, uint32_t key) {
  TORCH_INTERNAL_ASSERT(out.scalar_type() == at::kBFloat16 && out.numel() == x.numel());
  if (!x.device().is_cpu() || !out.is_contiguous()) {
    out.copy_(round_bfloat16_stochastic_aten(x, key).view(out.sizes()));
    return;
  }
  // One pass on the CPU, the same bits as the ATen formulation.
  const auto f = x.to(at::kFloat).contiguous();
  const auto* in = f.data_ptr<float>();
  auto* target = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, f.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      uint32_t bits = 0;
      std::memcpy(&bits, in + i, sizeof(bits));
      bits += rounding_bits(static_cast<uint32_t>(i), key);
      target[i] = at::BFloat16(static_cast<uint16_t>(bits >> 16), at::BFloat16::from_bits());
    }
  });
}

at::Tensor round_bfloat16_stochastic(const at::Tensor& x, uint32_t key) {
  auto out = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  round_bfloat16_stochastic_into(out, x, key);
  return out;
}

at::Tensor unfactor_second_moment(const at::Tensor& rows, const at::Tensor& cols) {
  // r ≥ 0, so Σr = 0 only when r = 0: the product is then 0 and so is V̂ (0 / tiny).
  const auto total = rows.sum().clamp_min(std::numeric_limits<float>::min());
  return at::outer(rows, cols).div_(total);
}

bool factors_second_moment(const std::vector<int64_t>& block_shape,
                           const std::vector<double>& dim_exponents) {
  return block_shape.size() == 2 &&
         std::any_of(dim_exponents.begin(), dim_exponents.end(), [](double e) { return e != 0.0; });
}

ElementwiseState::ElementwiseState(GraftingKind grafting, const std::vector<StackSpec>& stacks,
                                   bool compact, bool factored)
    : stacks_(stacks),
      filter_(stacks.size()),
      diagonal_(stacks.size()),
      momentum_(stacks.size()),
      average_(stacks.size()),
      compact_(compact),
      rows_(stacks.size()),
      cols_(stacks.size()) {
  for (const auto& spec : stacks_) average_set_.emplace_back(spec.size(), false);
  if (!grafting_method(grafting).has_state) return;
  for (size_t s = 0; s < stacks_.size(); ++s) {
    const auto& spec = stacks_[s];
    if (factored && factors_second_moment(spec.block_shape, spec.dim_exponents)) {
      rows_[s] = at::zeros({spec.size(), spec.block_shape[0]}, spec.options);
      cols_[s] = at::zeros({spec.size(), spec.block_shape[1]}, spec.options);
      continue;
    }
    diagonal_[s] = zeros_for(spec, compact_);
  }
}

at::Tensor& ElementwiseState::lazy(std::vector<at::Tensor>& states, int64_t stack) {
  auto& state = states[stack];
  if (!state.defined()) state = zeros_for(stacks_[stack], compact_ && &states != &average_);
  return state;
}

void ElementwiseState::bind(int64_t stack, int64_t row, bool filter, bool momentum,
                            ChainBlockTensors& c, int64_t block, int64_t step) {
  const auto bound = [&](const at::Tensor& kept, int kind) {
    if (!compact_) return kept;
    auto scratch = kept.to(stacks_[stack].options.dtype());
    pending_.push_back({kept, scratch, rounding_key(block, step, kind)});
    return scratch;
  };
  if (filter) c.filter_state = bound(lazy(filter_, stack)[row], 0);
  if (diagonal_[stack].defined()) c.diagonal_state = bound(diagonal_[stack][row], 1);
  if (rows_[stack].defined()) {
    // A member bound without prepare_factored is prepared alone.
    if (prepared_factored_.count(stack) == 0) {
      Rows alone;
      alone.rows = {row};
      prepare_factored(stack, alone);
    }
    auto& p = prepared_factored_.at(stack);
    const auto& r = p.rows.rows;
    const auto at = std::lower_bound(r.begin(), r.end(), row);
    TORCH_INTERNAL_ASSERT(at != r.end() && *at == row, "ElementwiseState::bind: member ", row,
                          " of stack ", stack, " is not among the members prepared");
    c.diagonal_state = p.scratch[at - r.begin()];
    p.bound = true;
  }
  if (momentum) c.momentum_state = bound(lazy(momentum_, stack)[row], 2);
}

void ElementwiseState::prepare_factored(int64_t stack, const Rows& rows) {
  if (!rows_[stack].defined() || rows.size() == 0) return;
  const auto gather = [&](const at::Tensor& t) {
    return rows.consecutive() ? t.narrow(0, rows.rows[0], rows.size())
                              : t.index_select(0, rows.index(t.device()));
  };
  const auto r = gather(rows_[stack]);
  const auto c = gather(cols_[stack]);
  // As unfactor_second_moment row by row: each product rounded once, then divided by Σr.
  const auto total = r.sum(1).clamp_min(std::numeric_limits<float>::min());
  auto scratch = r.unsqueeze(2).mul(c.unsqueeze(1)).div_(total.view({-1, 1, 1}));
  prepared_factored_[stack] = {rows, std::move(scratch), false};
}

void ElementwiseState::commit() {
  for (auto& p : pending_) round_bfloat16_stochastic_into(p.kept, p.scratch, p.key);
  pending_.clear();
  for (auto& [stack, p] : prepared_factored_) {
    if (!p.bound) continue;
    const auto row_sums = p.scratch.sum(2);
    const auto col_sums = p.scratch.sum(1);
    if (p.rows.consecutive()) {
      rows_[stack].narrow(0, p.rows.rows[0], p.rows.size()).copy_(row_sums);
      cols_[stack].narrow(0, p.rows.rows[0], p.rows.size()).copy_(col_sums);
    } else {
      const auto index = p.rows.index(row_sums.device());
      rows_[stack].index_copy_(0, index, row_sums);
      cols_[stack].index_copy_(0, index, col_sums);
    }
  }
  prepared_factored_.clear();
}

void ElementwiseState::discard() {
  pending_.clear();
  prepared_factored_.clear();
}

void ElementwiseState::bind_average(int64_t stack, int64_t row, const at::Tensor& param_block,
                                    ChainBlockTensors& c) {
  auto z = lazy(average_, stack)[row];
  if (!average_set_[stack][row]) {
    z.copy_(param_block);
    average_set_[stack][row] = true;
  }
  c.average_state = z;
}

at::Tensor ElementwiseState::average(int64_t stack, int64_t row) const {
  return average_set_[stack][row] ? average_[stack][row] : at::Tensor();
}

ElementwiseState::Allocated ElementwiseState::allocated() const {
  Allocated a;
  for (size_t s = 0; s < stacks_.size(); ++s) {
    a.filter.push_back(filter_[s].defined());
    a.momentum.push_back(momentum_[s].defined());
  }
  a.average = average_set_;
  return a;
}

void ElementwiseState::release_since(const Allocated& before) {
  for (size_t s = 0; s < stacks_.size(); ++s) {
    if (!before.filter[s]) filter_[s] = at::Tensor();
    if (!before.momentum[s]) momentum_[s] = at::Tensor();
    average_set_[s] = before.average[s];
    const auto& set = average_set_[s];
    if (std::find(set.begin(), set.end(), true) == set.end()) average_[s] = at::Tensor();
  }
}

void ElementwiseState::export_member(int64_t stack, int64_t row,
                                     std::map<std::string, at::Tensor>& out) const {
  // Compact rows leave as the blocks' dtype (exactly), so checkpoints do not depend on it.
  const auto copy = [&](const at::Tensor& t) {
    return compact_ ? t.to(stacks_[stack].options.dtype()) : t.clone();
  };
  if (diagonal_[stack].defined()) out["diagonal"] = copy(diagonal_[stack][row]);
  if (rows_[stack].defined()) {
    out["diagonal_rows"] = rows_[stack][row].clone();
    out["diagonal_cols"] = cols_[stack][row].clone();
  }
  if (filter_[stack].defined()) out["filter"] = copy(filter_[stack][row]);
  if (momentum_[stack].defined()) out["momentum"] = copy(momentum_[stack][row]);
  if (average_set_[stack][row]) out["average"] = average_[stack][row].clone();
}

void ElementwiseState::import_member(int64_t stack, int64_t row,
                                     const std::map<std::string, at::Tensor>& in) {
  const auto& spec = stacks_[stack];
  // V in either form: a checkpoint or journal of a factored state loads into an exact one and
  // the other way round.
  const bool as_factored = in.count("diagonal") == 0 && in.count("diagonal_rows") != 0;
  if (diagonal_[stack].defined()) {
    const auto& options = diagonal_[stack].options();
    diagonal_[stack][row].copy_(
        as_factored && spec.block_shape.size() == 2
            ? unfactor_second_moment(checked_state(in, "diagonal_rows", {spec.block_shape[0]},
                                                   options, spec.names[row]),
                                     checked_state(in, "diagonal_cols", {spec.block_shape[1]},
                                                   options, spec.names[row]))
            : checked_state(in, "diagonal", spec.block_shape, options, spec.names[row]));
  }
  if (rows_[stack].defined()) {
    const auto& options = rows_[stack].options();
    if (as_factored) {
      rows_[stack][row].copy_(
          checked_state(in, "diagonal_rows", {spec.block_shape[0]}, options, spec.names[row]));
      cols_[stack][row].copy_(
          checked_state(in, "diagonal_cols", {spec.block_shape[1]}, options, spec.names[row]));
    } else {
      const auto v = checked_state(in, "diagonal", spec.block_shape, options, spec.names[row]);
      rows_[stack][row].copy_(v.sum(1));
      cols_[stack][row].copy_(v.sum(0));
    }
  }
  for (auto [key, states] : {std::pair{"filter", &filter_}, std::pair{"momentum", &momentum_}}) {
    if (in.count(key) == 0) continue;
    auto& t = lazy(*states, stack);
    t[row].copy_(checked_state(in, key, spec.block_shape, t.options(), spec.names[row]));
  }
  if (in.count("average") != 0) {
    auto& t = lazy(average_, stack);
    t[row].copy_(checked_state(in, "average", spec.block_shape, t.options(), spec.names[row]));
    average_set_[stack][row] = true;
  }
}

void ElementwiseState::add_memory(MemorySummary& out) const {
  const auto sum = [](const std::vector<at::Tensor>& states) {
    int64_t bytes = 0;
    for (const auto& t : states) bytes += tensor_bytes(t);
    return bytes;
  };
  out.grafting += sum(diagonal_) + sum(rows_) + sum(cols_);
  out.filtered_gradient += sum(filter_);
  out.momentum += sum(momentum_);
  out.averaging += sum(average_);
}

int64_t ElementwiseState::state_bytes() const {
  MemorySummary memory;
  add_memory(memory);
  return memory.state_total();
}

}  // namespace shampoo::detail
