#include "parallel/in_backward.h"

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <unordered_map>
#include <unordered_set>

#include "parallel/backward_pass.h"
#include "parallel/grad_ready_hooks.h"
#include "parallel/libtorch_optimizers.h"
#include "parallel/phased_backward_step.h"
#include "parallel/sharded_optimizer.h"

namespace shampoo {

struct InBackwardOptimizer::State : std::enable_shared_from_this<State> {
  struct Set {
    std::unique_ptr<torch::optim::Optimizer> optimizer;
    PhasedBackwardStep* phased = nullptr;  // when the optimizer steps in phases in backward
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
      if (const auto* owners = dynamic_cast<const ParameterOwners*>(sets[e.set].optimizer.get())) {
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
  int64_t accumulation_steps = 1;
  int64_t passes = 0;
  int64_t steps = 0;
  int no_step = 0;
  detail::BackwardPass pass;
  bool stepping = false;
  GradientSynchronizer* sync = nullptr;
  BackwardUnscaler* unscaler = nullptr;
  bool pass_overflow = false;  // a gradient of this pass was inf or NaN on this rank

  bool next_pass_steps() const { return no_step == 0 && (passes + 1) % accumulation_steps == 0; }

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
    for (auto& set : sets) {
      if (set.phased != nullptr && set.phased->backward_step_open()) {
        set.phased->abort_backward_step();
      }
    }
    pass.close();
    stepping = false;
    update_sync();
  }

  void open_pass() {
    // A pass still open from another backward: that one failed before its end callback ran
    // (an error in autograd or in a hook that is not ours). Undo it before this one starts.
    if (pass.abandoned()) abort_pass();
    // At the end of the whole backward pass: finish what is left and close the pass.
    std::weak_ptr<State> weak = shared_from_this();
    if (!pass.open([weak] {
          if (auto self = weak.lock()) self->close_pass();
        })) {
      return;
    }
    stepping = next_pass_steps();
    pass_overflow = false;
  }

  void on_grad_ready(size_t entry) {
    open_pass();
    if (!stepping || sync != nullptr) return;  // accumulating, or the synchronizer drives steps
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
      if (set.phased != nullptr) {
        if (!set.phased->backward_step_open()) set.phased->begin_backward_step();
        set.phased->step_parameters(ready);
      } else {
        // A torch::optim optimizer steps every parameter with a gradient: the set's others
        // (still accumulating, or not produced yet) are hidden meanwhile.
        detail::step_only(*set.optimizer, ready);
      }
      for (auto& p : ready) p.mutable_grad().reset();  // released right after its step
    }
  }

  void close_pass() {
    if (stepping) {
      bool overflowed = false;
      try {
        if (sync != nullptr) sync->synchronize();  // the remaining buckets step via the callback
        overflowed = unscaler != nullptr && unscaler->pass_overflowed(pass_overflow);
        // Every phased optimizer finishes (or, after an overflow anywhere, undoes) its step on
        // every rank (DistributedShampoo: its one AllGather), also if no gradient of its
        // parameters arrived here.
        for (auto& set : sets) {
          if (set.phased == nullptr) continue;
          if (!set.phased->backward_step_open()) set.phased->begin_backward_step();
          if (overflowed) {
            set.phased->abort_backward_step();
          } else {
            set.phased->finish_backward_step();
          }
        }
      } catch (...) {
        abort_pass();
        throw;
      }
      if (!overflowed) ++steps;
    }
    ++passes;
    pass.close();
    stepping = false;
    update_sync();
    write_state_entries();
  }
};

InBackwardOptimizer::InBackwardOptimizer()
    : torch::optim::Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                              std::make_unique<torch::optim::OptimizerOptions>()),
      state_(std::make_shared<State>()) {
  state_->state_entries = &torch::optim::Optimizer::state();
}

