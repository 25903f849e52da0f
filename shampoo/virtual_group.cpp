#include "shampoo/virtual_group.h"

#include <c10/util/Exception.h>

#include <cmath>

#include "preconditioners/eigenvalue_corrected_preconditioner_list.h"
#include "preconditioners/kronecker_factors.h"
#include "preconditioners/shampoo_preconditioner_list.h"

namespace shampoo::detail {
namespace {

DiagonalMethod diagonal_method_of(const GraftingConfig& grafting) {
  return std::visit(
      [](const auto& g) {
        using G = std::decay_t<decltype(g)>;
        if constexpr (std::is_same_v<G, SGDGraftingConfig>) return DiagonalMethod::kSGD;
        if constexpr (std::is_same_v<G, AdaGradGraftingConfig>) return DiagonalMethod::kAdaGrad;
        if constexpr (std::is_same_v<G, RMSpropGraftingConfig>) return DiagonalMethod::kRMSprop;
        if constexpr (std::is_same_v<G, AdamGraftingConfig>) return DiagonalMethod::kAdam;
        return DiagonalMethod::kNone;
      },
      grafting);
}

DiagonalHyperparams diagonal_hyperparams_of(const GraftingConfig& grafting) {
  return std::visit(
      [](const auto& g) {
        using G = std::decay_t<decltype(g)>;
        DiagonalHyperparams h;
        if constexpr (std::is_same_v<G, AdaGradGraftingConfig>) h.epsilon = g.epsilon;
        if constexpr (std::is_same_v<G, RMSpropGraftingConfig> ||
                      std::is_same_v<G, AdamGraftingConfig>) {
          h.beta2 = g.beta2;
          h.epsilon = g.epsilon;
        }
        return h;
      },
      grafting);
}

std::unique_ptr<PreconditionerList> make_preconditioner(const ShampooOptions& structure,
                                                        std::vector<StackSpec> specs,
                                                        FailureInjector inject_failure) {
  MatrixPreconditionerSettings settings;
  settings.factor_dtype = structure.factor_matrix_dtype();
  settings.tolerated_failures = structure.num_tolerated_failed_amortized_computations();
  settings.inject_failure = std::move(inject_failure);
  return std::visit(
      [&](const auto& config) -> std::unique_ptr<PreconditionerList> {
        using C = std::decay_t<decltype(config)>;
        settings.retry_double_precision = config.retry_double_precision;
        if constexpr (std::is_same_v<C, EigenvalueCorrectedShampooConfig>) {
          const auto method = config.eigenbasis_method == EigenbasisMethod::kQR
                                  ? EigenbasisUpdate::kQR
                                  : EigenbasisUpdate::kEigh;
          return std::make_unique<EigenvalueCorrectedPreconditionerList>(std::move(specs), settings,
                                                                         method);
        } else {
          return std::make_unique<ShampooPreconditionerList>(std::move(specs), settings);
        }
      },
      structure.preconditioner());
}

/// The statistics scalars of one row at step t (NUMERICS.md steps 2 and 3).
void push_row_scalars(const ShampooOptions& options, int64_t t, RowScalars& scalars) {
  const auto [beta1, beta2] = options.betas();
  (void)beta1;
  scalars.beta2.push_back(beta2);
  scalars.factor_weight.push_back(beta2 < 1.0 ? 1.0 - beta2 : 1.0);
  scalars.bias_correction2.push_back(
      options.use_bias_correction() && beta2 < 1.0 ? 1.0 - std::pow(beta2, double(t)) : 1.0);
  scalars.epsilon.push_back(options.epsilon());
  scalars.step.push_back(t);
}

int64_t tensor_bytes(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

/// Per-step bookkeeping of one stack.
struct StackStep {
  Rows rows;                         // members with a gradient this step
  RowScalars scalars;                // aligned with rows
  std::vector<bool> amortize;        // aligned with rows
  std::vector<bool> preconditioned;  // aligned with rows: matrix preconditioning needed
  std::vector<size_t> chain;         // aligned with rows: index into the chain
  at::Tensor gradients;              // [rows, block_shape]: G' (after L2 weight decay)
  at::Tensor filtered;  // [rows, block_shape]: Ḡ (aliases gradients without filtering)
};

}  // namespace

std::vector<double> dim_exponents(const ShampooOptions& options, int64_t order) {
  std::vector<double> exponents(order, 1.0 / (2.0 * static_cast<double>(order)));
  const auto& overrides = options.inverse_exponent_override();
  const auto it = overrides.find(order);
  if (it == overrides.end()) return exponents;
  const auto all = it->second.find(kAllDims);
  if (all != it->second.end()) exponents.assign(order, all->second);
  for (const auto& [dim, exponent] : it->second) {
    if (dim != kAllDims) exponents[dim] = exponent;
  }
  return exponents;
}

VirtualGroup::VirtualGroup(const ShampooOptions& structure, std::vector<int64_t> user_groups,
                           std::vector<int64_t> owned, const std::vector<BlockEntry>& blocks,
                           const std::vector<ParamEntry>& params, FailureInjector inject_failure)
    : structure_(structure), user_groups_(std::move(user_groups)), owned_(std::move(owned)) {
  for (const int64_t b : owned_) {
    const auto& block = blocks[b];
    const auto& param = params[block.param].param;
    const auto options = param.options().requires_grad(false);
    auto it = std::find_if(stacks_.begin(), stacks_.end(), [&](const Stack& s) {
      return s.spec.block_shape == block.shape && s.spec.options.dtype() == options.dtype() &&
             s.spec.options.device() == options.device();
    });
    if (it == stacks_.end()) {
      Stack s;
      s.spec.block_shape = block.shape;
      s.spec.options = options;
      s.spec.dim_exponents = dim_exponents(structure_, static_cast<int64_t>(block.shape.size()));
      stacks_.push_back(std::move(s));
      it = std::prev(stacks_.end());
    }
    it->spec.names.push_back(block.id.to_string());
    it->blocks.push_back(b);
    it->ids.push_back(block.id);
  }
  std::vector<StackSpec> specs;
  for (const auto& s : stacks_) specs.push_back(s.spec);
  preconditioner_ = make_preconditioner(structure_, specs, std::move(inject_failure));
  diagonal_method_ = diagonal_method_of(structure_.grafting());
  if (diagonal_method_ != DiagonalMethod::kNone) {
    diagonal_ = std::make_unique<DiagonalPreconditionerList>(diagonal_method_, specs);
  }
  filter_state_.resize(stacks_.size());
  momentum_state_.resize(stacks_.size());
}

at::Tensor& VirtualGroup::lazy_state(std::vector<at::Tensor>& states, int64_t stack) {
  auto& state = states[stack];
  if (!state.defined()) {
    const auto& spec = stacks_[stack].spec;
    std::vector<int64_t> shape{spec.size()};
    shape.insert(shape.end(), spec.block_shape.begin(), spec.block_shape.end());
    state = at::zeros(shape, spec.options);
  }
  return state;
}

Rows VirtualGroup::rows_with_gradients(int64_t s, const StepInputs& in) const {
  Rows rows;
  const auto& stack = stacks_[s];
  for (int64_t r = 0; r < stack.spec.size(); ++r) {
    if (!in.grad_blocks[in.blocks[stack.blocks[r]].param].empty()) rows.rows.push_back(r);
  }
  rows.all = rows.size() == stack.spec.size();
  return rows;
}

bool VirtualGroup::amortized_at(int64_t t) const {
  const int64_t start = structure_.resolved_start_preconditioning_step();
  return (t % structure_.precondition_frequency() == 0 && t > start) || t == start;
}

bool VirtualGroup::may_raise(const StepInputs& in) const {
  bool may_raise = false;
  for (size_t s = 0; s < stacks_.size(); ++s) {
    const auto& stack = stacks_[s];
    Rows due;
    RowScalars scalars;
    std::vector<double> gradient_bound;
    for (const int64_t row : rows_with_gradients(static_cast<int64_t>(s), in).rows) {
      const auto& block = in.blocks[stack.blocks[row]];
      const auto& options = *in.group_options[in.params[block.param].group];
      const int64_t t = in.group_steps[in.params[block.param].group];
      if (!amortized_at(t)) continue;
      due.rows.push_back(row);
      push_row_scalars(options, t, scalars);
      // max |G'| with G' = G + wd·W under L2 weight decay.
      double bound = in.grad_abs_max[block.param];
      if (options.weight_decay_type() == WeightDecayType::kL2 && options.weight_decay() != 0.0) {
        const auto& w = in.param_blocks[block.param][block.id.block];
        bound += options.weight_decay() *
                 at::linalg_vector_norm(w, INFINITY, c10::nullopt, false, at::kDouble)
                     .item<double>();
      }
      gradient_bound.push_back(bound);
    }
    due.all = due.size() == stack.spec.size();
    may_raise |= preconditioner_->amortization_may_raise(static_cast<int64_t>(s), due, scalars,
                                                         gradient_bound);
  }
  return may_raise;
}

BlockState VirtualGroup::export_member(int64_t s, int64_t r) const {
  auto state = preconditioner_->export_member(s, r);
  if (diagonal_) state.merge(diagonal_->export_member(s, r));
  if (filter_state_[s].defined()) state["filter"] = filter_state_[s][r].clone();
  if (momentum_state_[s].defined()) state["momentum"] = momentum_state_[s][r].clone();
  return state;
}

void VirtualGroup::save(const StepInputs& in, StepJournal::GroupMark& mark, bool first_save,
                        StepJournal& journal) const {
  if (first_save) {
    mark.counters = preconditioner_->counters();
    mark.filter_defined.clear();
    mark.momentum_defined.clear();
    for (size_t s = 0; s < stacks_.size(); ++s) {
      mark.filter_defined.push_back(filter_state_[s].defined());
      mark.momentum_defined.push_back(momentum_state_[s].defined());
    }
  }
  for (size_t s = 0; s < stacks_.size(); ++s) {
    for (const int64_t row : rows_with_gradients(static_cast<int64_t>(s), in).rows) {
      const auto& id = stacks_[s].ids[row];
      if (journal.states.count(id) != 0) continue;
      auto state = export_member(static_cast<int64_t>(s), row);
      for (const auto& [name, tensor] : state) journal.bytes += tensor_bytes(tensor);
      journal.states.emplace(id, std::move(state));
    }
  }
}

void VirtualGroup::restore(const StepJournal::GroupMark& mark, const StepJournal& journal) {
  import_states(journal.states, /*require_all=*/false);
  for (size_t s = 0; s < stacks_.size(); ++s) {
    if (!mark.filter_defined[s]) filter_state_[s] = at::Tensor();
    if (!mark.momentum_defined[s]) momentum_state_[s] = at::Tensor();
  }
  preconditioner_->set_counters(mark.counters);
}

void VirtualGroup::step(const StepInputs& in) {
  const bool distributed = in.distributor.distributed();
  const bool grafting = diagonal_method_ != DiagonalMethod::kNone;
  const bool diagonal_state = diagonal_ && diagonal_->has_state();
  const int64_t start = structure_.resolved_start_preconditioning_step();

  std::vector<ChainBlockTensors> chain;
  std::vector<StackStep> steps(stacks_.size());
  // Single process, parameter blocks that are not contiguous: their updates are added after the
  // chain. Distributed with a communication dtype other than the parameters': cast-copied.
  std::vector<at::Tensor> apply_to, apply_from;
  std::vector<at::Tensor> cast_to, cast_from;

  for (size_t s = 0; s < stacks_.size(); ++s) {
    const auto& stack = stacks_[s];
    auto& st = steps[s];
    st.rows = rows_with_gradients(static_cast<int64_t>(s), in);
    if (st.rows.size() == 0) continue;
    bool any_filter = false;
    for (const int64_t r : st.rows.rows) {
      const auto& block = in.blocks[stack.blocks[r]];
      any_filter |= std::get<0>(in.group_options[in.params[block.param].group]->betas()) != 0.0;
    }
    std::vector<int64_t> shape{st.rows.size()};
    shape.insert(shape.end(), stack.spec.block_shape.begin(), stack.spec.block_shape.end());
    st.gradients = at::empty(shape, stack.spec.options);
    st.filtered = any_filter ? at::empty(shape, stack.spec.options) : st.gradients;

    for (int64_t i = 0; i < st.rows.size(); ++i) {
      const int64_t row = st.rows.rows[i];
      const int64_t b = stack.blocks[row];
      const auto& block = in.blocks[b];
      const auto& param = in.params[block.param];
      const auto& options = *in.group_options[param.group];
      const int64_t t = in.group_steps[param.group];
      const double beta1 = std::get<0>(options.betas());

      push_row_scalars(options, t, st.scalars);
      st.amortize.push_back(amortized_at(t));
      // Before start: the grafting method alone, or (without grafting) the preconditioner, which
      // for root-inverse Shampoo is still the identity and is skipped.
      st.preconditioned.push_back(t >= start ||
                                  (!grafting && !preconditioner_->identity_before_amortization()));

      ChainBlockTensors c;
      const auto& param_view = in.param_blocks[block.param][block.id.block];
      const auto& grad_view = in.grad_blocks[block.param][block.id.block];
      c.gradient_out = st.gradients[i];
      c.filtered_out = st.filtered[i];
      if (grad_view.is_contiguous()) {
        c.grad = grad_view;
      } else {
        // A column block of a matrix: copied once, straight into its row (the pre pass then
        // reads and rewrites it in place).
        c.gradient_out.copy_(grad_view);
        c.grad = c.gradient_out;
      }
      if (beta1 != 0.0) c.filter_state = lazy_state(filter_state_, s)[row];
      if (diagonal_state) c.diagonal_state = diagonal_->state(s)[row];
      if (options.momentum() != 0.0) c.momentum_state = lazy_state(momentum_state_, s)[row];

      auto& k = c.scalars;
      const double weight_decay = options.weight_decay();
      const bool l2 = options.weight_decay_type() == WeightDecayType::kL2;
      k.l2_weight_decay = l2 ? weight_decay : 0.0;
      k.decoupled_weight_decay = l2 ? 0.0 : weight_decay;
      k.beta1 = beta1;
      k.beta3 = options.resolved_beta3();
      k.separate_beta3 = beta1 != 0.0 && k.beta3 != beta1;
      k.filter_bias_correction = options.use_bias_correction() && beta1 != 0.0
                                     ? 1.0 - k.beta3 * std::pow(beta1, static_cast<double>(t - 1))
                                     : 1.0;
      if (grafting) {
        fill_chain_scalars(diagonal_method_, diagonal_hyperparams_of(options.grafting()), t, k);
      }
      k.direction_mode =
          static_cast<int32_t>(t < start ? (grafting ? kernels::DirectionMode::kGraft
                                                     : kernels::DirectionMode::kPreconditioned)
                                         : (grafting ? kernels::DirectionMode::kGraftNorm
                                                     : kernels::DirectionMode::kPreconditioned));
      k.momentum = options.momentum();
      k.dampening = options.dampening();
      k.nesterov = options.use_nesterov() ? 1 : 0;
      k.lr = options.lr();
      k.output_updated_param = in.distributor.communicate_params() ? 1 : 0;

      // The parameter is read only for weight decay and to write updated values; a copy only
      // for a non-contiguous block that needs it.
      const bool in_place = !distributed && param_view.is_contiguous();
      if (in_place) {
        c.param = param_view;
        c.param_out = param_view;
      } else if (k.l2_weight_decay != 0.0 || k.decoupled_weight_decay != 0.0 ||
                 k.output_updated_param != 0) {
        c.param = param_view.contiguous();
      }
      if (distributed) {
        auto slot = in.distributor.slot(b);
        if (slot.scalar_type() == param_view.scalar_type()) {
          c.update_out = slot;
        } else {
          // Staged in the block's filtered row: the post pass reads each element of a row
          // before it writes the same element.
          c.update_out = c.filtered_out;
          cast_to.push_back(slot);
          cast_from.push_back(c.update_out.reshape(-1));
        }
        in.distributor.mark_updated(b);
      } else if (!in_place) {
        c.update_out = c.filtered_out;  // as above; added to the parameter after the chain
        apply_to.push_back(param_view);
        apply_from.push_back(c.update_out.view(param_view.sizes()));
      }
      in.computed[b] = true;
      st.chain.push_back(chain.size());
      chain.push_back(std::move(c));
    }
  }
  if (chain.empty()) return;

  run_chain_pre(chain);

  for (size_t s = 0; s < stacks_.size(); ++s) {
    auto& st = steps[s];
    if (st.rows.size() == 0) continue;
    preconditioner_->update(static_cast<int64_t>(s), st.rows, st.gradients, st.scalars,
                            st.amortize);
  }
  if (in.fault) in.fault(StepPhase::kStatisticsUpdated);

  for (size_t s = 0; s < stacks_.size(); ++s) {
    auto& st = steps[s];
    if (st.rows.size() == 0) continue;
    auto [rows, scalars] = select_rows(st.rows, st.scalars, st.preconditioned);
    if (rows.size() == 0) continue;
    at::Tensor filtered = st.filtered;
    std::vector<size_t> chain_of;
    std::vector<int64_t> local;
    for (int64_t i = 0; i < st.rows.size(); ++i) {
      if (!st.preconditioned[i]) continue;
      local.push_back(i);
      chain_of.push_back(st.chain[i]);
    }
    // The statistics are updated, so G' is no longer needed: its stack takes the result, unless
    // it also holds Ḡ (no filtering), which grafting still reads.
    at::Tensor preconditioned =
        st.filtered.is_same(st.gradients) ? at::empty_like(st.gradients) : st.gradients;
    if (rows.size() != st.rows.size()) {
      filtered = st.filtered.index_select(
          0, at::tensor(local, at::TensorOptions().dtype(at::kLong)).to(filtered.device()));
      preconditioned = at::empty_like(filtered);
    }
    preconditioner_->precondition(static_cast<int64_t>(s), rows, filtered, scalars, preconditioned);
    for (size_t j = 0; j < chain_of.size(); ++j) {
      chain[chain_of[j]].preconditioned = preconditioned[static_cast<int64_t>(j)];
    }
  }

  run_chain_norms(chain);
  if (in.fault) in.fault(StepPhase::kBeforeUpdate);
  run_chain_post(chain);

  if (!apply_to.empty()) at::_foreach_add_(apply_to, apply_from);
  for (size_t i = 0; i < cast_to.size(); ++i) cast_to[i].copy_(cast_from[i]);
}

void VirtualGroup::export_states(std::map<BlockId, BlockState>& out) const {
  for (size_t s = 0; s < stacks_.size(); ++s) {
    for (int64_t r = 0; r < stacks_[s].spec.size(); ++r) {
      out[stacks_[s].ids[r]] = export_member(static_cast<int64_t>(s), r);
    }
  }
}

void VirtualGroup::import_states(const std::map<BlockId, BlockState>& states, bool require_all) {
  for (size_t s = 0; s < stacks_.size(); ++s) {
    const auto& stack = stacks_[s];
    for (int64_t r = 0; r < stack.spec.size(); ++r) {
      const auto it = states.find(stack.ids[r]);
      if (it == states.end()) {
        TORCH_CHECK(!require_all, "checkpoint: no state for ", stack.spec.names[r],
                    " (the checkpoint was written for another model or another rank layout)");
        continue;
      }
      const auto& state = it->second;
      preconditioner_->import_member(static_cast<int64_t>(s), r, state);
      if (diagonal_) diagonal_->import_member(static_cast<int64_t>(s), r, state);
      if (state.count("filter") != 0) {
        auto& m = lazy_state(filter_state_, static_cast<int64_t>(s));
        m[r].copy_(checked_state(state, "filter", stack.spec.block_shape, m.options(),
                                 stack.spec.names[r]));
      }
      if (state.count("momentum") != 0) {
        auto& b = lazy_state(momentum_state_, static_cast<int64_t>(s));
        b[r].copy_(checked_state(state, "momentum", stack.spec.block_shape, b.options(),
                                 stack.spec.names[r]));
      }
    }
  }
}

AmortizedCounters VirtualGroup::counters() const { return preconditioner_->counters(); }

int64_t VirtualGroup::state_bytes() const {
  int64_t bytes = preconditioner_->state_bytes();
  if (diagonal_) bytes += diagonal_->state_bytes();
  for (const auto* states : {&filter_state_, &momentum_state_}) {
    for (const auto& t : *states) bytes += tensor_bytes(t);
  }
  return bytes;
}

}  // namespace shampoo::detail
