// Full sharding in whole-run checkpoints that any layout loads
// (parallel/optimizers/portable_checkpoint.h): the rows of every parameter as the model's row
// pieces, the owners' optimizer state by parameter name, optimizer()'s groups, and what only full
// sharding resumes (its counters, a gradient accumulation in progress).
#include <ATen/core/grad_mode.h>

#include "parallel/full_sharding/fully_sharded_checkpoint.h"

namespace shampoo::detail {
namespace {

std::string accumulated_key(const std::string& name) { return "fsdp/" + name + "/accumulated"; }

}  // namespace

int64_t FsdpCheckpoint::portable_param_step(const at::Tensor& param) const {
  const auto& s = state_;
  const auto it = s.slot_of.find(param.unsafeGetTensorImpl());
  if (it == s.slot_of.end()) return -1;
  const auto& slot = s.units[it->second.first]->params[it->second.second];
  return slot.in_a_group() ? s.steps - slot.joined_at : -1;
}

void FsdpCheckpoint::save_portable_pieces(PieceWriter& pieces, const PortableSave& save) const {
  auto& s = state_;
  check_checkpointable(s);
  s.wait_all();
  TORCH_INTERNAL_ASSERT(save.model_pieces != nullptr);
  // The replicas hold the same rows (replica 0 writes them) and, unless the state is split
  // across them, the same optimizer state.
  const bool first_replica = s.mesh.replica == 0;
  const bool writes_state = first_replica || s.mesh.split;
  const int rank = s.mesh.rank;
  for (const auto& unit : s.units) {
    for (const auto& slot : unit->params) {
      const auto name = save.names(slot.param);
      if (first_replica && slot.valid_rows(rank) > 0) {
        save.model_pieces->add(SavedModel::rows_key(name, rank),
                               SavedModel::rows_piece(slot.shard));
      }
      if (writes_state && slot.reduced.defined() && slot.steps_on(s.mesh)) {
        torch::serialize::OutputArchive reduced;
        reduced.write("gradient", slot.reduced.detach(), /*is_buffer=*/true);
        pieces.add(accumulated_key(name), std::move(reduced));
      }
    }
  }
  if (s.rank_optimizer && writes_state) s.rank_optimizer->save_pieces(pieces, save.names);
}

void FsdpCheckpoint::save_portable_layout(torch::serialize::OutputArchive& layout) const {
  const auto& s = state_;
  layout.write("backward_passes", c10::IValue(s.pass.passes()));
  layout.write("steps_taken", c10::IValue(s.steps));
  layout.write("passes_since_step", c10::IValue(s.pass.passes_since_step()));
}

namespace {

/// This rank's rows of every parameter from the checkpoint's model, checked against the units.
std::vector<std::pair<at::Tensor, at::Tensor>> portable_rows(FsdpState& s,
                                                             const PortableLoad& load) {
  std::vector<std::pair<at::Tensor, at::Tensor>> shards;  // (this rank's shard, its rows)
  const int rank = s.mesh.rank;
  for (const auto& unit : s.units) {
    for (const auto& slot : unit->params) {
      const auto name = load.names(slot.param);
      const auto& saved = load.model->entry(name);
      TORCH_CHECK(saved.sizes == slot.sizes && saved.dtype == unit->dtype, kFsdpWho,
                  "checkpoint: parameter ", name, " is ", at::IntArrayRef(saved.sizes), " (",
                  saved.dtype, ") there and ", at::IntArrayRef(slot.sizes), " (", unit->dtype,
                  ") here (a checkpoint of another model?)");
      const auto rows = load.model->rows(name, slot.first_row(rank), slot.valid_rows(rank));
      shards.emplace_back(slot.shard, rows.to(unit->options).view(slot.shard_sizes(rank)));
    }
  }
  return shards;
}

/// The reduced gradients of an accumulation in progress that this rank steps on.
std::vector<std::pair<ParamSlot*, at::Tensor>> portable_accumulated(FsdpState& s,
                                                                    const PortableLoad& load,
                                                                    int64_t passes_since) {
  std::vector<std::pair<ParamSlot*, at::Tensor>> accumulated;
  for (auto& unit : s.units) {
    for (auto& slot : unit->params) {
      const auto key = accumulated_key(load.names(slot.param));
      if (passes_since == 0 || !slot.steps_on(s.mesh) || !load.pieces->contains(key)) continue;
      auto piece = load.pieces->read(key);
      at::Tensor gradient;
      TORCH_CHECK(piece.try_read("gradient", gradient, /*is_buffer=*/true) &&
                      gradient.sizes() == at::IntArrayRef(slot.sizes),
                  kFsdpWho, "checkpoint: piece ", key, " is damaged");
      accumulated.emplace_back(&slot, gradient.to(unit->options));
    }
  }
  return accumulated;
}

}  // namespace

std::function<void()> FsdpCheckpoint::prepare_portable_load(const PortableLoad& load) {
  auto& s = state_;
  check_checkpointable(s);
  s.wait_all();
  const auto shards = portable_rows(s, load);
  const auto& groups = s.groups.optimizer().param_groups();
  TORCH_CHECK(load.group_options.size() == groups.size(), kFsdpWho, "checkpoint: options for ",
              load.group_options.size(), " param groups, optimizer() has ", groups.size());
  auto options = std::make_shared<std::vector<std::unique_ptr<torch::optim::OptimizerOptions>>>();
  for (size_t g = 0; g < groups.size(); ++g) {
    options->push_back(read_options(groups[g], *load.group_options[g]));
  }
  int64_t saved_steps = load.steps_taken;
  int64_t saved_passes = load.steps_taken;
  int64_t saved_since = 0;
  if (load.layout) {
    saved_passes = read_fsdp_int(*load.layout, "backward_passes");
    saved_steps = read_fsdp_int(*load.layout, "steps_taken");
    saved_since = read_fsdp_int(*load.layout, "passes_since_step");
  }
  std::vector<std::pair<ParamSlot*, int64_t>> joined;
  for (const auto& group : groups) {
    for (const auto& p : group.params()) {
      const auto it = load.param_steps.find(load.names(p));
      const int64_t count = it != load.param_steps.end() && it->second >= 0 ? it->second : 0;
      joined.emplace_back(&s.slot_for(p), saved_steps - count);
    }
  }
  const auto accumulated = portable_accumulated(s, load, saved_since);
  std::function<void()> install_states = [] {};
  if (s.rank_optimizer) install_states = s.rank_optimizer->prepare_load(*load.pieces, load.names);
  std::weak_ptr<FsdpState> weak = s.shared_from_this();
  return [weak, shards, options, joined, saved_steps, saved_passes, saved_since, accumulated,
          install_states] {
    at::NoGradGuard no_grad;
    for (const auto& [shard, rows] : shards) shard.copy_(rows);
    install_states();
    auto self = weak.lock();
    if (!self) return;
    install_fsdp_progress(*self, saved_passes, saved_steps, saved_since, accumulated);
    self->groups.install_options(*options);
    for (const auto& [slot, at] : joined) slot->joined_at = at;
    self->groups.write_state_entries();
  };
}

std::vector<const torch::optim::OptimizerParamGroup*> FsdpCheckpoint::portable_groups() const {
  return groups_of(state_.groups.optimizer());
}

int64_t FsdpCheckpoint::portable_row_pieces() const { return state_.mesh.world; }

std::vector<int64_t> FsdpCheckpoint::portable_full_sizes(const at::Tensor& param) const {
  const auto it = state_.slot_of.find(param.unsafeGetTensorImpl());
  if (it == state_.slot_of.end()) return param.sizes().vec();
  return state_.units[it->second.first]->params[it->second.second].sizes;
}

bool FsdpCheckpoint::portable_between_steps() const { return state_.pass.passes_since_step() == 0; }

}  // namespace shampoo::detail

namespace shampoo {

PortableCheckpointable& FullyShardedOptimizer::portable_delegate() const { return owner_; }

}  // namespace shampoo
