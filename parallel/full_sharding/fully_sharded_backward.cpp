// Full sharding: a unit's forward, the backward pass (gathers in reverse forward order) and the
// reduction of the unit's gradients to what each rank steps.
#include <ATen/core/grad_mode.h>
#include <c10/util/accumulate.h>
#include <torch/csrc/autograd/variable.h>

#include "parallel/communication/collectives.h"
#include "parallel/full_sharding/fully_sharded_state.h"

namespace shampoo::detail {

at::Tensor FsdpState::forward(size_t u, const std::function<at::Tensor()>& fn) {
  auto& unit = this->unit(u);
  if (holding) {
    TORCH_CHECK(!at::GradMode::is_enabled(), kFsdpWho, "the forward of unit '", unit.name,
                "' runs with gradients between gather_all() and release_all(); those are for "
                "forwards without gradients (evaluation)");
    return fn();
  }
  if (unit.pending.valid()) unit.wait();
  {
    std::lock_guard<std::recursive_mutex> lock(mutex);
    // The first forward of an iteration: no unit is gathered, groups added since join here.
    if (!pass.is_open() && forward_order.empty()) groups.sync();
    unit.gather(*mesh.group);
  }
  at::Tensor out;
  try {
    out = fn();
  } catch (const c10::Error& e) {
    std::lock_guard<std::recursive_mutex> lock(mutex);
    if (options.reshard_after_forward()) unit.reshard();
    std::vector<std::string> released;
    for (const auto& other : units) {
      if (other.get() != &unit && !other->gathered) released.push_back("'" + other->name + "'");
    }
    if (released.empty()) throw;
    std::string names;
    for (size_t k = 0; k < released.size(); ++k) names += (k ? ", " : "") + released[k];
    TORCH_CHECK(false, kFsdpWho, "the forward of unit '", unit.name,
                "' failed: ", e.what_without_backtrace(),
                "\nWhile it ran, the parameters of the other units (", names,
                ") were released: they have shape [0] outside their own unit's forward. A unit's "
                "forward may use its own parameters only; a parameter that two modules share (an "
                "embedding tied to the output projection) goes into one unit whose forward runs "
                "for each of them (docs/full_sharding.md, \"Tied weights\")");
  }
  TORCH_CHECK(out.defined(), kFsdpWho, "the forward of unit '", unit.name,
              "' returned an undefined tensor");
  if (out.requires_grad()) {
    std::lock_guard<std::recursive_mutex> lock(mutex);
    if (!unit.in_pass) {
      unit.in_pass = true;
      forward_order.push_back(u);
    }
    std::weak_ptr<FsdpState> weak = shared_from_this();
    out.register_hook([weak, u](const at::Tensor&) {
      if (auto self = weak.lock()) self->before_unit_backward(u);
    });
  }
  if (options.reshard_after_forward()) {
    std::lock_guard<std::recursive_mutex> lock(mutex);
    unit.reshard();
  }
  return out;
}

void FsdpState::open_pass() {
  std::weak_ptr<FsdpState> weak = shared_from_this();
  if (!pass.open([weak] {
        if (auto self = weak.lock()) self->close_pass();
      })) {
    return;
  }
  // With overlap the steps run during this pass: the options in effect are those at its start.
  if (pass.stepping() && options.overlap_step()) groups.push_options();
}

/// Before the unit's backward: gather it, and every unit before it in reverse forward order
/// (the same sequence of collectives on every rank, whatever order hooks fire in).
void FsdpState::before_unit_backward(size_t u) {
  std::lock_guard<std::recursive_mutex> lock(mutex);
  open_pass();
  const auto position = std::find(forward_order.rbegin(), forward_order.rend(), u);
  if (position == forward_order.rend()) return;
  const auto last = static_cast<size_t>(position - forward_order.rbegin());
  for (; next_to_gather <= last; ++next_to_gather) {
    unit(forward_order[forward_order.size() - 1 - next_to_gather]).gather(*mesh.group);
  }
}

void FsdpState::on_grad_ready(size_t u, size_t i) {
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

void FsdpState::close_pass() {
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
      groups.write_state_entries();
      TORCH_CHECK(false, message, failure_outcome(undone));
    }
    commit_pass();
    finish_step();
    groups.write_state_entries();
  }
}

void FsdpState::reduce(FsdpUnit& unit) {
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
      if (slot.owner != mesh.rank) release_full(slot.param, unit.dtype);
    }
    unit.gathered = false;
    unit.owned_kept = true;
  } else {
    unit.reshard();
  }
  if (lossless()) {
    unit.reduce_to_owners(std::move(grads));
  } else {
    unit.reduce_to_rows(std::move(grads));
  }
  if (pass.stepping()) unit.to_step = true;
  if (step_now) {
    std::weak_ptr<FsdpState> weak = shared_from_this();
    FsdpUnit* target = &unit;
    unit.pending = worker->submit([weak, target] {
      if (auto self = weak.lock()) self->step_unit(*target, *self->mesh.step_group);
    });
  }
}

}  // namespace shampoo::detail
