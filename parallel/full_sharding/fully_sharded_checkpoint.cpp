// Full sharding: world-size-independent checkpoints (rows and optimizer state per parameter, the
// groups, mid-accumulation gradients).
#include <ATen/core/grad_mode.h>

#include <sstream>

#include "parallel/checkpoints/distributed_checkpoint.h"
#include "parallel/full_sharding/fully_sharded_state.h"

namespace shampoo {

std::string FullyShardedDataParallel::State::param_key(size_t u, size_t i) {
  return "unit_" + std::to_string(u) + "/param_" + std::to_string(i);
}

std::vector<at::Tensor> FullyShardedDataParallel::State::shapes_of(const Unit& unit) {
  std::vector<at::Tensor> out;  // meta tensors: the shapes without the (released) values
  for (const auto& slot : unit.params) {
    out.push_back(at::empty(slot.sizes, at::TensorOptions().device(at::kMeta)));
  }
  return out;
}

void FullyShardedDataParallel::State::check_checkpointable() const {
  TORCH_CHECK(options.step_mode() == ShardedStepMode::kLossless, kWho,
              "checkpoints need step_mode kLossless: local shards keep optimizer state of row "
              "chunks, which depends on the world size");
}

void FullyShardedDataParallel::State::save_common(torch::serialize::OutputArchive& common) {
  check_checkpointable();
  wait_all();
  common.write("format", c10::IValue(detail::kFsdpCheckpointFormat));
  common.write("world", c10::IValue(static_cast<int64_t>(world)));
  common.write("num_units", c10::IValue(static_cast<int64_t>(units.size())));
  common.write("backward_passes", c10::IValue(pass.passes()));
  common.write("steps_taken", c10::IValue(steps));
  common.write("passes_since_step", c10::IValue(pass.passes_since_step()));
  for (size_t u = 0; u < units.size(); ++u) {
    torch::serialize::OutputArchive archive;
    archive.write("name", c10::IValue(units[u]->name));
    detail::write_param_shapes(archive, shapes_of(*units[u]));
    common.write("unit_" + std::to_string(u), archive);
  }
  save_groups(common);
}

/// optimizer()'s param groups: per group its options (what a scheduler set), its parameters
/// as (unit, index) and their step counts since they joined.
void FullyShardedDataParallel::State::save_groups(torch::serialize::OutputArchive& common) {
  torch::serialize::OutputArchive all;
  const auto& groups = facade->param_groups();
  all.write("num_groups", c10::IValue(static_cast<int64_t>(groups.size())));
  for (size_t g = 0; g < groups.size(); ++g) {
    torch::serialize::OutputArchive archive;
    torch::serialize::OutputArchive options;
    groups[g].options().serialize(options);
    archive.write("options", options);
    std::vector<int64_t> positions;
    std::vector<int64_t> counts;
    for (const auto& p : groups[g].params()) {
      const auto [u, i] = position_of(p);
      positions.push_back(static_cast<int64_t>(u));
      positions.push_back(static_cast<int64_t>(i));
      counts.push_back(steps - joined_at.at(impl_of(p)));
    }
    archive.write("positions", at::tensor(positions, at::kLong), /*is_buffer=*/true);
    archive.write("steps", at::tensor(counts, at::kLong), /*is_buffer=*/true);
    all.write("group_" + std::to_string(g), archive);
  }
  common.write("optimizer_groups", all);
}

/// What loading the groups installs (checked against this wrapper's groups first); nothing
/// for a checkpoint written before they were saved.
std::function<void()> FullyShardedDataParallel::State::prepare_groups(
    torch::serialize::InputArchive& common) {
  torch::serialize::InputArchive all;
  if (!common.try_read("optimizer_groups", all)) return [] {};
  const auto& groups = facade->param_groups();
  const int64_t saved = read_int(all, "num_groups");
  TORCH_CHECK(saved == static_cast<int64_t>(groups.size()), kWho, "checkpoint: optimizer() had ",
              saved, " param groups there, ", groups.size(), " here");
  auto options = std::make_shared<std::vector<std::unique_ptr<torch::optim::OptimizerOptions>>>();
  auto joined = std::make_shared<std::vector<std::pair<const c10::TensorImpl*, int64_t>>>();
  for (size_t g = 0; g < groups.size(); ++g) {
    torch::serialize::InputArchive archive;
    torch::serialize::InputArchive saved_options;
    at::Tensor positions;
    at::Tensor counts;
    TORCH_CHECK(all.try_read("group_" + std::to_string(g), archive) &&
                    archive.try_read("options", saved_options) &&
                    archive.try_read("positions", positions, /*is_buffer=*/true) &&
                    archive.try_read("steps", counts, /*is_buffer=*/true),
                kWho, "checkpoint: param group ", g, " of optimizer() is damaged");
    std::vector<int64_t> here;
    for (const auto& p : groups[g].params()) {
      const auto [u, i] = position_of(p);
      here.push_back(static_cast<int64_t>(u));
      here.push_back(static_cast<int64_t>(i));
    }
    TORCH_CHECK(at::equal(positions, at::tensor(here, at::kLong)), kWho, "checkpoint: param group ",
                g,
                " of optimizer() holds other parameters there than here (build the groups "
                "as the saving run did)");
    options->push_back(groups[g].options().clone());
    options->back()->serialize(saved_options);
    for (size_t k = 0; k < groups[g].params().size(); ++k) {
      joined->emplace_back(impl_of(groups[g].params()[k]), counts[k].item<int64_t>());
    }
  }
  std::weak_ptr<State> weak = shared_from_this();
  return [weak, options, joined] {
    auto self = weak.lock();
    if (!self) return;
    auto& groups = self->facade->param_groups();
    for (size_t g = 0; g < groups.size(); ++g) {
      groups[g].set_options(std::move((*options)[g]));
      // Copied into the optimizers at the next defined point.
      self->pushed[g].clear();
    }
    for (const auto& [impl, count] : *joined) self->joined_at[impl] = self->steps - count;
    self->write_state_entries();
  };
}

void FullyShardedDataParallel::State::save_pieces(PieceWriter& pieces) {
  check_checkpointable();
  wait_all();
  for (size_t u = 0; u < units.size(); ++u) {
    for (size_t i = 0; i < units[u]->params.size(); ++i) {
      const auto& slot = units[u]->params[i];
      // Split across replicas every replica saves its own state; the rows, replica 0.
      if (slot.valid_rows(rank) > 0 && replica == 0) {
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
  if (rank_optimizer) rank_optimizer->save_pieces(pieces, param_name());
}

/// A parameter's name in checkpoints: "unit_<u>/param_<i>".
ParamNames FullyShardedDataParallel::State::param_name() const {
  return [this](const at::Tensor& p) {
    const auto [u, i] = position_of(p);
    return param_key(u, i);
  };
}

int64_t FullyShardedDataParallel::State::read_int(torch::serialize::InputArchive& archive,
                                                  const std::string& key) {
  return detail::read_int_entry(archive, key, "FullyShardedDataParallel checkpoint");
}

/// Format 2 (one optimizer per rank, its state saved per parameter); the first format (one
/// optimizer per parameter, each saved whole) has no entry.
void FullyShardedDataParallel::State::check_format(torch::serialize::InputArchive& common) {
  c10::IValue format;
  TORCH_CHECK(common.try_read("format", format) && format.isInt(), kWho,
              "checkpoint: written by an earlier version of full sharding (one optimizer per "
              "parameter, saved whole); this version reads format ",
              detail::kFsdpCheckpointFormat,
              " only: resume that run with the version that wrote it, or "
              "start from a model saved with save_full_model");
  TORCH_CHECK(format.toInt() == detail::kFsdpCheckpointFormat, kWho, "checkpoint: format ",
              format.toInt(), ", this version reads format ", detail::kFsdpCheckpointFormat);
}

/// Checks that the checkpoint holds these units (a checkpoint of another model is an error
/// naming the first difference).
void FullyShardedDataParallel::State::check_units(torch::serialize::InputArchive& common) {
  const int64_t saved = read_int(common, "num_units");
  TORCH_CHECK(saved == static_cast<int64_t>(units.size()), kWho, "checkpoint: it holds ", saved,
              " units, this model has ", units.size(), " (a checkpoint of another model?)");
  for (size_t u = 0; u < units.size(); ++u) {
    torch::serialize::InputArchive archive;
    TORCH_CHECK(common.try_read("unit_" + std::to_string(u), archive), kWho,
                "checkpoint: no entry for unit ", u);
    c10::IValue name;
    TORCH_CHECK(archive.try_read("name", name) && name.isString(), kWho, "checkpoint: unit ", u,
                " has no name");
    TORCH_CHECK(name.toStringRef() == units[u]->name, kWho, "checkpoint: unit ", u, " is named '",
                name.toStringRef(), "' there and '", units[u]->name,
                "' here (a checkpoint of another model?)");
    detail::check_param_shapes(archive, shapes_of(*units[u]),
                               std::string(kWho) + "checkpoint: unit " + std::to_string(u) + " ('" +
                                   units[u]->name + "')");
  }
}

/// This rank's rows of parameter (u, i), from the chunks the ranks of the saving job wrote.
at::Tensor FullyShardedDataParallel::State::read_rows(size_t u, size_t i, int64_t saved_world,
                                                      PieceReader& pieces) {
  const auto& slot = unit(u).params[i];
  const int64_t valid = slot.valid_rows(rank);
  auto rows = at::empty({valid, slot.row_numel}, unit(u).options);
  const int64_t first = rank * slot.chunk_rows;
  const int64_t saved_chunk = (slot.rows + saved_world - 1) / saved_world;
  for (int64_t s = 0; s < saved_world; ++s) {
    const int64_t begin = s * saved_chunk;
    const int64_t end = std::min(slot.rows, begin + saved_chunk);
    const int64_t low = std::max(begin, first);
    const int64_t high = std::min(end, first + valid);
    if (low >= high) continue;
    const auto key = param_key(u, i) + "/rows_" + std::to_string(s);
    auto piece = pieces.read(key);
    at::Tensor saved;
    TORCH_CHECK(piece.try_read("rows", saved, /*is_buffer=*/true) &&
                    saved.numel() == (end - begin) * slot.row_numel,
                kWho, "checkpoint: piece ", key, " is damaged");
    rows.narrow(0, low - first, high - low)
        .copy_(saved.reshape({end - begin, slot.row_numel}).narrow(0, low - begin, high - low));
  }
  return rows.view(slot.shard_sizes(rank));
}

std::function<void()> FullyShardedDataParallel::State::prepare_load(
    torch::serialize::InputArchive& common, PieceReader& pieces) {
  check_checkpointable();
  wait_all();
  check_format(common);
  check_units(common);
  const int64_t saved_world = read_int(common, "world");
  const int64_t saved_passes = read_int(common, "backward_passes");
  const int64_t saved_steps = read_int(common, "steps_taken");
  const int64_t saved_since = read_int(common, "passes_since_step");
  std::vector<std::pair<at::Tensor, at::Tensor>> shards;  // (this rank's shard, its rows)
  std::vector<std::function<void()>> installs;
  std::vector<std::pair<ParamSlot*, at::Tensor>> accumulated;  // mid-accumulation gradients
  for (size_t u = 0; u < units.size(); ++u) {
    for (size_t i = 0; i < unit(u).params.size(); ++i) {
      auto& slot = unit(u).params[i];
      shards.emplace_back(slot.shard, read_rows(u, i, saved_world, pieces));
      const auto key = param_key(u, i) + "/accumulated";
      if (saved_since > 0 && steps_here(slot) && pieces.contains(key)) {
        auto piece = pieces.read(key);
        at::Tensor gradient;
        TORCH_CHECK(piece.try_read("gradient", gradient, /*is_buffer=*/true) &&
                        gradient.sizes() == at::IntArrayRef(slot.sizes),
                    kWho, "checkpoint: piece ", key, " is damaged");
        accumulated.emplace_back(&slot, gradient.to(unit(u).options));
      }
    }
  }
  if (rank_optimizer) installs.push_back(rank_optimizer->prepare_load(pieces, param_name()));
  auto install_groups = prepare_groups(common);
  std::weak_ptr<State> weak = shared_from_this();
  return [weak, shards, installs, saved_passes, saved_steps, saved_since, accumulated,
          install_groups] {
    at::NoGradGuard no_grad;
    for (const auto& [shard, rows] : shards) shard.copy_(rows);
    for (const auto& install : installs) install();
    if (auto self = weak.lock()) {
      self->install_progress(saved_passes, saved_steps, saved_since, accumulated);
    }
    install_groups();
  };
}

void FullyShardedDataParallel::State::install_progress(
    int64_t saved_passes, int64_t saved_steps, int64_t saved_since,
    const std::vector<std::pair<ParamSlot*, at::Tensor>>& accumulated) {
  pass.restore(saved_passes, saved_since);
  steps = saved_steps;
  for (auto& unit : units) {
    for (auto& slot : unit->params) slot.reduced = at::Tensor();
  }
  for (const auto& [slot, gradient] : accumulated) slot->reduced = gradient;
}

}  // namespace shampoo
