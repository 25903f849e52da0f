// Full sharding in whole-run checkpoints that any layout loads
// (parallel/optimizers/portable_checkpoint.h): the rows of every parameter as the model's row
// pieces, the owners' optimizer state by parameter name, optimizer()'s groups, and what only full
// sharding resumes (its counters, a gradient accumulation in progress).
#include <ATen/core/grad_mode.h>

#include "parallel/full_sharding/fully_sharded_state.h"

namespace shampoo {
namespace {

std::string accumulated_key(const std::string& name) { return "fsdp/" + name + "/accumulated"; }

}  // namespace

int64_t FullyShardedDataParallel::State::portable_param_step(const at::Tensor& param) const {
  const auto it = joined_at.find(impl_of(param));
  return it == joined_at.end() ? -1 : steps - it->second;
}

void FullyShardedDataParallel::State::save_portable_pieces(PieceWriter& pieces,
                                                           const PortableSave& save) {
  check_checkpointable();
  wait_all();
  TORCH_INTERNAL_ASSERT(save.model_pieces != nullptr);
  // The replicas hold the same rows (replica 0 writes them) and, unless the state is split
  // across them, the same optimizer state.
  const bool writes_state = replica == 0 || split();
  for (const auto& unit : units) {
    for (const auto& slot : unit->params) {
      const auto name = save.names(slot.param);
      if (replica == 0 && slot.valid_rows(rank) > 0) {
        save.model_pieces->add(SavedModel::rows_key(name, rank),
                               SavedModel::rows_piece(slot.shard));
      }
      if (writes_state && slot.reduced.defined() && steps_here(slot)) {
        torch::serialize::OutputArchive reduced;
        reduced.write("gradient", slot.reduced.detach(), /*is_buffer=*/true);
        pieces.add(accumulated_key(name), std::move(reduced));
      }
    }
  }
  if (rank_optimizer && writes_state) rank_optimizer->save_pieces(pieces, save.names);
}

void FullyShardedDataParallel::State::save_portable_layout(
    torch::serialize::OutputArchive& layout) const {
  layout.write("backward_passes", c10::IValue(pass.passes()));
  layout.write("steps_taken", c10::IValue(steps));
  layout.write("passes_since_step", c10::IValue(pass.passes_since_step()));
}

std::vector<std::pair<at::Tensor, at::Tensor>> FullyShardedDataParallel::State::portable_rows(
    const PortableLoad& load) {
  std::vector<std::pair<at::Tensor, at::Tensor>> shards;  // (this rank's shard, its rows)
  for (const auto& unit : units) {
    for (const auto& slot : unit->params) {
      const auto name = load.names(slot.param);
      const auto& saved = load.model->entry(name);
      TORCH_CHECK(saved.sizes == slot.sizes && saved.dtype == unit->dtype, kWho,
                  "checkpoint: parameter ", name, " is ", at::IntArrayRef(saved.sizes), " (",
                  saved.dtype, ") there and ", at::IntArrayRef(slot.sizes), " (", unit->dtype,
                  ") here (a checkpoint of another model?)");
      const auto rows = load.model->rows(name, slot.first_row(rank), slot.valid_rows(rank));
      shards.emplace_back(slot.shard, rows.to(unit->options).view(slot.shard_sizes(rank)));
    }
  }
  return shards;
}

std::vector<std::pair<detail::ParamSlot*, at::Tensor>>
FullyShardedDataParallel::State::portable_accumulated(const PortableLoad& load,
                                                      int64_t passes_since) {
  std::vector<std::pair<ParamSlot*, at::Tensor>> accumulated;
  for (auto& unit : units) {
    for (auto& slot : unit->params) {
      const auto key = accumulated_key(load.names(slot.param));
      if (passes_since == 0 || !steps_here(slot) || !load.pieces->contains(key)) continue;
      auto piece = load.pieces->read(key);
      at::Tensor gradient;
      TORCH_CHECK(piece.try_read("gradient", gradient, /*is_buffer=*/true) &&
                      gradient.sizes() == at::IntArrayRef(slot.sizes),
                  kWho, "checkpoint: piece ", key, " is damaged");
      accumulated.emplace_back(&slot, gradient.to(unit->options));
    }
  }
  return accumulated;
}

std::function<void()> FullyShardedDataParallel::State::prepare_portable_load(
    const PortableLoad& load) {
  check_checkpointable();
  wait_all();
  const auto shards = portable_rows(load);
  const auto& groups = facade->param_groups();
  TORCH_CHECK(load.group_options.size() == groups.size(), kWho, "checkpoint: options for ",
              load.group_options.size(), " param groups, optimizer() has ", groups.size());
  auto options = std::make_shared<std::vector<std::unique_ptr<torch::optim::OptimizerOptions>>>();
  for (size_t g = 0; g < groups.size(); ++g) {
    options->push_back(detail::read_options(groups[g], *load.group_options[g]));
  }
  int64_t saved_steps = load.steps_taken;
  int64_t saved_passes = load.steps_taken;
  int64_t saved_since = 0;
  if (load.layout) {
    saved_passes = read_int(*load.layout, "backward_passes");
    saved_steps = read_int(*load.layout, "steps_taken");
    saved_since = read_int(*load.layout, "passes_since_step");
  }
  std::vector<std::pair<const c10::TensorImpl*, int64_t>> joined;
  for (const auto& group : groups) {
    for (const auto& p : group.params()) {
      const auto it = load.param_steps.find(load.names(p));
      const int64_t count = it != load.param_steps.end() && it->second >= 0 ? it->second : 0;
      joined.emplace_back(impl_of(p), saved_steps - count);
    }
  }
  const auto accumulated = portable_accumulated(load, saved_since);
  std::function<void()> install_states = [] {};
  if (rank_optimizer) install_states = rank_optimizer->prepare_load(*load.pieces, load.names);
  std::weak_ptr<State> weak = shared_from_this();
  return [weak, shards, options, joined, saved_steps, saved_passes, saved_since, accumulated,
          install_states] {
    at::NoGradGuard no_grad;
    for (const auto& [shard, rows] : shards) shard.copy_(rows);
    install_states();
    auto self = weak.lock();
    if (!self) return;
    self->install_progress(saved_passes, saved_steps, saved_since, accumulated);
    auto& groups = self->facade->param_groups();
    for (size_t g = 0; g < groups.size(); ++g) {
      groups[g].set_options(std::move((*options)[g]));
      self->pushed[g].clear();  // copied into the optimizers at the next defined point
    }
    for (const auto& [impl, at] : joined) self->joined_at[impl] = at;
    self->write_state_entries();
  };
}

// ---- the public faces ----

std::vector<const torch::optim::OptimizerParamGroup*> FullyShardedDataParallel::portable_groups()
    const {
  return detail::groups_of(*state_->facade);
}

int64_t FullyShardedDataParallel::portable_param_step(const at::Tensor& param) const {
  return state_->portable_param_step(param);
}

int64_t FullyShardedDataParallel::portable_row_pieces() const { return state_->world; }

std::vector<int64_t> FullyShardedDataParallel::portable_full_sizes(const at::Tensor& param) const {
  const auto it = state_->slot_of.find(State::impl_of(param));
  if (it == state_->slot_of.end()) return param.sizes().vec();
  return state_->units[it->second.first]->params[it->second.second].sizes;
}

bool FullyShardedDataParallel::portable_between_steps() const {
  return state_->pass.passes_since_step() == 0;
}

void FullyShardedDataParallel::save_portable_pieces(PieceWriter& pieces,
                                                    const PortableSave& save) const {
  state_->save_portable_pieces(pieces, save);
}

void FullyShardedDataParallel::save_portable_layout(torch::serialize::OutputArchive& layout) const {
  state_->save_portable_layout(layout);
}

std::function<void()> FullyShardedDataParallel::prepare_portable_load(const PortableLoad& load) {
  return state_->prepare_portable_load(load);
}

PortableCheckpointable& FullyShardedOptimizer::portable_delegate() const { return owner_; }

}  // namespace shampoo
