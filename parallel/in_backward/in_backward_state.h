#pragma once
/// The inside of optimizer-in-backward (InBackwardOptimizer::State), shared by in_backward.cpp
/// (the sets, the backward pass, the steps) and in_backward_checkpoint.cpp (its checkpoints).
/// Internal: not installed.

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "parallel/data_parallel/backward_pass.h"
#include "parallel/data_parallel/grad_ready_hooks.h"
#include "parallel/in_backward/in_backward.h"
#include "parallel/optimizers/capabilities.h"
#include "parallel/optimizers/libtorch_optimizers.h"
#include "parallel/optimizers/optimizer_step.h"
#include "parallel/optimizers/parameter_owners.h"
#include "parallel/optimizers/phased_step.h"
#include "parallel/state_sharding/sharded_optimizer.h"

namespace shampoo {

struct InBackwardOptimizer::State : std::enable_shared_from_this<State> {
  struct Set {
    std::unique_ptr<torch::optim::Optimizer> optimizer;
    // The optimizer's interfaces, looked up when the set is added (phased: it steps in phases in
    // backward; owners: its ranks own its parameters).
    detail::Capabilities capabilities;
    std::vector<at::Tensor> params;
  };
  struct Entry {
    at::Tensor param;
    size_t set = 0;
    int64_t hook = 0;
    int64_t joined = 0;  // steps when it was added
  };
  // The optimizer object's state() map (it moves with the object; the move operations re-point
  // it): one ShardedParamState per parameter, written after every pass.
  ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>>* state_entries =
      nullptr;

  void write_state_entries() {
    if (state_entries == nullptr) return;
    for (const auto& e : entries) {
      auto& entry = (*state_entries)[e.param.unsafeGetTensorImpl()];
      auto* mine = dynamic_cast<ShardedParamState*>(entry.get());
      if (mine == nullptr) {
        entry = std::make_unique<ShardedParamState>();
        mine = static_cast<ShardedParamState*>(entry.get());
      }
      int64_t owner = ParameterOwners::kEveryRank;
      if (const ParameterOwners* owners = sets[e.set].capabilities.owners) {
        try {
          owner = owners->owner_of(e.param).value_or(ParameterOwners::kEveryRank);
        } catch (const c10::Error&) {  // blocks over several ranks: no one owner
        }
      }
      mine->step(steps - e.joined).owner(owner);
    }
  }

  std::vector<Set> sets;
  std::vector<Entry> entries;
  std::unordered_map<const void*, size_t> entry_of;  // TensorImpl -> entry
  int64_t steps = 0;
  int no_step = 0;
  // The passes and the accumulation: every k-th pass steps (stepped() is never called, so
  // passes_since_step() is passes()).
  detail::BackwardPass pass;
  GradientSynchronizer* sync = nullptr;
  BackwardUnscaler* unscaler = nullptr;
  bool pass_overflow = false;  // a gradient of this pass was inf or NaN on this rank

  bool next_pass_steps() const { return no_step == 0 && pass.next_steps(); }

  /// The process group that `group_of` gives for the sets' optimizers (null for those without
  /// one); an error ending in `mismatch` when two optimizers give different groups.
  template <typename GroupOf>
  c10::intrusive_ptr<c10d::ProcessGroup> one_group(const GroupOf& group_of,
                                                   const char* mismatch) const {
    c10::intrusive_ptr<c10d::ProcessGroup> group;
    for (size_t i = 0; i < sets.size(); ++i) {
      auto own = group_of(*sets[i].optimizer);
      if (!own) continue;
      TORCH_CHECK(!group || group.get() == own.get(), "InBackwardOptimizer: optimizer ", i, " ",
                  mismatch);
      group = own;
    }
    return group;
  }

  void update_sync() {
    if (sync != nullptr) sync->set_enabled(next_pass_steps());
  }

  /// After an error during backward: undoes the open step of every phased set (its state and
  /// parameters as before the pass) and closes the pass, which does not count. Steps that
  /// torch::optim optimizers took earlier in the pass stay (they have no undo).
  void abort_pass() {
    for (auto& set : sets) detail::abort_open_step(set.capabilities);
    pass.close();
    update_sync();
  }

  void open_pass() {
    // A pass still open from another backward: that one failed before its end callback ran
    // (an error in autograd or in a hook that is not ours). Undo it before this one starts.
    if (pass.abandoned()) abort_pass();
    // At the end of the whole backward pass: finish what is left and close the pass.
    std::weak_ptr<State> weak = shared_from_this();
    if (!pass.open(
            [weak] {
              if (auto self = weak.lock()) self->close_pass();
            },
            /*may_step=*/no_step == 0)) {
      return;
    }
    pass_overflow = false;
  }

  void on_grad_ready(size_t entry) {
    open_pass();
    // Accumulating, or the synchronizer drives the steps.
    if (!pass.stepping() || sync != nullptr) return;
    step_params_or_abort({entries[entry].param});
  }

  /// step_params, undoing the pass when it throws.
  void step_params_or_abort(const std::vector<at::Tensor>& params) {
    try {
      step_params(params);
    } catch (...) {
      abort_pass();
      throw;
    }
  }

  /// Steps `params` (all registered) with their optimizers and releases their gradients.
  void step_params(const std::vector<at::Tensor>& params) {
    c10::NoGradGuard no_grad;
    if (unscaler != nullptr) {
      // After an overflow the pass will be undone: nothing more steps (a non-finite gradient
      // would only make DistributedShampoo raise).
      if (!pass_overflow && !unscaler->unscale_ready(params)) pass_overflow = true;
      if (pass_overflow) {
        for (const auto& p : params) {
          if (entry_of.count(p.unsafeGetTensorImpl()) != 0) p.mutable_grad().reset();
        }
        return;
      }
    }
    std::unordered_map<size_t, std::vector<at::Tensor>> by_set;
    for (const auto& p : params) {
      const auto it = entry_of.find(p.unsafeGetTensorImpl());
      if (it != entry_of.end()) by_set[entries[it->second].set].push_back(p);
    }
    for (auto& [index, ready] : by_set) {
      auto& set = sets[index];
      // A phased optimizer's work in the pass's step, which close_pass ends; another steps
      // `ready` alone (the set's others are still accumulating, or not produced yet).
      detail::step_optimizer(*set.optimizer, set.capabilities, ready, detail::StepScope::kInPass,
                             nullptr);
      for (auto& p : ready) p.mutable_grad().reset();  // released right after its step
    }
  }

  void close_pass() {
    if (pass.stepping()) {
      bool overflowed = false;
      try {
        if (sync != nullptr) sync->synchronize();  // the remaining buckets step via the callback
        overflowed = unscaler != nullptr && unscaler->pass_overflowed(pass_overflow);
        // Every phased optimizer finishes (or, after an overflow anywhere, undoes) its step on
        // every rank (DistributedShampoo: its one AllGather), also if no gradient of its
        // parameters arrived here.
        for (auto& set : sets) detail::end_pass_on_every_rank(set.capabilities, overflowed);
      } catch (...) {
        abort_pass();
        throw;
      }
      if (!overflowed) ++steps;
    }
    pass.end();
    update_sync();
    write_state_entries();
  }
};

}  // namespace shampoo