InBackwardOptimizer::~InBackwardOptimizer() {
  if (!state_) return;
  for (const auto& entry : state_->entries) {
    detail::remove_grad_ready_callback(entry.param, entry.hook);
  }
  for (auto& set : state_->sets) {
    if (set.phased != nullptr) set.phased->set_in_backward(false);
  }
  if (state_->sync != nullptr) state_->sync->set_bucket_ready_callback(nullptr);
}

InBackwardOptimizer::InBackwardOptimizer(InBackwardOptimizer&& other) noexcept
    : torch::optim::Optimizer(std::move(other)), state_(std::move(other.state_)) {
  if (state_) state_->state_entries = &torch::optim::Optimizer::state();
}

InBackwardOptimizer& InBackwardOptimizer::operator=(InBackwardOptimizer&& other) noexcept {
  torch::optim::Optimizer::operator=(std::move(other));
  state_ = std::move(other.state_);
  if (state_) state_->state_entries = &torch::optim::Optimizer::state();
  return *this;
}

torch::optim::Optimizer& InBackwardOptimizer::add(std::vector<torch::Tensor> params,
                                                  OptimizerFactory factory) {
  TORCH_CHECK(factory, "apply_optimizer_in_backward: the optimizer factory is empty");
  TORCH_CHECK(!params.empty(), "apply_optimizer_in_backward: no parameters given");
  std::unordered_set<const void*> seen;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    TORCH_CHECK(p.defined() && p.requires_grad(), "apply_optimizer_in_backward: parameter ", i,
                " does not require grad, so it would never step");
    TORCH_CHECK(p.is_leaf(), "apply_optimizer_in_backward: parameter ", i, " is not a leaf tensor");
    TORCH_CHECK(state_->entry_of.count(p.unsafeGetTensorImpl()) == 0 &&
                    seen.insert(p.unsafeGetTensorImpl()).second,
                "apply_optimizer_in_backward: parameter ", i,
                " is registered twice (a parameter may have one in-backward optimizer only)");
  }
  State::Set set;
  set.optimizer = factory(params);
  TORCH_CHECK(set.optimizer != nullptr, "apply_optimizer_in_backward: the factory returned null");
  set.phased = dynamic_cast<PhasedBackwardStep*>(set.optimizer.get());
  TORCH_CHECK(state_->unscaler == nullptr || set.phased != nullptr,
              "apply_optimizer_in_backward: a GradScaler is attached, and optimizer ",
              state_->sets.size(),
              " cannot undo a step (it is not one that steps in phases, such as "
              "DistributedShampoo): a later overflow in the same backward could not be skipped");
  if (set.phased != nullptr) set.phased->set_in_backward(true);
  set.params = params;
  const size_t set_index = state_->sets.size();
  state_->sets.push_back(std::move(set));
  std::weak_ptr<State> weak = state_;
  for (auto& p : params) {
    const size_t entry = state_->entries.size();
    State::Entry e;
    e.param = p;
    e.set = set_index;
    e.hook = detail::add_grad_ready_callback(p, [weak, entry](const at::Tensor&) {
      if (auto self = weak.lock()) self->on_grad_ready(entry);
    });
    e.joined = state_->steps;
    state_->entry_of[p.unsafeGetTensorImpl()] = entry;
    state_->entries.push_back(std::move(e));
  }
  state_->write_state_entries();
  return *state_->sets.back().optimizer;
}

torch::Tensor InBackwardOptimizer::step(LossClosure /*closure*/) {
  TORCH_CHECK(false,
              "InBackwardOptimizer::step(): the optimizers step during loss.backward() "
              "(apply_optimizer_in_backward); do not call step() by hand");
}

size_t InBackwardOptimizer::num_optimizers() const { return state_->sets.size(); }

torch::optim::Optimizer& InBackwardOptimizer::optimizer(size_t index) {
  TORCH_CHECK(index < state_->sets.size(), "InBackwardOptimizer::optimizer: index ", index,
              " out of range (", state_->sets.size(), " optimizers)");
  return *state_->sets[index].optimizer;
}

