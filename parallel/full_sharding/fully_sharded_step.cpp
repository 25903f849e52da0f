// Full sharding: the step of a unit (during backward with overlap) or of every unit (after
// backward), the agreement on failures, and what undoes a failed iteration.
#include <ATen/core/grad_mode.h>
#include <c10/util/accumulate.h>

#include <cmath>
#include <sstream>

#include "parallel/communication/collectives.h"
#include "parallel/data_parallel/spread_grad_norm.h"
#include "parallel/full_sharding/fully_sharded_state.h"
#include "parallel/optimizers/libtorch_optimizers.h"
#include "parallel/optimizers/optimizer_step.h"

namespace shampoo::detail {

/// Steps one unit on the gradients reduced for it and releases them. Lossless: every rank
/// sends each owner its rows of the owner's parameters over `via` (the full values in the
/// parameters' own dtype, whatever the compute dtype), the owners step them whole, send every
/// rank its rows back, and release them.
void FsdpState::step_unit(FsdpUnit& unit, c10d::ProcessGroup& via) {
  at::NoGradGuard no_grad;
  if (!pass_failure.empty()) {  // an earlier unit of this pass failed, on every rank alike
    unit.drop_step(lossless());
    return;
  }
  if (lossless() && !std::exchange(unit.owned_kept, false)) unit.collect_rows(via);
  UndoRecord undo;
  const auto failure = step_reduced(unit, undo);
  // Every rank learns whether any failed before any rank's rows change, so that all of them
  // go on (or stop) together instead of one waiting in the all-to-all.
  const auto failed = mesh.ranks_that_failed(via, !failure.empty());
  const bool elsewhere =
      mesh.or_across_replicas({failed.empty() ? 0 : 1}, mesh.replica_step_group)[0] != 0 &&
      failed.empty();
  if (!failed.empty() || elsewhere) {
    undo.undo();  // this rank's rows never changed
    if (lossless()) unit.release_storage();
    unit.to_step = false;
    pass_failure = elsewhere ? std::string(kFsdpWho) + "the step of unit '" + unit.name +
                                   "' failed in another replica (the error there says why)"
                             : failure_message(mesh, unit, failed, failure);
    return;
  }
  if (journal()) {
    for (auto& slot : unit.params) undo.save_values(slot.shard);
  }
  if (lossless()) {
    unit.broadcast_stepped(mesh.replica_step_group);
    unit.scatter_rows(via);
    unit.release_storage();
  }
  if (journal()) pass_undo.push_back(std::move(undo));
  unit.to_step = false;
}

/// This rank's part of a unit's step: the reduced gradients set on what it steps (the whole
/// owned parameters, or its rows), its optimizers stepped (what undoes that saved in `undo`),
/// the gradients released. Returns why it failed (a non-finite gradient, an optimizer's error),
/// or nothing.
std::string FsdpState::step_reduced(FsdpUnit& unit, UndoRecord& undo) {
  // Without overlap every unit was checked before any stepped (check_finite_before_steps).
  std::string failure = options.overlap_step() ? unit.non_finite_gradient() : std::string();
  std::vector<at::Tensor> owned;  // lossless: the parameters this rank steps
  for (auto& slot : unit.params) {
    if (!slot.reduced.defined()) continue;
    auto& target = lossless() ? slot.param : slot.shard;
    target.mutable_grad() = slot.reduced;
    if (lossless() && slot.in_a_group()) owned.push_back(slot.param);
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

/// Undoes the steps of the units stepped in the failed pass; false when one of them cannot be.
bool FsdpState::undo_pass() {
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

void FsdpState::commit_pass() {
  for (auto& undo : pass_undo) undo.commit();
  pass_undo.clear();
  if (rank_optimizer) rank_optimizer->finish();
}

std::string failure_message(const ShardMesh& mesh, const FsdpUnit& unit,
                            const std::vector<int>& failed, const std::string& here) {
  std::ostringstream out;
  out << kFsdpWho << "the step of unit '" << unit.name << "' failed on " << mesh.ranks_text(failed);
  if (here.empty()) {
    out << " (the error there says why)";
  } else {
    out << ": on " << mesh.ranks_text({mesh.rank}) << ", " << here;
  }
  return out.str();
}

std::string failure_outcome(bool undone) {
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

void FsdpState::check_step_after_backward(const char* function) const {
  TORCH_CHECK(!options.overlap_step(), kFsdpWho, function,
              ": with overlap_step the steps run during backward; go on with the next forward "
              "(or call wait()), or construct with FullyShardedOptions().overlap_step(false)");
  TORCH_CHECK(pass.passes_since_step() >= options.accumulation_steps(), kFsdpWho, function,
              ": accumulation_steps is ", options.accumulation_steps(), " and ",
              pass.passes_since_step(), " backward pass(es) ran since the last step");
}

void FsdpState::step_all(const char* function) {
  check_step_after_backward(function);
  std::lock_guard<std::recursive_mutex> lock(mutex);
  groups.sync();
  groups.push_options();
  check_finite_before_steps();
  if (lossless()) {
    step_all_owned();
  } else {
    for (auto& unit : units) {
      if (!unit->to_step) continue;
      step_unit(*unit, *mesh.group);
      if (!pass_failure.empty()) {
        for (auto& rest : units) {
          if (rest->to_step) rest->drop_step(lossless());
        }
        pass.stepped();
        TORCH_CHECK(false, std::exchange(pass_failure, std::string()), failure_outcome(true));
      }
    }
  }
  finish_step();
  groups.write_state_entries();
}

/// Lossless, after backward: every unit's owned parameters get their full values, the rank's
/// optimizer steps them all in one ordinary step (DistributedShampoo's roots batched over all
/// of them), and every rank gets its rows back. A failure on any rank changes nothing on
/// every rank.
void FsdpState::step_all_owned() {
  std::vector<FsdpUnit*> stepping;
  for (auto& unit : units) {
    if (unit->to_step) stepping.push_back(unit.get());
  }
  for (auto* unit : stepping) unit->collect_rows(*mesh.group);
  std::vector<at::Tensor> owned;
  for (auto* unit : stepping) {
    for (auto& slot : unit->params) {
      if (!slot.reduced.defined() || !slot.in_a_group()) continue;
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
  const auto failed = mesh.ranks_that_failed(*mesh.group, !failure.empty());
  const bool any = mesh.or_across_replicas({failed.empty() ? 0 : 1}, mesh.replica_group)[0] != 0;
  for (auto* unit : stepping) {
    if (!any) {
      unit->broadcast_stepped(mesh.replica_group);
      unit->scatter_rows(*mesh.group);
    }
    unit->drop_step(lossless());
  }
  if (!any) return;
  pass.stepped();
  // The gradients were checked finite before (check_finite_before_steps): this is an
  // optimizer's error, which the ranks learn of after their own steps, kept without copies.
  TORCH_CHECK(false, kFsdpWho, "the step failed ",
              failed.empty() ? "in another replica" : "on " + mesh.ranks_text(failed),
              failure.empty() ? " (the error there says why)" : ": here, " + failure,
              "; no parameter changed on any rank, but the optimizer state of the ranks whose "
              "own step went through has advanced (a step after backward keeps no copy to undo "
              "it): load a checkpoint to go on from a known state");
}

/// Without overlap: every unit's averaged gradients are checked on their owners, and the
/// ranks agree, before any unit steps; a non-finite one fails the step on every rank with
/// nothing changed (the reduced gradients are dropped, as a skipped step drops them).
void FsdpState::check_finite_before_steps() {
  std::vector<int64_t> flags;
  std::string here;
  for (const auto& unit : units) {
    auto found = unit->to_step ? unit->non_finite_gradient() : std::string();
    if (here.empty()) here = found;
    flags.push_back(found.empty() ? 0 : 1);
  }
  const auto all = gather_int64(*mesh.group, flags);
  std::vector<int64_t> in_group(units.size(), 0);
  for (size_t u = 0; u < units.size(); ++u) {
    for (int r = 0; r < mesh.world; ++r) in_group[u] = in_group[u] != 0 || all[r][u] != 0 ? 1 : 0;
  }
  const auto anywhere = mesh.or_across_replicas(in_group, mesh.replica_group);
  for (size_t u = 0; u < units.size(); ++u) {
    if (anywhere[u] == 0) continue;
    std::vector<int> failed;
    for (int r = 0; r < mesh.world; ++r) {
      if (all[r][u] != 0) failed.push_back(r);
    }
    for (auto& unit : units) unit->drop_step(lossless());
    pass.stepped();
    TORCH_CHECK(false,
                failed.empty() ? std::string(kFsdpWho) + "the step of unit '" + units[u]->name +
                                     "' failed in another replica (the error there says why)"
                               : failure_message(mesh, *units[u], failed, here),
                failure_outcome(true));
  }
}

void FsdpState::skip_all() {
  check_step_after_backward("skip_step()");
  std::lock_guard<std::recursive_mutex> lock(mutex);
  for (auto& unit : units) {
    for (auto& slot : unit->params) slot.reduced = at::Tensor();
    unit->to_step = false;
  }
  pass.stepped();
}

/// `function`: what the user called, for the error with overlap_step.
std::vector<at::Tensor> FsdpState::reduced_gradients(const char* function) {
  TORCH_CHECK(!options.overlap_step(), kFsdpWho, function,
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

double FsdpState::clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm,
                                 double norm_type, const char* function) {
  reduced_gradients(function);  // for its check: an error with overlap_step
  TORCH_CHECK(lossless(), kFsdpWho, function,
              ": needs step_mode kLossless (local shards hold row chunks, whose norms do not add "
              "up to a whole parameter's bit for bit)");
  TORCH_CHECK(!mesh.split, kFsdpWho, function,
              ": with split_across_replicas each replica holds the averaged gradients of the "
              "parameters it steps only, and clipping by their norm across the replicas is not "
              "supported yet; clip with the state replicated (split_across_replicas(false))");
  std::vector<SpreadGradient> spread;
  for (const auto& p : params) {
    const auto [u, i] = position_of(p);
    const auto& slot = unit(u).params[i];
    // The owner holds the parameter's whole averaged gradient; nobody else holds any of it.
    spread.push_back({slot.reduced, slot.reduced, unit(u).options});
  }
  const auto who = std::string(kFsdpWho) + function;
  return clip_spread_grad_norm_(*mesh.group, spread, max_norm, norm_type, who.c_str());
}

void FsdpState::finish_step() {
  pass.stepped();
  ++steps;
}

void FsdpState::wait_all() {
  std::exception_ptr first;
  for (auto& unit : units) {
    if (!unit->pending.valid()) continue;
    try {
      unit->wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace shampoo::detail
