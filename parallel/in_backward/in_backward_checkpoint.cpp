// Optimizer-in-backward's checkpoints: torch::save of every optimizer, world-size-independent
// checkpoint directories (DistributedCheckpointable) and whole-run checkpoints by parameter name
// (PortableCheckpointable), both through InBackwardOptimizer::Checkpoint.
#include "parallel/in_backward/in_backward_checkpoint.h"

#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "parallel/in_backward/in_backward.h"
#include "parallel/optimizers/capabilities.h"

namespace shampoo {

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
  check_not_mid_accumulation(state_->pass.passes(), state_->pass.accumulation_steps(), "save");
  archive.write("num_optimizers", c10::IValue(static_cast<int64_t>(state_->sets.size())));
  archive.write("backward_passes", c10::IValue(state_->pass.passes()));
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
  state_->pass.restore(value.toInt(), value.toInt());
  archive.read("steps_taken", value);
  state_->steps = value.toInt();
  state_->update_sync();
  state_->write_state_entries();
}

namespace {

DistributedCheckpointable* as_checkpointable(const torch::optim::Optimizer& optimizer) {
  return detail::capabilities_of(optimizer).checkpointable;
}

std::string set_key(size_t i) { return "optimizer_" + std::to_string(i); }

}  // namespace

c10::intrusive_ptr<c10d::ProcessGroup> InBackwardOptimizer::Checkpoint::checkpoint_group() const {
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

void InBackwardOptimizer::Checkpoint::sync_for_checkpoint() const {
  for (const auto& set : state_->sets) {
    if (const auto* checkpointable = as_checkpointable(*set.optimizer)) {
      checkpointable->sync_for_checkpoint();
    }
  }
}

void InBackwardOptimizer::Checkpoint::save_common(torch::serialize::OutputArchive& common) const {
  common.write("num_optimizers", c10::IValue(static_cast<int64_t>(state_->sets.size())));
  common.write("backward_passes", c10::IValue(state_->pass.passes()));
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

void InBackwardOptimizer::Checkpoint::save_pieces(PieceWriter& pieces) const {
  check_not_mid_accumulation(state_->pass.passes(), state_->pass.accumulation_steps(),
                             "save_distributed_checkpoint");
  for (size_t i = 0; i < state_->sets.size(); ++i) {
    if (const auto* checkpointable = as_checkpointable(*state_->sets[i].optimizer)) {
      auto nested = pieces.nested(set_key(i) + "/");
      checkpointable->save_pieces(nested);
    }
  }
}

std::function<void()> InBackwardOptimizer::Checkpoint::prepare_load(
    torch::serialize::InputArchive& common, PieceReader& pieces) {
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
  return [state = state_, installs = std::move(installs), passes, steps] {
    for (const auto& install : installs) install();
    state->pass.restore(passes, passes);
    state->steps = steps;
    state->update_sync();
    state->write_state_entries();
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

std::vector<const torch::optim::OptimizerParamGroup*>
InBackwardOptimizer::Checkpoint::portable_groups() const {
  std::vector<const torch::optim::OptimizerParamGroup*> out;
  for (const auto& set : state_->sets) {
    std::unique_ptr<detail::ReplicatedPortable> adapter;
    const auto groups = portable_of(*set.optimizer, adapter).portable_groups();
    out.insert(out.end(), groups.begin(), groups.end());
  }
  return out;
}

int64_t InBackwardOptimizer::Checkpoint::portable_param_step(const at::Tensor& param) const {
  const auto it = state_->entry_of.find(param.unsafeGetTensorImpl());
  return it == state_->entry_of.end() ? -1 : state_->steps - state_->entries[it->second].joined;
}

bool InBackwardOptimizer::Checkpoint::portable_supported() const {
  for (const auto& set : state_->sets) {
    const auto* portable = as_portable(*set.optimizer);
    if (portable != nullptr ? !portable->portable_supported()
                            : !detail::has_param_states(*set.optimizer)) {
      return false;
    }
  }
  return true;
}

void InBackwardOptimizer::Checkpoint::save_portable_pieces(PieceWriter& pieces,
                                                           const PortableSave& save) const {
  check_not_mid_accumulation(state_->pass.passes(), state_->pass.accumulation_steps(),
                             "save_training_checkpoint");
  for (const auto& set : state_->sets) {
    std::unique_ptr<detail::ReplicatedPortable> adapter;
    portable_of(*set.optimizer, adapter).save_portable_pieces(pieces, save);
  }
}

void InBackwardOptimizer::Checkpoint::save_portable_layout(
    torch::serialize::OutputArchive& layout) const {
  layout.write("backward_passes", c10::IValue(state_->pass.passes()));
  layout.write("steps_taken", c10::IValue(state_->steps));
}

std::function<void()> InBackwardOptimizer::Checkpoint::prepare_portable_load(
    const PortableLoad& load) {
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
    part.group_options.assign(
        load.group_options.begin() + static_cast<std::ptrdiff_t>(first),
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
  return [state = state_, installs, passes, steps, joined] {
    for (const auto& install : installs) install();
    state->pass.restore(passes, passes);
    state->steps = steps;
    for (size_t i = 0; i < joined.size(); ++i) state->entries[i].joined = joined[i];
    state->update_sync();
    state->write_state_entries();
  };
}

DistributedCheckpointable& InBackwardOptimizer::checkpoint_delegate() const {
  TORCH_CHECK(checkpoint_ != nullptr, "InBackwardOptimizer: this object was moved from");
  return *checkpoint_;
}

PortableCheckpointable& InBackwardOptimizer::portable_delegate() const {
  TORCH_CHECK(checkpoint_ != nullptr, "InBackwardOptimizer: this object was moved from");
  return *checkpoint_;
}

}  // namespace shampoo