void InBackwardOptimizer::set_accumulation_steps(int64_t k) {
  TORCH_CHECK(k >= 1, "InBackwardOptimizer::set_accumulation_steps: got ", k, ", expected >= 1");
  TORCH_CHECK(!state_->pass.is_open(), "set_accumulation_steps during a backward pass");
  state_->accumulation_steps = k;
  state_->update_sync();
}

InBackwardOptimizer::NoStep::NoStep(InBackwardOptimizer& owner) : owner_(owner) {
  ++owner_.state_->no_step;
  owner_.state_->update_sync();
}

InBackwardOptimizer::NoStep::~NoStep() {
  --owner_.state_->no_step;
  owner_.state_->update_sync();
}

void InBackwardOptimizer::attach(GradientSynchronizer& sync) {
  state_->sync = &sync;
  std::weak_ptr<State> weak = state_;
  sync.set_bucket_ready_callback([weak](const std::vector<at::Tensor>& params) {
    if (auto self = weak.lock()) {
      self->open_pass();  // the synchronizer's hook may run before ours in this pass
      if (self->stepping) self->step_params_or_abort(params);
    }
  });
  state_->update_sync();
}

c10::intrusive_ptr<c10d::ProcessGroup> InBackwardOptimizer::owners_group() const {
  return state_->one_group(
      [](const torch::optim::Optimizer& optimizer) -> c10::intrusive_ptr<c10d::ProcessGroup> {
        const auto* owners = dynamic_cast<const ParameterOwners*>(&optimizer);
        return owners != nullptr ? owners->owners_group() : nullptr;
      },
      "shards its parameters over another process group than the ones before it; gradient "
      "sharding needs one process group");
}

std::optional<int> InBackwardOptimizer::owner_of(const at::Tensor& param) const {
  const auto it = state_->entry_of.find(param.unsafeGetTensorImpl());
  if (it == state_->entry_of.end()) return std::nullopt;
  const auto& set = state_->sets[state_->entries[it->second].set];
  const auto* owners = dynamic_cast<const ParameterOwners*>(set.optimizer.get());
  if (owners == nullptr) return ParameterOwners::kEveryRank;
  return owners->owner_of(param).value_or(ParameterOwners::kEveryRank);
}

std::vector<at::Tensor> InBackwardOptimizer::gradients_to_unscale(const char* caller) {
  TORCH_CHECK(false, caller, ": an InBackwardOptimizer steps during backward, so a scaler cannot "
              "unscale or skip its step afterwards; call scaler.attach(optimizer) once (each set "
              "of gradients is then unscaled before it steps) and scaler.update() after backward");
}

void InBackwardOptimizer::set_unscaler(BackwardUnscaler* unscaler) {
  TORCH_CHECK(!state_->pass.is_open(),
              "InBackwardOptimizer: a GradScaler is attached or detached "
              "during a backward pass; do it between iterations");
  if (unscaler != nullptr) {
    for (size_t i = 0; i < state_->sets.size(); ++i) {
      TORCH_CHECK(state_->sets[i].phased != nullptr,
                  "GradScaler with optimizer-in-backward: optimizer ", i,
                  " steps its parameters during backward and cannot undo those steps (a "
                  "LibTorch optimizer, or another that does not step in phases), so a gradient "
                  "that overflows later in the same backward could not skip the step. Use "
                  "DistributedShampoo in backward (its step can be undone), or the ordinary "
                  "step with scaler.step(optimizer)");
    }
  }
  state_->unscaler = unscaler;
}

int64_t InBackwardOptimizer::backward_passes() const { return state_->passes; }
int64_t InBackwardOptimizer::steps_taken() const { return state_->steps; }

