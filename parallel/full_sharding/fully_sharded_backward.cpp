// Full sharding: a unit's forward, the backward pass (gathers in reverse forward order) and the
// reduction of the unit's gradients to what each rank steps.
#include <ATen/core/grad_mode.h>
#include <c10/util/accumulate.h>
#include <torch/csrc/autograd/variable.h>

#include "parallel/communication/collectives.h"
#include "parallel/full_sharding/fully_sharded_state.h"

namespace shampoo {

at::Tensor FullyShardedDataParallel::State::forward(size_t u,
                                                    const std::function<at::Tensor()>& fn) {
  auto& unit = this->unit(u);
  if (holding) {
    TORCH_CHECK(!at::GradMode::is_enabled(), kWho, "the forward of unit '", unit.name,
                "' runs with gradients between gather_all() and release_all(); those are for "
                "forwards without gradients (evaluation)");
    return fn();
  }
  if (unit.pending.valid()) wait_for(unit);
  {
    std::lock_guard<std::recursive_mutex> lock(mutex);
    // The first forward of an iteration: no unit is gathered, groups added since join here.
    if (!pass.is_open() && forward_order.empty()) sync_groups();
    gather(unit, *group);
  }
  at::Tensor out;
  try {
    out = fn();
  } catch (const c10::Error& e) {
    std::lock_guard<std::recursive_mutex> lock(mutex);
    if (options.reshard_after_forward()) reshard(unit);
    std::vector<std::string> released;
    for (const auto& other : units) {
      if (other.get() != &unit && !other->gathered) released.push_back("'" + other->name + "'");
    }
    if (released.empty()) throw;
    std::string names;
    for (size_t k = 0; k < released.size(); ++k) names += (k ? ", " : "") + released[k];
    TORCH_CHECK(false, kWho, "the forward of unit '", unit.name,
                "' failed: ", e.what_without_backtrace(),
                "\nWhile it ran, the parameters of the other units (", names,
                ") were released: they have shape [0] outside their own unit's forward. A unit's "
                "forward may use its own parameters only; a parameter that two modules share (an "
                "embedding tied to the output projection) goes into one unit whose forward runs "
                "for each of them (docs/full_sharding.md, \"Tied weights\")");
  }
  TORCH_CHECK(out.defined(), kWho, "the forward of unit '", unit.name,
              "' returned an undefined tensor");
  if (out.requires_grad()) {
    std::lock_guard<std::recursive_mutex> lock(mutex);
    if (!unit.in_pass) {
      unit.in_pass = true;
      forward_order.push_back(u);
    }
    std::weak_ptr<State> weak = shared_from_this();
    out.register_hook([weak, u](const at::Tensor&) {
      if (auto self = weak.lock()) self->before_unit_backward(u);
    });
  }
  if (options.reshard_after_forward()) {
    std::lock_guard<std::recursive_mutex> lock(mutex);
    reshard(unit);
  }
  return out;
}

void FullyShardedDataParallel::State::open_pass() {
  std::weak_ptr<State> weak = shared_from_this();
  if (!pass.open([weak] {
        if (auto self = weak.lock()) self->close_pass();
      })) {
    return;
  }
  // With overlap the steps run during this pass: the options in effect are those at its start.
  if (pass.stepping() && options.overlap_step()) push_group_options();
}

/// Before the unit's backward: gather it, and every unit before it in reverse forward order
/// (the same sequence of collectives on every rank, whatever order hooks fire in).
void FullyShardedDataParallel::State::before_unit_backward(size_t u) {
  std::lock_guard<std::recursive_mutex> lock(mutex);
  open_pass();
  const auto position = std::find(forward_order.rbegin(), forward_order.rend(), u);
  if (position == forward_order.rend()) return;
  const auto last = static_cast<size_t>(position - forward_order.rbegin());
  for (; next_to_gather <= last; ++next_to_gather) {
    gather(unit(forward_order[forward_order.size() - 1 - next_to_gather]), *group);
  }
}

void FullyShardedDataParallel::State::on_grad_ready(size_t u, size_t i) {
  std::lock_guard<std::recursive_mutex> lock(mutex);
  open_pass();
  auto& slot = unit(u).params[i];
  if (!slot.arrived) {
    slot.arrived = true;
    ++unit(u).arrived;
  }
  // Reductions run in reverse forward order on every rank (their collectives must match).
  while (next_to_reduce < forward_order.size()) {
    auto& next = unit(forward_order[forward_order.size() - 1 - next_to_reduce]);
    if (next.arrived < static_cast<int64_t>(next.params.size())) break;
    reduce(next);
    ++next_to_reduce;
  }
}

void FullyShardedDataParallel::State::close_pass() {
  std::lock_guard<std::recursive_mutex> lock(mutex);
  // Units whose gradients did not all arrive (a parameter unused in this pass counts as zero).
  for (; next_to_reduce < forward_order.size(); ++next_to_reduce) {
    reduce(unit(forward_order[forward_order.size() - 1 - next_to_reduce]));
  }
  for (auto& unit : units) {
    unit->in_pass = false;
    unit->arrived = 0;
    for (auto& slot : unit->params) slot.arrived = false;
  }
  forward_order.clear();
  next_to_gather = 0;
  next_to_reduce = 0;
  const bool stepping = pass.stepping();
  pass.end();
  if (stepping && options.overlap_step()) {
    // The one point where an iteration's steps end: before backward() returns. What the user
    // does next (a scheduler's step, set_lr, zero_grad, a checkpoint) then never races with a
    // step on the worker, and options changed between iterations apply to the next one.
    wait_all();
    if (!pass_failure.empty()) {
      const bool undone = undo_pass();
      const auto message = std::exchange(pass_failure, std::string());
      pass.stepped();
      write_state_entries();
      TORCH_CHECK(false, message, failure_outcome(undone));
    }
    commit_pass();
    finish_step();
    write_state_entries();
  }
}

/// Averages the unit's gradients over the ranks into what this rank steps, releases the full
/// gradients, and steps the unit on the worker (overlap) or marks it for step().
void FullyShardedDataParallel::State::reduce(Unit& unit) {
  // The gathers for backward never come back to a reduced unit (the worker may release it).
  next_to_gather = std::max(next_to_gather, next_to_reduce + 1);
  const bool step_now = pass.stepping() && options.overlap_step();
  std::vector<at::Tensor> grads;
  for (auto& slot : unit.params) {
    auto grad = std::exchange(slot.param.mutable_grad(), at::Tensor());
    grads.push_back(grad.defined() ? grad.view(slot.sizes).to(unit.reduce_dtype)
                                   : at::zeros(slot.sizes, unit.options.dtype(unit.reduce_dtype)));
  }
  // The parameters go before the gradients are reduced. A lossless step right away keeps the
  // ones this rank owns when they hold its values exactly (gathered in their own dtype): the
  // step then needs no rows collected.
  if (step_now && lossless() && unit.gathered && unit.compute_dtype == unit.dtype) {
    for (auto& slot : unit.params) {
      if (slot.owner != rank) detail::release_full(slot.param, unit.dtype);
    }
    unit.gathered = false;
    unit.owned_kept = true;
  } else {
    reshard(unit);
  }
  if (lossless()) {
    reduce_to_owners(unit, std::move(grads));
  } else {
    reduce_to_rows(unit, std::move(grads));
  }
  if (pass.stepping()) unit.to_step = true;
  if (step_now) {
    std::weak_ptr<State> weak = shared_from_this();
    Unit* target = &unit;
    unit.pending = worker->submit([weak, target] {
      if (auto self = weak.lock()) self->step_unit(*target, *self->step_group);
    });
  }
}

/// Lossless: each whole gradient is summed into its owner's copy in place (a c10d reduce, as
/// gradient sharding does) and divided by the world size there: an all-reduce's average, with
/// no buffer beyond the gradients themselves. The other ranks release theirs.
void FullyShardedDataParallel::State::reduce_to_owners(Unit& unit, std::vector<at::Tensor> grads) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (size_t i = 0; i < grads.size() && world > 1; ++i) {
    std::vector<at::Tensor> one{grads[i]};
    works.push_back(detail::start_reduce(*reduce_group, one, unit.params[i].owner));
  }
  detail::wait_all_of(works, "the gradient reduction of unit '" + unit.name + "'", rank);
  std::vector<at::Tensor> owned;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (unit.params[i].owner == rank) owned.push_back(grads[i]);
  }
  reduce_across_replicas(unit, owned);
  for (size_t i = 0; i < grads.size(); ++i) {
    // Split across replicas: the sum reached the stepping replica only.
    if (steps_here(unit.params[i])) {
      accumulate(unit.params[i], grads[i].to(unit.dtype).div_(world * replicas));
    }
    grads[i] = at::Tensor();
  }
}

