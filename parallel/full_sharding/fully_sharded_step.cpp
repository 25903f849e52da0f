// Full sharding: the step of a unit (during backward with overlap) or of every unit (after
// backward), the agreement on failures, and what undoes a failed iteration.
#include <ATen/core/grad_mode.h>
#include <c10/util/accumulate.h>

#include <cmath>
#include <sstream>

#include "parallel/communication/collectives.h"
#include "parallel/full_sharding/fully_sharded_state.h"
#include "parallel/optimizers/libtorch_optimizers.h"
#include "parallel/optimizers/optimizer_step.h"

namespace shampoo {
namespace {

/// Whether every element is finite: one read pass (aminmax propagates NaN, and an infinity is its
/// min or max; isfinite(...).all() took 30x as long on 15M floats).
bool all_finite(const at::Tensor& t) {
  if (t.numel() == 0) return true;
  const auto [low, high] = at::aminmax(t);
  return std::isfinite(low.item<double>()) && std::isfinite(high.item<double>());
}

}  // namespace

/// Steps one unit on the gradients reduced for it and releases them. Lossless: every rank
/// sends each owner its rows of the owner's parameters over `via` (the full values in the
/// parameters' own dtype, whatever the compute dtype), the owners step them whole, send every
/// rank its rows back, and release them.
void FullyShardedDataParallel::State::step_unit(Unit& unit, c10d::ProcessGroup& via) {
  at::NoGradGuard no_grad;
  if (!pass_failure.empty()) {  // an earlier unit of this pass failed, on every rank alike
    drop_unit_step(unit);
    return;
  }
  if (lossless() && !std::exchange(unit.owned_kept, false)) collect_rows(unit, via);
  UndoRecord undo;
  const auto failure = step_reduced(unit, undo);
  // Every rank learns whether any failed before any rank's rows change, so that all of them
  // go on (or stop) together instead of one waiting in the all-to-all.
  const auto flags = detail::gather_int64(via, {failure.empty() ? 0 : 1});
  std::vector<int> failed;
  for (int r = 0; r < world; ++r) {
    if (flags[r][0] != 0) failed.push_back(r);
  }
  const bool elsewhere =
      or_across_replicas({failed.empty() ? 0 : 1}, replica_step_group)[0] != 0 && failed.empty();
  if (!failed.empty() || elsewhere) {
    undo.undo();  // this rank's rows never changed
    if (lossless()) {
      for (auto& slot : unit.params) detail::release_full(slot.param, unit.dtype);
    }
    unit.to_step = false;
    pass_failure = elsewhere ? std::string(kWho) + "the step of unit '" + unit.name +
                                   "' failed in another replica (the error there says why)"
                             : failure_message(unit, failed, failure);
    return;
  }
  if (journal()) {
    for (auto& slot : unit.params) undo.save_values(slot.shard);
  }
  if (lossless()) {
    broadcast_stepped(unit, replica_step_group);
    scatter_rows(unit, via);
    for (auto& slot : unit.params) detail::release_full(slot.param, unit.dtype);
  }
  if (journal()) pass_undo.push_back(std::move(undo));
  unit.to_step = false;
}

/// This rank's part of a unit's step: the reduced gradients set on what it steps (the whole
/// owned parameters, or its rows), its optimizers stepped (what undoes that saved in `undo`),
/// the gradients released. Returns why it failed (a non-finite gradient, an optimizer's error),
/// or nothing.
std::string FullyShardedDataParallel::State::step_reduced(Unit& unit, UndoRecord& undo) {
  // Without overlap every unit was checked before any stepped (check_finite_before_steps).
  std::string failure = options.overlap_step() ? non_finite_gradient(unit) : std::string();
  std::vector<at::Tensor> owned;  // lossless: the parameters this rank steps
  for (auto& slot : unit.params) {
    if (!slot.reduced.defined()) continue;
    auto& target = lossless() ? slot.param : slot.shard;
    target.mutable_grad() = slot.reduced;
    if (lossless() && in_a_group(slot)) owned.push_back(slot.param);
  }
  std::vector<at::Tensor> rows;  // local shards: this rank's rows with their gradients set
  if (unit.optimizer) {
    for (auto& slot : unit.params) {
      if (slot.shard.grad().defined()) rows.push_back(slot.shard);
    }
  }
  if (failure.empty()) {
    try {
      // With the journal, the unit's step is part of the pass, which commit_pass or undo_pass
      // ends; what undoes it is saved in `undo` first.
      auto* kept = journal() ? &undo : nullptr;
      if (lossless()) rank_optimizer->step(owned, detail::StepScope::kInPass, kept);
      const auto scope = journal() ? detail::StepScope::kInPass : detail::StepScope::kAlone;
      if (unit.optimizer) unit.optimizer->step(rows, scope, kept);
    } catch (const std::exception& e) {
      failure = std::string("the step of unit '") + unit.name + "' failed: " + e.what();
    }
  }
  for (auto& slot : unit.params) {
    (lossless() ? slot.param : slot.shard).mutable_grad() = at::Tensor();
    slot.reduced = at::Tensor();
  }
  return failure;
}

/// A unit of a pass whose earlier unit failed: its gradients are dropped, nothing steps.
void FullyShardedDataParallel::State::drop_unit_step(Unit& unit) {
  for (auto& slot : unit.params) {
    slot.reduced = at::Tensor();
    if (lossless()) detail::release_full(slot.param, unit.dtype);  // kept from backward, if it was
  }
  unit.owned_kept = false;
  unit.to_step = false;
}

/// Undoes the steps of the units stepped in the failed pass; false when one of them cannot be.
bool FullyShardedDataParallel::State::undo_pass() {
  bool complete = true;
  for (auto it = pass_undo.rbegin(); it != pass_undo.rend(); ++it) {
    complete = complete && it->complete();
    it->undo();
  }
  pass_undo.clear();
  if (rank_optimizer) {
    // Without the journal the steps taken stand (undo_failed_steps(false)).
    if (journal()) {
      rank_optimizer->abort();
    } else {
      rank_optimizer->finish();
    }
  }
  return complete;
}

void FullyShardedDataParallel::State::commit_pass() {
  for (auto& undo : pass_undo) undo.commit();
  pass_undo.clear();
  if (rank_optimizer) rank_optimizer->finish();
}

/// "parameter i ... holds inf or NaN" for the first owned averaged gradient that does, else "".
std::string FullyShardedDataParallel::State::non_finite_gradient(const Unit& unit) const {
  for (size_t i = 0; i < unit.params.size(); ++i) {
    const auto& slot = unit.params[i];
    if (slot.reduced.defined() && !all_finite(slot.reduced)) {
      return "the averaged gradient of parameter " + std::to_string(i) + " of unit '" + unit.name +
             "' (shape " + detail::shape_text(slot.sizes) +
             ") holds inf or NaN (a rank's gradient did, or the average overflowed)";
    }
  }
  return "";
}

/// Every rank's message for a unit whose step failed on the ranks `failed`; `here` is this
/// rank's own reason (empty when it did not fail).
std::string FullyShardedDataParallel::State::failure_message(const Unit& unit,
                                                             const std::vector<int>& failed,
                                                             const std::string& here) const {
  std::ostringstream out;
  out << kWho << "the step of unit '" << unit.name << "' failed on " << ranks_text(failed);
  if (here.empty()) {
    out << " (the error there says why)";
  } else {
    out << ": on " << ranks_text({rank}) << ", " << here;
  }
  return out.str();
}

std::string FullyShardedDataParallel::State::ranks_text(const std::vector<int>& ranks) const {
  const auto list = [&](const std::vector<int>& values) {
    std::ostringstream out;
    for (size_t k = 0; k < values.size(); ++k) out << (k ? ", " : "") << values[k];
    return out.str();
  };
  const bool hybrid = replicas > 1;
  std::ostringstream out;
  if (!global_ranks.empty()) {
    std::vector<int> global;
    for (const int r : ranks) global.push_back(global_ranks.at(static_cast<size_t>(r)));
    out << "global rank(s) " << list(global);
    if (hybrid) out << " (rank(s) " << list(ranks) << " of shard group " << replica << ")";
  } else {
    out << "rank(s) " << list(ranks);
    if (hybrid) out << " of shard group " << replica;
  }
  return out.str();
}

/// The end of a failure's message: what the failed iteration left.
std::string FullyShardedDataParallel::State::failure_outcome(bool undone) {
  if (!undone) {
    return "; units stepped earlier in this backward pass by an optimizer that cannot undo a "
           "step (not DistributedShampoo or one of LibTorch's SGD, Adam, AdamW, Adagrad, "
           "RMSprop), or with FullyShardedOptions().undo_failed_steps(false), keep their step: "
           "load a checkpoint to go on from a known state";
  }
  return "; no unit was stepped in this iteration: parameters and optimizer state are as "
         "before it and the next iteration can run, as with data parallelism. A non-finite "
         "gradient comes from a non-finite loss or an overflow: skip the batch, lower the "
         "learning rate, or for fp16 use a GradScaler (with overlap_step(false))";
}

void FullyShardedDataParallel::State::check_step_after_backward(const char* function) const {
  TORCH_CHECK(!options.overlap_step(), kWho, function,
              ": with overlap_step the steps run during backward; go on with the next forward "
              "(or call wait()), or construct with FullyShardedOptions().overlap_step(false)");
  TORCH_CHECK(pass.passes_since_step() >= options.accumulation_steps(), kWho, function,
              ": accumulation_steps is ", options.accumulation_steps(), " and ",
              pass.passes_since_step(), " backward pass(es) ran since the last step");
}

void FullyShardedDataParallel::State::step_all(const char* function) {
  check_step_after_backward(function);
  std::lock_guard<std::recursive_mutex> lock(mutex);
  sync_groups();
  push_group_options();
  check_finite_before_steps();
  if (lossless()) {
    step_all_owned();
  } else {
    for (auto& unit : units) {
      if (!unit->to_step) continue;
      step_unit(*unit, *group);
      if (!pass_failure.empty()) {
        for (auto& rest : units) {
          if (rest->to_step) drop_unit_step(*rest);
        }
        pass.stepped();
        TORCH_CHECK(false, std::exchange(pass_failure, std::string()), failure_outcome(true));
      }
    }
  }
  finish_step();
  write_state_entries();
}

/// Lossless, after backward: every unit's owned parameters get their full values, the rank's
/// optimizer steps them all in one ordinary step (DistributedShampoo's roots batched over all
/// of them), and every rank gets its rows back. A failure on any rank changes nothing on
/// every rank.
void FullyShardedDataParallel::State::step_all_owned() {
  std::vector<Unit*> stepping;
  for (auto& unit : units) {
    if (unit->to_step) stepping.push_back(unit.get());
  }
  for (auto* unit : stepping) collect_rows(*unit, *group);
  std::vector<at::Tensor> owned;
  for (auto* unit : stepping) {
    for (auto& slot : unit->params) {
      if (!slot.reduced.defined() || !in_a_group(slot)) continue;
      slot.param.mutable_grad() = std::exchange(slot.reduced, at::Tensor());
      owned.push_back(slot.param);
    }
  }
  std::string failure;
  try {
    at::NoGradGuard no_grad;
    if (!owned.empty()) rank_optimizer->step(owned, detail::StepScope::kAlone, nullptr);
  } catch (const std::exception& e) {
    failure = std::string("the step failed: ") + e.what();
  }
  for (auto& p : owned) p.mutable_grad() = at::Tensor();
  const auto flags = detail::gather_int64(*group, {failure.empty() ? 0 : 1});
  std::vector<int> failed;
  for (int r = 0; r < world; ++r) {
    if (flags[r][0] != 0) failed.push_back(r);
  }
  const bool any = or_across_replicas({failed.empty() ? 0 : 1}, options.replica_group())[0] != 0;
  for (auto* unit : stepping) {
    if (!any) {
      broadcast_stepped(*unit, options.replica_group());
      scatter_rows(*unit, *group);
    }
    drop_unit_step(*unit);
  }
  if (!any) return;
  pass.stepped();
  // The gradients were checked finite before (check_finite_before_steps): this is an
  // optimizer's error, which the ranks learn of after their own steps, kept without copies.
  TORCH_CHECK(false, kWho, "the step failed ",
              failed.empty() ? "in another replica" : "on " + ranks_text(failed),
              failure.empty() ? " (the error there says why)" : ": here, " + failure,
              "; no parameter changed on any rank, but the optimizer state of the ranks whose "
              "own step went through has advanced (a step after backward keeps no copy to undo "
              "it): load a checkpoint to go on from a known state");
}

/// Hybrid: `flags` (this shard group's agreement, per item) or-ed over the replicas over `via`,
/// so that a failure in one replica (an optimizer's error on one rank; split, any failure, since
/// one replica steps a parameter) fails every replica alike instead of leaving them apart.
/// Unchanged without replicas.
std::vector<int64_t> FullyShardedDataParallel::State::or_across_replicas(
    std::vector<int64_t> flags, const c10::intrusive_ptr<c10d::ProcessGroup>& via) {
  if (replicas == 1) return flags;
  for (const auto& row : detail::gather_int64(*via, flags)) {
    for (size_t i = 0; i < flags.size(); ++i) flags[i] = flags[i] != 0 || row[i] != 0 ? 1 : 0;
  }
  return flags;
}

/// Without overlap: every unit's averaged gradients are checked on their owners, and the
/// ranks agree, before any unit steps; a non-finite one fails the step on every rank with
/// nothing changed (the reduced gradients are dropped, as a skipped step drops them).
void FullyShardedDataParallel::State::check_finite_before_steps() {
  std::vector<int64_t> flags;
  std::string here;
  for (const auto& unit : units) {
    auto found = unit->to_step ? non_finite_gradient(*unit) : std::string();
    if (here.empty()) here = found;
    flags.push_back(found.empty() ? 0 : 1);
  }
  const auto all = detail::gather_int64(*group, flags);
  std::vector<int64_t> in_group(units.size(), 0);
  for (size_t u = 0; u < units.size(); ++u) {
    for (int r = 0; r < world; ++r) in_group[u] = in_group[u] != 0 || all[r][u] != 0 ? 1 : 0;
  }
  const auto anywhere = or_across_replicas(in_group, options.replica_group());
  for (size_t u = 0; u < units.size(); ++u) {
    if (anywhere[u] == 0) continue;
    std::vector<int> failed;
    for (int r = 0; r < world; ++r) {
      if (all[r][u] != 0) failed.push_back(r);
    }
    for (auto& unit : units) drop_unit_step(*unit);
    pass.stepped();
    TORCH_CHECK(false,
                failed.empty() ? std::string(kWho) + "the step of unit '" + units[u]->name +
                                     "' failed in another replica (the error there says why)"
                               : failure_message(*units[u], failed, here),
                failure_outcome(true));
  }
}

void FullyShardedDataParallel::State::skip_all() {
  check_step_after_backward("skip_step()");
  std::lock_guard<std::recursive_mutex> lock(mutex);
  for (auto& unit : units) {
    for (auto& slot : unit->params) slot.reduced = at::Tensor();
    unit->to_step = false;
  }
  pass.stepped();
}

/// `function`: what the user called, for the error with overlap_step.
std::vector<at::Tensor> FullyShardedDataParallel::State::reduced_gradients(const char* function) {
  TORCH_CHECK(!options.overlap_step(), kWho, function,
              ": with overlap_step (the default) each unit steps during backward as soon as its "
              "gradients are reduced, before the other units' gradients exist, so there is "
              "nothing left to work on after backward; construct the wrapper with "
              "FullyShardedOptions().overlap_step(false) and call it between backward and "
              "step()");
  std::vector<at::Tensor> out;
  for (auto& unit : units) {
    for (auto& slot : unit->params) {
      if (slot.reduced.defined()) out.push_back(slot.reduced);
    }
  }
  return out;
}

void FullyShardedDataParallel::State::finish_step() {
  pass.stepped();
  ++steps;
}

void FullyShardedDataParallel::State::wait_for(Unit& unit) {
  auto pending = std::exchange(unit.pending, {});
  pending.get();
}

void FullyShardedDataParallel::State::wait_all() {
  std::exception_ptr first;
  for (auto& unit : units) {
    if (!unit->pending.valid()) continue;
    try {
      wait_for(*unit);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace shampoo