namespace {

/// A save between the backward passes of one gradient accumulation would lose what the passes
/// accumulated (it lives in the parameters' gradients, which no optimizer checkpoint holds).
void check_not_mid_accumulation(int64_t passes, int64_t accumulation_steps, const char* function) {
  TORCH_CHECK(passes % accumulation_steps == 0, "InBackwardOptimizer::", function, ": ",
              passes % accumulation_steps, " of the ", accumulation_steps,
              " backward passes of a gradient accumulation ran since the last step; their "
              "gradients live in the parameters and would be lost to the checkpoint, so the "
              "resumed run would step on fewer micro-batches. Save after the accumulation's last "
              "backward pass (backward_passes() a multiple of ",
              accumulation_steps, ")");
}

}  // namespace

void InBackwardOptimizer::save(torch::serialize::OutputArchive& archive) const {
  check_not_mid_accumulation(state_->passes, state_->accumulation_steps, "save");
  archive.write("num_optimizers", c10::IValue(static_cast<int64_t>(state_->sets.size())));
  archive.write("backward_passes", c10::IValue(state_->passes));
  archive.write("steps_taken", c10::IValue(state_->steps));
  for (size_t i = 0; i < state_->sets.size(); ++i) {
    torch::serialize::OutputArchive inner;
    state_->sets[i].optimizer->save(inner);
    archive.write("optimizer_" + std::to_string(i), inner);
  }
}

void InBackwardOptimizer::load(torch::serialize::InputArchive& archive) {
  c10::IValue value;
  TORCH_CHECK(archive.try_read("num_optimizers", value) && value.isInt(),
              "InBackwardOptimizer::load: not a checkpoint of an InBackwardOptimizer");
  TORCH_CHECK(value.toInt() == static_cast<int64_t>(state_->sets.size()),
              "InBackwardOptimizer::load: the checkpoint holds ", value.toInt(),
              " optimizers, this one has ", state_->sets.size());
  for (size_t i = 0; i < state_->sets.size(); ++i) {
    torch::serialize::InputArchive inner;
    TORCH_CHECK(archive.try_read("optimizer_" + std::to_string(i), inner),
                "InBackwardOptimizer::load: no state for optimizer ", i);
    state_->sets[i].optimizer->load(inner);
  }
  archive.read("backward_passes", value);
  state_->passes = value.toInt();
  archive.read("steps_taken", value);
  state_->steps = value.toInt();
  state_->update_sync();
  state_->write_state_entries();
}

namespace {

DistributedCheckpointable* as_checkpointable(const torch::optim::Optimizer& optimizer) {
  return dynamic_cast<DistributedCheckpointable*>(const_cast<torch::optim::Optimizer*>(&optimizer));
}

std::string set_key(size_t i) { return "optimizer_" + std::to_string(i); }

}  // namespace

c10::intrusive_ptr<c10d::ProcessGroup> InBackwardOptimizer::checkpoint_group() const {
  auto group = state_->one_group(
      [](const torch::optim::Optimizer& optimizer) -> c10::intrusive_ptr<c10d::ProcessGroup> {
        const auto* inner = as_checkpointable(optimizer);
        return inner != nullptr ? inner->checkpoint_group() : nullptr;
      },
      "uses another process group than the ones before it; a checkpoint is saved and loaded "
      "over one process group");
  // LibTorch's optimizers alone under data parallelism: the synchronizer's ranks hold them
  // alike, and rank 0 of its group writes them (without a group every rank would write the
  // same files).
  if (!group && state_->sync != nullptr) group = state_->sync->process_group();
  return group;
}

void InBackwardOptimizer::sync_for_checkpoint() const {
  for (const auto& set : state_->sets) {
    if (const auto* checkpointable = as_checkpointable(*set.optimizer)) {
      checkpointable->sync_for_checkpoint();
    }
  }
}

