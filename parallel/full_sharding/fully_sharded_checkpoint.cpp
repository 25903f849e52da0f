// Full sharding: world-size-independent checkpoints (rows and optimizer state per parameter, the
// groups, mid-accumulation gradients).
#include "parallel/full_sharding/fully_sharded_checkpoint.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <sstream>

#include "parallel/checkpoints/distributed_checkpoint.h"
#include "parallel/communication/collectives.h"

namespace shampoo::detail {
namespace {

std::string param_key(size_t u, size_t i) {
  return "unit_" + std::to_string(u) + "/param_" + std::to_string(i);
}

/// A parameter's name in checkpoints: "unit_<u>/param_<i>".
ParamNames param_name(const FsdpState& s) {
  return [&s](const at::Tensor& p) {
    const auto [u, i] = s.position_of(p);
    return param_key(u, i);
  };
}

/// optimizer()'s param groups: per group its options (what a scheduler set), its parameters
/// as (unit, index) and their step counts since they joined.
void save_groups(FsdpState& s, torch::serialize::OutputArchive& common) {
  torch::serialize::OutputArchive all;
  const auto& groups = s.groups.optimizer().param_groups();
  all.write("num_groups", c10::IValue(static_cast<int64_t>(groups.size())));
  for (size_t g = 0; g < groups.size(); ++g) {
    torch::serialize::OutputArchive archive;
    torch::serialize::OutputArchive options;
    groups[g].options().serialize(options);
    archive.write("options", options);
    std::vector<int64_t> positions;
    std::vector<int64_t> counts;
    for (const auto& p : groups[g].params()) {
      const auto [u, i] = s.position_of(p);
      positions.push_back(static_cast<int64_t>(u));
      positions.push_back(static_cast<int64_t>(i));
      counts.push_back(s.steps - s.unit(u).params[i].joined_at);
    }
    archive.write("positions", at::tensor(positions, at::kLong), /*is_buffer=*/true);
    archive.write("steps", at::tensor(counts, at::kLong), /*is_buffer=*/true);
    all.write("group_" + std::to_string(g), archive);
  }
  common.write("optimizer_groups", all);
}

}  // namespace

int64_t read_fsdp_int(torch::serialize::InputArchive& archive, const std::string& key) {
  return read_int_entry(archive, key, "FullyShardedDataParallel checkpoint");
}

void check_checkpointable(const FsdpState& s) {
  TORCH_CHECK(s.options.step_mode() == ShardedStepMode::kLossless, kFsdpWho,
              "checkpoints need step_mode kLossless: local shards keep optimizer state of row "
              "chunks, which depends on the world size");
}

void FsdpCheckpoint::save_common(torch::serialize::OutputArchive& common) const {
  auto& s = state_;
  check_checkpointable(s);
  s.wait_all();
  common.write("format", c10::IValue(kFsdpCheckpointFormat));
  common.write("world", c10::IValue(static_cast<int64_t>(s.mesh.world)));
  common.write("num_units", c10::IValue(static_cast<int64_t>(s.units.size())));
  common.write("backward_passes", c10::IValue(s.pass.passes()));
  common.write("steps_taken", c10::IValue(s.steps));
  common.write("passes_since_step", c10::IValue(s.pass.passes_since_step()));
  for (size_t u = 0; u < s.units.size(); ++u) {
    torch::serialize::OutputArchive archive;
    archive.write("name", c10::IValue(s.units[u]->name));
    write_param_shapes(archive, s.units[u]->shapes());
    common.write("unit_" + std::to_string(u), archive);
  }
  save_groups(s, common);
}

namespace {

/// What loading the groups installs (checked against this wrapper's groups first); nothing
/// for a checkpoint written before they were saved.
std::function<void()> prepare_groups(FsdpState& s, torch::serialize::InputArchive& common) {
  torch::serialize::InputArchive all;
  if (!common.try_read("optimizer_groups", all)) return [] {};
  const auto& groups = s.groups.optimizer().param_groups();
  const int64_t saved = read_fsdp_int(all, "num_groups");
  TORCH_CHECK(saved == static_cast<int64_t>(groups.size()), kFsdpWho,
              "checkpoint: optimizer() had ", saved, " param groups there, ", groups.size(),
              " here");
  auto options = std::make_shared<std::vector<std::unique_ptr<torch::optim::OptimizerOptions>>>();
  auto joined = std::make_shared<std::vector<std::pair<ParamSlot*, int64_t>>>();
  for (size_t g = 0; g < groups.size(); ++g) {
    torch::serialize::InputArchive archive;
    torch::serialize::InputArchive saved_options;
    at::Tensor positions;
    at::Tensor counts;
    TORCH_CHECK(all.try_read("group_" + std::to_string(g), archive) &&
                    archive.try_read("options", saved_options) &&
                    archive.try_read("positions", positions, /*is_buffer=*/true) &&
                    archive.try_read("steps", counts, /*is_buffer=*/true),
                kFsdpWho, "checkpoint: param group ", g, " of optimizer() is damaged");
    std::vector<int64_t> here;
    for (const auto& p : groups[g].params()) {
      const auto [u, i] = s.position_of(p);
      here.push_back(static_cast<int64_t>(u));
      here.push_back(static_cast<int64_t>(i));
    }
    TORCH_CHECK(at::equal(positions, at::tensor(here, at::kLong)), kFsdpWho,
                "checkpoint: param group ", g,
                " of optimizer() holds other parameters there than here (build the groups "
                "as the saving run did)");
    options->push_back(groups[g].options().clone());
    options->back()->serialize(saved_options);
    for (size_t k = 0; k < groups[g].params().size(); ++k) {
      joined->emplace_back(&s.slot_for(groups[g].params()[k]), counts[k].item<int64_t>());
    }
  }
  std::weak_ptr<FsdpState> weak = s.shared_from_this();
  return [weak, options, joined] {
    auto self = weak.lock();
    if (!self) return;
    self->groups.install_options(*options);
    for (const auto& [slot, count] : *joined) slot->joined_at = self->steps - count;
    self->groups.write_state_entries();
  };
}

/// Format 2 (one optimizer per rank, its state saved per parameter); the first format (one
/// optimizer per parameter, each saved whole) has no entry.
void check_format(torch::serialize::InputArchive& common) {
  c10::IValue format;
  TORCH_CHECK(common.try_read("format", format) && format.isInt(), kFsdpWho,
              "checkpoint: written by an earlier version of full sharding (one optimizer per "
              "parameter, saved whole); this version reads format ",
              kFsdpCheckpointFormat,
              " only: resume that run with the version that wrote it, or "
              "start from a model saved with save_full_model");
  TORCH_CHECK(format.toInt() == kFsdpCheckpointFormat, kFsdpWho, "checkpoint: format ",
              format.toInt(), ", this version reads format ", kFsdpCheckpointFormat);
}

/// Checks that the checkpoint holds these units (a checkpoint of another model is an error
/// naming the first difference).
void check_units(FsdpState& s, torch::serialize::InputArchive& common) {
  const int64_t saved = read_fsdp_int(common, "num_units");
  TORCH_CHECK(saved == static_cast<int64_t>(s.units.size()), kFsdpWho, "checkpoint: it holds ",
              saved, " units, this model has ", s.units.size(),
              " (a checkpoint of another model?)");
  for (size_t u = 0; u < s.units.size(); ++u) {
    const auto& unit = *s.units[u];
    torch::serialize::InputArchive archive;
    TORCH_CHECK(common.try_read("unit_" + std::to_string(u), archive), kFsdpWho,
                "checkpoint: no entry for unit ", u);
    c10::IValue name;
    TORCH_CHECK(archive.try_read("name", name) && name.isString(), kFsdpWho, "checkpoint: unit ", u,
                " has no name");
    TORCH_CHECK(name.toStringRef() == unit.name, kFsdpWho, "checkpoint: unit ", u, " is named '",
                name.toStringRef(), "' there and '", unit.name,
                "' here (a checkpoint of another model?)");
    check_param_shapes(
        archive, unit.shapes(),
        std::string(kFsdpWho) + "checkpoint: unit " + std::to_string(u) + " ('" + unit.name + "')");
  }
}

/// This rank's rows of parameter (u, i), from the chunks the ranks of the saving job wrote.
at::Tensor read_rows(FsdpState& s, size_t u, size_t i, int64_t saved_world, PieceReader& pieces) {
  const auto& slot = s.unit(u).params[i];
  const int rank = s.mesh.rank;
  const int64_t valid = slot.valid_rows(rank);
  auto rows = at::empty({valid, slot.row_numel}, s.unit(u).options);
  const int64_t first = rank * slot.chunk_rows;
  const int64_t saved_chunk = (slot.rows + saved_world - 1) / saved_world;
  for (int64_t w = 0; w < saved_world; ++w) {
    const int64_t begin = w * saved_chunk;
    const int64_t end = std::min(slot.rows, begin + saved_chunk);
    const int64_t low = std::max(begin, first);
    const int64_t high = std::min(end, first + valid);
    if (low >= high) continue;
    const auto key = param_key(u, i) + "/rows_" + std::to_string(w);
    auto piece = pieces.read(key);
    at::Tensor saved;
    TORCH_CHECK(piece.try_read("rows", saved, /*is_buffer=*/true) &&
                    saved.numel() == (end - begin) * slot.row_numel,
                kFsdpWho, "checkpoint: piece ", key, " is damaged");
    rows.narrow(0, low - first, high - low)
        .copy_(saved.reshape({end - begin, slot.row_numel}).narrow(0, low - begin, high - low));
  }
  return rows.view(slot.shard_sizes(rank));
}

}  // namespace

void FsdpCheckpoint::save_pieces(PieceWriter& pieces) const {
  auto& s = state_;
  check_checkpointable(s);
  s.wait_all();
  const int rank = s.mesh.rank;
  for (size_t u = 0; u < s.units.size(); ++u) {
    for (size_t i = 0; i < s.units[u]->params.size(); ++i) {
      const auto& slot = s.units[u]->params[i];
      // Split across replicas every replica saves its own state; the rows, replica 0.
      if (slot.valid_rows(rank) > 0 && s.mesh.replica == 0) {
        torch::serialize::OutputArchive rows;
        rows.write("rows", slot.shard.detach(), /*is_buffer=*/true);
        pieces.add(param_key(u, i) + "/rows_" + std::to_string(rank), std::move(rows));
      }
      if (slot.reduced.defined() && slot.owner == rank) {
        // In the middle of a gradient accumulation: what was accumulated, so that the
        // resumed run steps on the same sum.
        torch::serialize::OutputArchive reduced;
        reduced.write("gradient", slot.reduced.detach(), /*is_buffer=*/true);
        pieces.add(param_key(u, i) + "/accumulated", std::move(reduced));
      }
    }
  }
  if (s.rank_optimizer) s.rank_optimizer->save_pieces(pieces, param_name(s));
}

std::function<void()> FsdpCheckpoint::prepare_load(torch::serialize::InputArchive& common,
                                                   PieceReader& pieces) {
  auto& s = state_;
  check_checkpointable(s);
  s.wait_all();
  check_format(common);
  check_units(s, common);
  const int64_t saved_world = read_fsdp_int(common, "world");
  const int64_t saved_passes = read_fsdp_int(common, "backward_passes");
  const int64_t saved_steps = read_fsdp_int(common, "steps_taken");
  const int64_t saved_since = read_fsdp_int(common, "passes_since_step");
  std::vector<std::pair<at::Tensor, at::Tensor>> shards;  // (this rank's shard, its rows)
  std::vector<std::function<void()>> installs;
  std::vector<std::pair<ParamSlot*, at::Tensor>> accumulated;  // mid-accumulation gradients
  for (size_t u = 0; u < s.units.size(); ++u) {
    for (size_t i = 0; i < s.unit(u).params.size(); ++i) {
      auto& slot = s.unit(u).params[i];
      shards.emplace_back(slot.shard, read_rows(s, u, i, saved_world, pieces));
      const auto key = param_key(u, i) + "/accumulated";
      if (saved_since > 0 && slot.steps_on(s.mesh) && pieces.contains(key)) {
        auto piece = pieces.read(key);
        at::Tensor gradient;
        TORCH_CHECK(piece.try_read("gradient", gradient, /*is_buffer=*/true) &&
                        gradient.sizes() == at::IntArrayRef(slot.sizes),
                    kFsdpWho, "checkpoint: piece ", key, " is damaged");
        accumulated.emplace_back(&slot, gradient.to(s.unit(u).options));
      }
    }
  }
  if (s.rank_optimizer) installs.push_back(s.rank_optimizer->prepare_load(pieces, param_name(s)));
  auto install_groups = prepare_groups(s, common);
  std::weak_ptr<FsdpState> weak = s.shared_from_this();
  return [weak, shards, installs, saved_passes, saved_steps, saved_since, accumulated,
          install_groups] {
    at::NoGradGuard no_grad;
    for (const auto& [shard, rows] : shards) shard.copy_(rows);
    for (const auto& install : installs) install();
    if (auto self = weak.lock()) {
      install_fsdp_progress(*self, saved_passes, saved_steps, saved_since, accumulated);
    }
    install_groups();
  };
}

void install_fsdp_progress(FsdpState& s, int64_t saved_passes, int64_t saved_steps,
                           int64_t saved_since,
                           const std::vector<std::pair<ParamSlot*, at::Tensor>>& accumulated) {
  s.pass.restore(saved_passes, saved_since);
  s.steps = saved_steps;
  for (auto& unit : s.units) {
    for (auto& slot : unit->params) slot.reduced = at::Tensor();
  }
  for (const auto& [slot, gradient] : accumulated) slot->reduced = gradient;
}

c10::intrusive_ptr<c10d::ProcessGroup> FsdpCheckpoint::checkpoint_group() const {
  return state_.mesh.group;
}

void FsdpCheckpoint::sync_for_checkpoint() const {
  auto& s = state_;
  s.wait_all();
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  s.groups.sync();
  // Options changed since the last step (a scheduler's step() before the save) go into the
  // parameters' optimizers now, as they would at the next step: the checkpoint then holds the
  // options the next step uses, in both places.
  s.groups.push_options();
}

int FsdpCheckpoint::checkpoint_replicas() const { return state_.mesh.replicas; }

int FsdpCheckpoint::checkpoint_replica() const { return state_.mesh.replica; }

bool FsdpCheckpoint::every_replica_writes() const { return state_.mesh.split; }

bool FsdpCheckpoint::agree_across_replicas(bool ok) const {
  if (state_.mesh.replicas == 1) return ok;
  const auto all = gather_int64(*state_.mesh.replica_group, {ok ? 1 : 0});
  return std::all_of(all.begin(), all.end(), [](const auto& v) { return v[0] == 1; });
}

}  // namespace shampoo::detail