/// Local shards: a reduce-scatter of the rank-major row chunks (padded), averaged.
void FullyShardedDataParallel::State::reduce_to_rows(Unit& unit, std::vector<at::Tensor> grads) {
  const auto reduce = unit.options.dtype(unit.reduce_dtype);
  auto send = at::empty({world, unit.shard_numel}, reduce);
  for (size_t i = 0; i < unit.params.size(); ++i) {
    const auto& slot = unit.params[i];
    write_chunks(send, slot, grads[i]);
    grads[i] = at::Tensor();
  }
  auto received = at::empty({unit.shard_numel}, reduce);
  auto flat = send.view({-1});
  detail::wait_one(detail::start_reduce_scatter(*reduce_group, received, flat),
                   "the gradient reduce-scatter of unit '" + unit.name + "'", rank);
  send = at::Tensor();
  reduce_across_replicas(unit, {received});
  for (auto& slot : unit.params) {
    const int64_t n = slot.valid_rows(rank) * slot.row_numel;
    if (n > 0) {
      accumulate(slot, received.narrow(0, slot.offset, n)
                           .to(unit.dtype)
                           .div(world * replicas)
                           .view(slot.shard_sizes(rank)));
    }
  }
}

/// Hybrid: sums `sums` (what this rank reduced within its shard group) over the replica group,
/// in place: the ranks there hold the same shards. Nothing without replicas.
void FullyShardedDataParallel::State::reduce_across_replicas(const Unit& unit,
                                                             const std::vector<at::Tensor>& sums) {
  if (replicas == 1) return;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<const ParamSlot*> owned;  // split: the slots of `sums`, for their replica
  for (const auto& slot : unit.params) {
    if (slot.owner == rank) owned.push_back(&slot);
  }
  for (size_t k = 0; k < sums.size(); ++k) {
    std::vector<at::Tensor> one{sums[k]};
    if (split()) {  // to the replica that steps it
      works.push_back(
          detail::start_reduce(*options.replica_group(), one, owned.at(k)->replica_owner));
    } else {
      works.push_back(detail::start_all_reduce(*options.replica_group(), one));
    }
  }
  detail::wait_all_of(works, "the gradient all-reduce across replicas of unit '" + unit.name + "'",
                      rank);
}

void FullyShardedDataParallel::State::accumulate(ParamSlot& slot, at::Tensor averaged) {
  if (slot.reduced.defined()) {
    slot.reduced += averaged;
  } else {
    slot.reduced = std::move(averaged);
  }
}

}  // namespace shampoo