void InBackwardOptimizer::save_common(torch::serialize::OutputArchive& common) const {
  common.write("num_optimizers", c10::IValue(static_cast<int64_t>(state_->sets.size())));
  common.write("backward_passes", c10::IValue(state_->passes));
  common.write("steps_taken", c10::IValue(state_->steps));
  for (size_t i = 0; i < state_->sets.size(); ++i) {
    const auto& set = state_->sets[i];
    torch::serialize::OutputArchive archive;
    detail::write_param_shapes(archive, set.params);
    torch::serialize::OutputArchive inner;
    if (const auto* checkpointable = as_checkpointable(*set.optimizer)) {
      archive.write("kind", c10::IValue(checkpointable->checkpoint_kind()));
      checkpointable->save_common(inner);
    } else {
      archive.write("kind", c10::IValue(std::string("replicated")));
      set.optimizer->save(inner);
    }
    archive.write("state", inner);
    common.write(set_key(i), archive);
  }
}

void InBackwardOptimizer::save_pieces(PieceWriter& pieces) const {
  check_not_mid_accumulation(state_->passes, state_->accumulation_steps,
                             "save_distributed_checkpoint");
  for (size_t i = 0; i < state_->sets.size(); ++i) {
    if (const auto* checkpointable = as_checkpointable(*state_->sets[i].optimizer)) {
      auto nested = pieces.nested(set_key(i) + "/");
      checkpointable->save_pieces(nested);
    }
  }
}

std::function<void()> InBackwardOptimizer::prepare_load(torch::serialize::InputArchive& common,
                                                        PieceReader& pieces) {
  c10::IValue value;
  TORCH_CHECK(common.try_read("num_optimizers", value) && value.isInt(),
              "InBackwardOptimizer checkpoint: no optimizer count");
  TORCH_CHECK(value.toInt() == static_cast<int64_t>(state_->sets.size()),
              "InBackwardOptimizer checkpoint: holds ", value.toInt(), " optimizers, this one has ",
              state_->sets.size());
  std::vector<std::function<void()>> installs;
  for (size_t i = 0; i < state_->sets.size(); ++i) {
    auto& set = state_->sets[i];
    torch::serialize::InputArchive archive;
    TORCH_CHECK(common.try_read(set_key(i), archive),
                "InBackwardOptimizer checkpoint: no entry for optimizer ", i);
    detail::check_param_shapes(archive, set.params,
                               "InBackwardOptimizer checkpoint: optimizer " + std::to_string(i));
    c10::IValue kind;
    archive.read("kind", kind);
    auto* checkpointable = as_checkpointable(*set.optimizer);
    const std::string here = checkpointable ? checkpointable->checkpoint_kind() : "replicated";
    TORCH_CHECK(kind.isString() && kind.toStringRef() == here,
                "InBackwardOptimizer checkpoint: optimizer ", i, " was a ",
                kind.isString() ? kind.toStringRef() : "?", ", here it is a ", here);
    auto inner = std::make_shared<torch::serialize::InputArchive>();
    TORCH_CHECK(archive.try_read("state", *inner), "InBackwardOptimizer checkpoint: optimizer ", i,
                " has no state");
    if (checkpointable != nullptr) {
      auto nested = pieces.nested(set_key(i) + "/");
      installs.push_back(checkpointable->prepare_load(*inner, nested));
    } else {
      // LibTorch's optimizers have no separate check; the shapes above were checked.
      installs.push_back([optimizer = set.optimizer.get(), inner] { optimizer->load(*inner); });
    }
  }
  common.read("backward_passes", value);
  const int64_t passes = value.toInt();
  common.read("steps_taken", value);
  const int64_t steps = value.toInt();
  return [this, installs = std::move(installs), passes, steps] {
    for (const auto& install : installs) install();
    state_->passes = passes;
    state_->steps = steps;
    state_->update_sync();
    state_->write_state_entries();
  };
}

namespace {

/// A set's optimizer as a PortableCheckpointable (LibTorch's through `adapter`).
PortableCheckpointable& portable_of(torch::optim::Optimizer& optimizer,
                                    std::unique_ptr<detail::ReplicatedPortable>& adapter) {
  if (auto* portable = as_portable(optimizer)) return *portable;
  adapter = std::make_unique<detail::ReplicatedPortable>(optimizer);
  return *adapter;
}

}  // namespace

