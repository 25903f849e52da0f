#include "shampoo/virtual_group.h"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cmath>

#include "preconditioners/byte_bound.h"
#include "preconditioners/preconditioner_factory.h"
#include "preconditioners/rows.h"
#include "shampoo/factor_choice.h"
#include "shampoo/param_updates.h"
#include "shampoo/step_scalars.h"
#include "update/grafting.h"

namespace shampoo::detail {
namespace {

std::unique_ptr<PreconditionerList> make_preconditioner(const ShampooOptions& structure,
                                                        std::vector<StackSpec> specs,
                                                        FailureInjector inject_failure) {
  MatrixPreconditionerSettings settings;
  settings.factor_dtype = structure.factor_matrix_dtype();
  settings.tolerated_failures = structure.num_tolerated_failed_amortized_computations();
  settings.trace_scaling_exponent =
      structure.use_trace_scaling() ? structure.trace_scaling_exponent() : 0.0;
  settings.symmetric_packing = structure.use_symmetric_packing();
  settings.compact = structure.compact_state();
  settings.inject_failure = std::move(inject_failure);
  return make_preconditioner_list(structure.preconditioner(), std::move(specs),
                                  std::move(settings));
}
int64_t tensor_bytes(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

/// The live options and the step of the param group of engine block `b`.
struct BlockOptions {
  const ShampooOptions& options;
  int64_t step;
};
BlockOptions options_of_block(const StepInputs& in, int64_t b) {
  const auto group = in.params[in.blocks[b].param].group;
  return {*in.group_options[group], in.group_steps[group]};
}

}  // namespace

/// Per-step bookkeeping of one stack.
struct VirtualGroup::StackStep {
  Rows rows;                         // members with a gradient this step
  RowScalars scalars;                // aligned with rows
  std::vector<bool> amortize;        // aligned with rows
  std::vector<bool> preconditioned;  // aligned with rows: matrix preconditioning needed
  std::vector<size_t> chain;         // aligned with rows: index into the chain
  at::Tensor gradients;              // [rows, block_shape]: G' (after L2 weight decay)
  at::Tensor filtered;  // [rows, block_shape]: Ḡ (aliases gradients without filtering)
  // Gradient blocks the chain cannot read where they lie (column blocks of a matrix on CUDA) and
  // their rows of `gradients`: copied in runs once the stack's entries are made.
  std::vector<at::Tensor> copy_to, copy_from;
};

/// One step of the group: a StackStep per stack and the chain entries of every stepped block.
struct VirtualGroup::ChunkStep {
  std::vector<StackStep> stacks;
  std::vector<ChainBlockTensors> chain;
};

namespace {
// 64 MiB: eight 1024×1024 float32 rows (G' and Ḡ), so that a chunk's roots still fill the eight
// concurrent eigh lanes on CUDA (preconditioners/cuda/eigh_lanes.h).
ByteBound step_chunk_limit{int64_t{64} << 20};
std::atomic<bool> fused_step_enabled{true};
std::atomic<int64_t> fused_chunks{0};
}  // namespace

int64_t step_chunk_bytes() { return step_chunk_limit.get(); }

at::ScalarType compute_dtype(at::ScalarType param_dtype) {
  return param_dtype == at::kDouble ? at::kDouble : at::kFloat;
}

bool needs_work_copy(const at::Tensor& param) {
  return param.scalar_type() != compute_dtype(param.scalar_type()) || !param.is_contiguous();
}

at::Tensor work_tensor(const at::Tensor& param) {
  if (!needs_work_copy(param)) return param;
  return param.detach().to(compute_dtype(param.scalar_type()), /*non_blocking=*/false,
                           /*copy=*/false, at::MemoryFormat::Contiguous);
}

void write_back(const at::Tensor& param, const at::Tensor& work) {
  if (work.unsafeGetTensorImpl() == param.unsafeGetTensorImpl()) return;
  param.detach().copy_(work);
}
void set_step_chunk_bytes_for_testing(int64_t bytes) { step_chunk_limit.set(bytes); }
void set_fused_step_for_testing(bool enabled) { fused_step_enabled.store(enabled); }
int64_t fused_chunks_for_testing() { return fused_chunks.load(); }

int64_t block_target_order(const ShampooOptions& options) {
  return block_order(options.preconditioner());
}

VirtualGroup::VirtualGroup(const ShampooOptions& structure, std::vector<int64_t> user_groups,
                           std::vector<int64_t> owned, const std::vector<BlockEntry>& blocks,
                           const std::vector<ParamEntry>& params, FailureInjector inject_failure)
    : structure_(structure), user_groups_(std::move(user_groups)), owned_(std::move(owned)) {
  build_stacks(blocks, params);
  std::vector<StackSpec> specs;
  for (const auto& s : stacks_) specs.push_back(s.spec);
  preconditioner_ = make_preconditioner(structure_, specs, std::move(inject_failure));
  elementwise_ = std::make_unique<ElementwiseState>(
      grafting_kind(structure_.grafting()), specs,
      /*compact=*/structure_.compact_state() != CompactState::kNone,
      /*factored=*/factors_grafting_statistics(structure_));
}

void VirtualGroup::build_stacks(const std::vector<BlockEntry>& blocks,
                                const std::vector<ParamEntry>& params) {
  for (const int64_t b : owned_) {
    const auto& block = blocks[b];
    const auto& param = params[block.param].param;
    const auto options =
        param.options().dtype(compute_dtype(param.scalar_type())).requires_grad(false);
    // The parameter decides which dims keep a factor (factor_choice.h): blocks of one shape
    // with other exponents are another stack.
    auto choice = block_factor_choice(structure_, params[block.param].plan, block.shape);
    auto it = std::find_if(stacks_.begin(), stacks_.end(), [&](const Stack& s) {
      return s.spec.block_shape == block.shape && s.spec.options.dtype() == options.dtype() &&
             s.spec.options.device() == options.device() &&
             s.spec.dim_exponents == choice.dim_exponents && s.diagonal == choice.diagonal;
    });
    if (it == stacks_.end()) {
      Stack s;
      s.spec.block_shape = block.shape;
      s.spec.options = options;
      s.spec.dim_exponents = std::move(choice.dim_exponents);
      s.diagonal = choice.diagonal;
      stacks_.push_back(std::move(s));
      it = std::prev(stacks_.end());
    }
    it->spec.names.push_back(block.id.to_string());
    it->blocks.push_back(b);
    it->ids.push_back(block.id);
  }
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

bool VirtualGroup::may_raise(const StepInputs& in) const {
  bool may_raise = false;
  for (size_t s = 0; s < stacks_.size(); ++s) {
    const auto& stack = stacks_[s];
    Rows due;
    RowScalars scalars;
    std::vector<double> bounds;
    for (const int64_t row : rows_with_gradients(static_cast<int64_t>(s), in).rows) {
      const auto& block = in.blocks[stack.blocks[row]];
      const auto [options, t] = options_of_block(in, stack.blocks[row]);
      if (!amortized_at(structure_, t)) continue;
      due.rows.push_back(row);
      push_statistics_scalars(options, t, scalars);
      bounds.push_back(gradient_bound(options, in.grad_abs_max[block.param],
                                      in.param_blocks[block.param][block.id.block]));
    }
    due.all = due.size() == stack.spec.size();
    may_raise |=
        preconditioner_->amortization_may_raise(static_cast<int64_t>(s), due, scalars, bounds);
  }
  return may_raise;
}

void VirtualGroup::save(const StepInputs& in, StepJournal::GroupMark& mark, bool first_save,
                        StepJournal& journal) const {
  if (first_save) {
    mark.counters = preconditioner_->counters();
    mark.allocated = elementwise_->allocated();
  }
  for (size_t s = 0; s < stacks_.size(); ++s) {
    for (const int64_t row : rows_with_gradients(static_cast<int64_t>(s), in).rows) {
      const auto& id = stacks_[s].ids[row];
      if (journal.states.count(id) != 0) continue;
      // What the step can change: the roots or eigenbases only when it amortizes the block.
      const auto t = options_of_block(in, stacks_[s].blocks[row]).step;
      auto state = preconditioner_->export_changing(static_cast<int64_t>(s), row,
                                                    amortized_at(structure_, t));
      elementwise_->export_member(static_cast<int64_t>(s), row, state);
      for (const auto& [name, tensor] : state) journal.bytes += tensor_bytes(tensor);
      journal.states.emplace(id, std::move(state));
    }
  }
}

void VirtualGroup::restore(const StepJournal::GroupMark& mark, const StepJournal& journal) {
  for (size_t s = 0; s < stacks_.size(); ++s) {
    const auto& stack = stacks_[s];
    for (int64_t r = 0; r < stack.spec.size(); ++r) {
      const auto it = journal.states.find(stack.ids[r]);
      if (it == journal.states.end()) continue;
      preconditioner_->import_changing(static_cast<int64_t>(s), r, it->second);
      elementwise_->import_member(static_cast<int64_t>(s), r, it->second);
    }
  }
  elementwise_->release_since(mark.allocated);
  preconditioner_->set_counters(mark.counters);
}

bool VirtualGroup::fused_step() const {
  // Grafting would take the chain's V slot and needs the norms of a separate direction; the
  // fused pass has CPU loops only.
  return fused_step_enabled.load() && preconditioner_->elementwise() &&
         grafting_kind(structure_.grafting()) == GraftingKind::kNone && !stacks_.empty() &&
         stacks_.front().spec.options.device().is_cpu();
}

void VirtualGroup::step(const StepInputs& in) {
  // In chunks of rows (ChunkStep's buffers bounded by step_chunk_bytes), each through every phase;
  // a block's result does not depend on the chunks.
  const bool fused = fused_step();
  for (const auto& chunk : step_chunks(in)) {
    StepUpdates updates(in.distributor);
    // Profiler scopes (bench_transformer --profile-steps): which phase the host is in.
    RECORD_USER_SCOPE("shampoo::chunk");
    auto chunk_step = [&] {
      RECORD_USER_SCOPE("shampoo::prepare_chunk");
      return prepare_chunk(in, chunk, updates, fused);
    }();
    if (chunk_step.chain.empty()) continue;
    if (fused) {
      // Statistics, direction and update in one pass: nothing changes before it.
      if (in.fault) in.fault(FaultPoint::kStatisticsUpdated);
      if (in.fault) in.fault(FaultPoint::kBeforeUpdate);
      run_chain_fused(chunk_step.chain);
      ++fused_chunks;
    } else {
      {
        RECORD_USER_SCOPE("shampoo::chain_pre");
        run_chain_pre(chunk_step.chain);  // L2 weight decay, grafting statistics, β1/β3 filtering
      }
      {
        RECORD_USER_SCOPE("shampoo::update_statistics");
        update_statistics(chunk_step);  // Kronecker factors, amortized roots
      }
      if (in.fault) in.fault(FaultPoint::kStatisticsUpdated);
      {
        RECORD_USER_SCOPE("shampoo::precondition");
        precondition(chunk_step);  // the matrix preconditioner applied to Ḡ
      }
      {
        RECORD_USER_SCOPE("shampoo::chain_norms");
        run_chain_norms(chunk_step.chain);  // the grafting norms
      }
      if (in.fault) in.fault(FaultPoint::kBeforeUpdate);
      RECORD_USER_SCOPE("shampoo::chain_post");
      run_chain_post(chunk_step.chain);  // graft, decoupled weight decay, momentum, × −lr, apply
    }
    elementwise_->commit();  // compact state: the chain's float copies rounded back
    updates.finish();
  }
}

std::vector<std::vector<Rows>> VirtualGroup::step_chunks(const StepInputs& in) const {
  const int64_t limit = step_chunk_bytes();
  std::vector<std::vector<Rows>> chunks;
  int64_t bytes = limit;  // the first row opens a chunk
  for (size_t s = 0; s < stacks_.size(); ++s) {
    const auto& spec = stacks_[s].spec;
    int64_t row_bytes = static_cast<int64_t>(spec.options.dtype().itemsize());
    for (const int64_t d : spec.block_shape) row_bytes *= d;
    row_bytes *= 2;  // G' and Ḡ
    for (const int64_t r : rows_with_gradients(static_cast<int64_t>(s), in).rows) {
      if (bytes + row_bytes > limit && bytes > 0) {
        chunks.emplace_back(stacks_.size());
        bytes = 0;
      }
      chunks.back()[s].rows.push_back(r);
      bytes += row_bytes;
    }
  }
  for (auto& chunk : chunks) {
    for (size_t s = 0; s < stacks_.size(); ++s) {
      chunk[s].all = chunk[s].size() == stacks_[s].spec.size();
    }
  }
  return chunks;
}

VirtualGroup::ChunkStep VirtualGroup::prepare_chunk(const StepInputs& in,
                                                    const std::vector<Rows>& chunk,
                                                    StepUpdates& updates, bool fused) {
  elementwise_->discard();  // what a failed earlier chunk bound
  ChunkStep chunk_step;
  chunk_step.stacks.resize(stacks_.size());
  for (size_t s = 0; s < stacks_.size(); ++s) {
    const auto& stack = stacks_[s];
    auto& st = chunk_step.stacks[s];
    st.rows = chunk[s];
    if (st.rows.size() == 0) continue;
    if (fused) {
      for (int64_t i = 0; i < st.rows.size(); ++i) {
        chunk_step.chain.push_back(
            chain_entry(in, static_cast<int64_t>(s), st.rows.rows[i], i, nullptr, updates));
        in.computed[stack.blocks[st.rows.rows[i]]] = true;
      }
      continue;
    }
    bool any_filter = false;
    for (const int64_t r : st.rows.rows) {
      any_filter |= std::get<0>(options_of_block(in, stack.blocks[r]).options.betas()) != 0.0;
    }
    std::vector<int64_t> shape{st.rows.size()};
    shape.insert(shape.end(), stack.spec.block_shape.begin(), stack.spec.block_shape.end());
    st.gradients = at::empty(shape, stack.spec.options);
    st.filtered = any_filter ? at::empty(shape, stack.spec.options) : st.gradients;
    elementwise_->prepare_factored(static_cast<int64_t>(s), st.rows);
    for (int64_t i = 0; i < st.rows.size(); ++i) {
      const int64_t b = stack.blocks[st.rows.rows[i]];
      st.chain.push_back(chunk_step.chain.size());
      chunk_step.chain.push_back(
          chain_entry(in, static_cast<int64_t>(s), st.rows.rows[i], i, &st, updates));
      in.computed[b] = true;
    }
    copy_in_runs(st.copy_to, st.copy_from);
  }
  return chunk_step;
}

ChainBlockTensors VirtualGroup::chain_entry(const StepInputs& in, int64_t s, int64_t row, int64_t i,
                                            StackStep* st, StepUpdates& updates) {
  const int64_t b = stacks_[s].blocks[row];
  const auto& block = in.blocks[b];
  const auto [options, t] = options_of_block(in, b);
  const double lr_sum = in.group_lr_sums[in.params[block.param].group];
  ChainBlockTensors c;
  c.scalars = chain_scalars(options, t, in.distributor.communicate_params(), lr_sum);
  const auto& grad_view = in.grad_blocks[block.param][block.id.block];
  if (st == nullptr) {
    // The fused pass: the family's statistics and direction in the chain.
    const auto direction = preconditioner_->elementwise_direction(s, row, t);
    c.diagonal_state = direction.state;
    fill_diagonal_scalars(direction.coefficients, c.scalars);
    c.scalars.direction_mode = static_cast<int32_t>(
        direction.kind == ElementwiseDirection::Kind::kSign ? kernels::DirectionMode::kSign
                                                            : kernels::DirectionMode::kDiagonal);
    // A column block of a matrix is read where it lies on the CPU, copied on CUDA.
    c.grad = chain_takes_view(grad_view) ? grad_view : grad_view.contiguous();
  } else {
    push_statistics_scalars(options, t, st->scalars);
    st->amortize.push_back(amortized_at(structure_, t));
    // A diagonal block (no factor left by the rules) takes the grafting update alone, as before
    // preconditioning starts.
    const bool diagonal = stacks_[s].diagonal;
    st->preconditioned.push_back(
        !diagonal &&
        matrix_preconditioned_at(structure_, t, preconditioner_->identity_before_amortization()));
    if (diagonal)
      c.scalars.direction_mode = static_cast<int32_t>(kernels::DirectionMode::kDiagonal);
    c.gradient_out = st->gradients[i];
    c.filtered_out = st->filtered[i];
    if (chain_takes_view(grad_view)) {
      c.grad = grad_view;  // on the CPU also a column block of a matrix, read where it lies
    } else {
      // A column block of a matrix on CUDA: copied once, straight into its row (the pre pass then
      // reads and rewrites it in place), with the stack's other such blocks (prepare_chunk).
      st->copy_to.push_back(c.gradient_out);
      st->copy_from.push_back(grad_view);
      c.grad = c.gradient_out;
    }
  }
  const auto& param_view = in.param_blocks[block.param][block.id.block];
  elementwise_->bind(s, row, c.scalars.beta1 != 0.0, c.scalars.momentum != 0.0, c, b, t);
  if (c.scalars.averaging != 0) elementwise_->bind_average(s, row, param_view, c);
  updates.route(b, param_view, c.filtered_out, c);
  return c;
}

void VirtualGroup::update_statistics(ChunkStep& chunk_step) {
  for (size_t s = 0; s < stacks_.size(); ++s) {
    auto& st = chunk_step.stacks[s];
    if (st.rows.size() == 0) continue;
    preconditioner_->update(static_cast<int64_t>(s), st.rows, st.gradients, st.scalars,
                            st.amortize);
  }
}

void VirtualGroup::precondition(ChunkStep& chunk_step) {
  for (size_t s = 0; s < stacks_.size(); ++s) {
    auto& st = chunk_step.stacks[s];
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
          0, host_to_device(at::tensor(local, at::TensorOptions().dtype(at::kLong)),
                            filtered.device(), at::kLong));
      preconditioned = at::empty_like(filtered);
    }
    preconditioner_->precondition(static_cast<int64_t>(s), rows, filtered, scalars, preconditioned);
    for (size_t j = 0; j < chain_of.size(); ++j) {
      chunk_step.chain[chain_of[j]].preconditioned = preconditioned[static_cast<int64_t>(j)];
    }
  }
}

void VirtualGroup::switch_sequence(bool to_eval, const std::vector<ParamEntry>& params,
                                   const std::vector<BlockEntry>& blocks,
                                   Distributor& distributor) const {
  const double mu_y = averaging_coefficients(structure_, 0.0).train;
  const double c = to_eval ? 1.0 - 1.0 / mu_y : 1.0 - mu_y;
  std::map<int64_t, std::vector<at::Tensor>> views;  // per parameter, its block views
  std::map<int64_t, at::Tensor> work;                // per parameter, what the views are of
  for (size_t s = 0; s < stacks_.size(); ++s) {
    for (int64_t r = 0; r < stacks_[s].spec.size(); ++r) {
      const auto z = elementwise_->average(static_cast<int64_t>(s), r);
      if (!z.defined()) continue;
      const int64_t b = stacks_[s].blocks[r];
      const auto& block = blocks[b];
      auto& param_views = views[block.param];
      if (param_views.empty()) {
        work[block.param] = work_tensor(params[block.param].param);
        param_views = block_views(work[block.param], params[block.param].plan);
      }
      auto view = param_views[block.id.block];
      const auto delta = at::sub(z, view).mul_(c);
      if (!distributor.distributed()) {
        view.add_(delta);
        continue;
      }
      // As a step's update: every rank, the owner included, applies the received value.
      distributor.slot(b).copy_(distributor.communicate_params() ? at::add(view, delta).reshape(-1)
                                                                 : delta.reshape(-1));
      distributor.mark_updated(b);
    }
  }
  if (!distributor.distributed()) {
    for (const auto& [p, tensor] : work) write_back(params[p].param, tensor);
  }
}

AmortizedCounters VirtualGroup::counters() const { return preconditioner_->counters(); }

void VirtualGroup::add_memory(MemorySummary& out) const {
  preconditioner_->add_memory(out);
  elementwise_->add_memory(out);
}

int64_t VirtualGroup::state_bytes() const {
  return preconditioner_->state_bytes() + elementwise_->state_bytes();
}

}  // namespace shampoo::detail