std::vector<const torch::optim::OptimizerParamGroup*> InBackwardOptimizer::portable_groups()
    const {
  std::vector<const torch::optim::OptimizerParamGroup*> out;
  for (const auto& set : state_->sets) {
    std::unique_ptr<detail::ReplicatedPortable> adapter;
    const auto groups = portable_of(*set.optimizer, adapter).portable_groups();
    out.insert(out.end(), groups.begin(), groups.end());
  }
  return out;
}

int64_t InBackwardOptimizer::portable_param_step(const at::Tensor& param) const {
  const auto it = state_->entry_of.find(param.unsafeGetTensorImpl());
  return it == state_->entry_of.end() ? -1 : state_->steps - state_->entries[it->second].joined;
}

bool InBackwardOptimizer::portable_supported() const {
  for (const auto& set : state_->sets) {
    const auto* portable = as_portable(*set.optimizer);
    if (portable != nullptr ? !portable->portable_supported()
                            : !detail::has_param_states(*set.optimizer)) {
      return false;
    }
  }
  return true;
}

void InBackwardOptimizer::save_portable_pieces(PieceWriter& pieces,
                                               const PortableSave& save) const {
  check_not_mid_accumulation(state_->passes, state_->accumulation_steps,
                             "save_training_checkpoint");
  for (const auto& set : state_->sets) {
    std::unique_ptr<detail::ReplicatedPortable> adapter;
    portable_of(*set.optimizer, adapter).save_portable_pieces(pieces, save);
  }
}

void InBackwardOptimizer::save_portable_layout(torch::serialize::OutputArchive& layout) const {
  layout.write("backward_passes", c10::IValue(state_->passes));
  layout.write("steps_taken", c10::IValue(state_->steps));
}

std::function<void()> InBackwardOptimizer::prepare_portable_load(const PortableLoad& load) {
  std::vector<std::function<void()>> installs;
  size_t first = 0;
  for (auto& set : state_->sets) {
    auto adapter = std::make_shared<std::unique_ptr<detail::ReplicatedPortable>>();
    auto& portable = portable_of(*set.optimizer, *adapter);
    PortableLoad part = load;
    part.layout = nullptr;  // the wrapper's, not the set's
    const size_t count = portable.portable_groups().size();
    TORCH_CHECK(first + count <= load.group_options.size(),
                "InBackwardOptimizer checkpoint: options for ", load.group_options.size(),
                " param groups, its optimizers have more");
    part.group_options.assign(load.group_options.begin() + static_cast<std::ptrdiff_t>(first),
                              load.group_options.begin() + static_cast<std::ptrdiff_t>(first + count));
    first += count;
    auto install = portable.prepare_portable_load(part);
    installs.push_back([adapter, install] { install(); });
  }
  int64_t passes = 0;
  int64_t steps = load.steps_taken;
  c10::IValue value;
  if (load.layout && load.layout->try_read("backward_passes", value) && value.isInt()) {
    passes = value.toInt();
    if (load.layout->try_read("steps_taken", value) && value.isInt()) steps = value.toInt();
  }
  std::vector<int64_t> joined;
  for (const auto& entry : state_->entries) {
    const auto it = load.param_steps.find(load.names(entry.param));
    joined.push_back(it != load.param_steps.end() && it->second >= 0 ? steps - it->second : steps);
  }
  return [this, installs, passes, steps, joined] {
    for (const auto& install : installs) install();
    state_->passes = passes;
    state_->steps = steps;
    for (size_t i = 0; i < joined.size(); ++i) state_->entries[i].joined = joined[i];
    state_->update_sync();
    state_->write_state_entries();
  };
}

InBackwardOptimizer apply_optimizer_in_backward(std::vector<torch::Tensor> params,
                                                OptimizerFactory factory) {
  InBackwardOptimizer optimizer;
  optimizer.add(std::move(params), std::move(factory));
  return optimizer;
}

}  // namespace shampoo
