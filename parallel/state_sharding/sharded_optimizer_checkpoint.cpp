// ShardedOptimizer's checkpoints: its per-parameter state record, torch::save / torch::load of a
// world (save, load), world-size-independent checkpoint directories (DistributedCheckpointable:
// common entries, one piece per owned parameter) and whole-run checkpoints by parameter name
// (portable_checkpoint.h). The class and its step are in sharded_optimizer.cpp.
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "parallel/communication/collectives.h"
#include "parallel/communication/ownership_plan.h"
#include "parallel/communication/process_group.h"
#include "parallel/optimizers/libtorch_optimizers.h"
#include "parallel/optimizers/local_optimizer.h"
#include "parallel/state_sharding/sharded_optimizer.h"

namespace shampoo {
namespace {

/// The local optimizer's type name; an error when its per-parameter state type is unknown.
std::string local_type(const torch::optim::Optimizer& local) {
  auto name = detail::libtorch_optimizer_name(local);
  TORCH_CHECK(!name.empty(),
              "ShardedOptimizer: world-size-independent checkpoints need the factory to make one "
              "of LibTorch's SGD, Adam, AdamW, Adagrad or RMSprop (this one made another type, "
              "whose per-parameter state cannot be saved on its own); torch::save works at one "
              "world size");
  return name;
}

int64_t read_int(torch::serialize::InputArchive& archive, const std::string& key) {
  return detail::read_int_entry(archive, key, "ShardedOptimizer checkpoint");
}

}  // namespace

void ShardedParamState::serialize(torch::serialize::OutputArchive& archive) const {
  archive.write("step", c10::IValue(step()));
  archive.write("owner", c10::IValue(owner()));
}

void ShardedParamState::serialize(torch::serialize::InputArchive& archive) {
  step(read_int(archive, "step"));
  owner(read_int(archive, "owner"));
}
void ShardedOptimizer::sync_before_save() const {
  // What was appended through the base class and options set since the last step are saved too.
  auto& self = const_cast<ShardedOptimizer&>(*this);
  self.register_added_params();
  self.push_options_to_local();
}

void ShardedOptimizer::save(torch::serialize::OutputArchive& archive) const {
  sync_before_save();
  archive.write("world_size", c10::IValue(static_cast<int64_t>(group_->getSize())));
  archive.write("rank", c10::IValue(static_cast<int64_t>(group_->getRank())));
  archive.write("num_params", c10::IValue(static_cast<int64_t>(params_.size())));
  archive.write("steps", c10::IValue(steps_));
  archive.write("param_steps", param_steps(), /*is_buffer=*/true);
  torch::serialize::OutputArchive inner;
  local_optimizer().save(inner);
  archive.write("local", inner);
}

void ShardedOptimizer::load(torch::serialize::InputArchive& archive) {
  c10::IValue value;
  TORCH_CHECK(archive.try_read("world_size", value) && value.isInt(),
              "ShardedOptimizer::load: not a ShardedOptimizer checkpoint");
  TORCH_CHECK(value.toInt() == group_->getSize(), "ShardedOptimizer::load: written at world size ",
              value.toInt(), ", this run has ", group_->getSize(),
              "; loading at a different world size is not supported");
  archive.read("rank", value);
  TORCH_CHECK(value.toInt() == group_->getRank(), "ShardedOptimizer::load: written by rank ",
              value.toInt(), ", loaded by rank ", group_->getRank());
  archive.read("num_params", value);
  TORCH_CHECK(value.toInt() == static_cast<int64_t>(params_.size()),
              "ShardedOptimizer::load: written for ", value.toInt(), " parameters, this one has ",
              params_.size());
  const auto counts = read_param_steps(archive, "ShardedOptimizer::load");
  torch::serialize::InputArchive inner;
  archive.read("local", inner);
  local_optimizer().load(inner);
  pull_options_from_local();
  restore_param_steps(counts);
}

at::Tensor ShardedOptimizer::param_steps() const {
  std::vector<int64_t> counts;
  for (const auto added : added_at_) counts.push_back(steps_ - added);
  return at::tensor(counts, at::TensorOptions().dtype(at::kLong));
}

std::optional<std::pair<int64_t, std::vector<int64_t>>> ShardedOptimizer::read_param_steps(
    torch::serialize::InputArchive& archive, const char* who) const {
  c10::IValue steps;
  if (!archive.try_read("steps", steps)) return std::nullopt;  // written before they were kept
  at::Tensor counts;
  TORCH_CHECK(steps.isInt() && archive.try_read("param_steps", counts, /*is_buffer=*/true) &&
                  counts.numel() == static_cast<int64_t>(params_.size()),
              who, ": the entries 'steps' and 'param_steps' are damaged");
  const auto flat = counts.to(at::kLong).contiguous();
  return std::make_pair(
      steps.toInt(),
      std::vector<int64_t>(flat.data_ptr<int64_t>(), flat.data_ptr<int64_t>() + flat.numel()));
}

void ShardedOptimizer::restore_param_steps(
    const std::optional<std::pair<int64_t, std::vector<int64_t>>>& saved) {
  if (saved) {
    steps_ = saved->first;
    for (size_t i = 0; i < params_.size(); ++i) added_at_[i] = steps_ - saved->second[i];
  }
  write_state_entries();
}

void ShardedOptimizer::save_common(torch::serialize::OutputArchive& common) const {
  common.write("local_type", c10::IValue(local_type(local_optimizer())));
  detail::write_param_shapes(common, params_);
  common.write("group_sizes", at::tensor(group_sizes_, at::TensorOptions().dtype(at::kLong)),
               /*is_buffer=*/true);
  common.write("steps", c10::IValue(steps_));
  common.write("param_steps", param_steps(), /*is_buffer=*/true);
  const auto& groups = local_optimizer().param_groups();
  common.write("num_local_groups", c10::IValue(static_cast<int64_t>(groups.size())));
  for (size_t g = 0; g < groups.size(); ++g) {
    torch::serialize::OutputArchive options;
    groups[g].options().serialize(options);
    common.write("local_group_" + std::to_string(g), options);
  }
}

void ShardedOptimizer::save_pieces(PieceWriter& pieces) const {
  local_type(local_optimizer());
  const int rank = group_->getRank();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (plan_->owner_of(static_cast<int64_t>(i)) != rank) continue;
    pieces.add("param/" + std::to_string(i),
               detail::param_state_piece(local_optimizer(), params_[i]));
  }
}

std::function<void()> ShardedOptimizer::prepare_load(torch::serialize::InputArchive& common,
                                                     PieceReader& pieces) {
  const auto type = local_type(local_optimizer());
  c10::IValue saved_type;
  TORCH_CHECK(common.try_read("local_type", saved_type) && saved_type.isString(),
              "ShardedOptimizer checkpoint: entry 'local_type' is missing");
  TORCH_CHECK(saved_type.toStringRef() == type, "ShardedOptimizer checkpoint: written for a ",
              saved_type.toStringRef(), " on every shard, this one shards a ", type);
  detail::check_param_shapes(common, params_, "ShardedOptimizer checkpoint");
  const auto& groups = local_optimizer().param_groups();
  TORCH_CHECK(read_int(common, "num_local_groups") == static_cast<int64_t>(groups.size()),
              "ShardedOptimizer checkpoint: it has ", read_int(common, "num_local_groups"),
              " param groups, this optimizer has ", groups.size());
  at::Tensor sizes;
  if (common.try_read("group_sizes", sizes, /*is_buffer=*/true)) {
    TORCH_CHECK(at::equal(sizes.to(at::kLong),
                          at::tensor(group_sizes_, at::TensorOptions().dtype(at::kLong))),
                "ShardedOptimizer checkpoint: its param groups hold ", sizes,
                " parameters, this optimizer's hold ", group_sizes_);
  }
  auto counts = std::make_shared<std::optional<std::pair<int64_t, std::vector<int64_t>>>>(
      read_param_steps(common, "ShardedOptimizer checkpoint"));
  // Shared by the installer (std::function needs a copyable callable).
  auto options = std::make_shared<std::vector<std::unique_ptr<torch::optim::OptimizerOptions>>>();
  for (size_t g = 0; g < groups.size(); ++g) {
    torch::serialize::InputArchive archive;
    TORCH_CHECK(common.try_read("local_group_" + std::to_string(g), archive),
                "ShardedOptimizer checkpoint: no options for local param group ", g);
    options->push_back(groups[g].options().clone());
    options->back()->serialize(archive);
  }
  auto states = std::make_shared<
      std::vector<std::pair<void*, std::unique_ptr<torch::optim::OptimizerParamState>>>>();
  const int rank = group_->getRank();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (plan_->owner_of(static_cast<int64_t>(i)) != rank) continue;
    auto piece = pieces.read("param/" + std::to_string(i));
    states->emplace_back(params_[i].unsafeGetTensorImpl(),
                         detail::read_param_state_piece(
                             local_optimizer(), piece,
                             "ShardedOptimizer checkpoint: piece param/" + std::to_string(i)));
  }
  return [this, options, states, counts] {
    auto& local_groups = local_optimizer().param_groups();
    for (size_t g = 0; g < local_groups.size(); ++g) {
      local_groups[g].set_options(std::move((*options)[g]));
    }
    for (auto& [key, state] : *states) {
      local_optimizer().state().erase(key);
      if (state) local_optimizer().state()[key] = std::move(state);
    }
    pull_options_from_local();
    restore_param_steps(*counts);
  };
}

std::vector<const torch::optim::OptimizerParamGroup*> ShardedOptimizer::portable_groups() const {
  sync_before_save();
  return detail::groups_of(*this);
}

int64_t ShardedOptimizer::portable_param_step(const at::Tensor& param) const {
  const auto it = index_of_.find(param.unsafeGetTensorImpl());
  return it == index_of_.end() ? -1 : steps_ - added_at_[it->second];
}

void ShardedOptimizer::save_portable_pieces(PieceWriter& pieces, const PortableSave& save) const {
  sync_before_save();
  local_->save_pieces(pieces, save.names);
}

void ShardedOptimizer::save_portable_layout(torch::serialize::OutputArchive& layout) const {
  layout.write("steps", c10::IValue(steps_));
}

std::function<void()> ShardedOptimizer::prepare_portable_load(const PortableLoad& load) {
  TORCH_CHECK(load.group_options.size() == param_groups_.size(),
              "ShardedOptimizer checkpoint: options for ", load.group_options.size(),
              " param groups, this optimizer has ", param_groups_.size());
  auto options = std::make_shared<std::vector<std::unique_ptr<torch::optim::OptimizerOptions>>>();
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    options->push_back(detail::read_options(param_groups_[g], *load.group_options[g]));
  }
  auto install_states = local_->prepare_load(*load.pieces, load.names);
  int64_t steps = load.steps_taken;
  c10::IValue saved_steps;
  if (load.layout && load.layout->try_read("steps", saved_steps) && saved_steps.isInt()) {
    steps = saved_steps.toInt();
  }
  std::vector<int64_t> added_at(params_.size(), steps);
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto it = load.param_steps.find(load.names(params_[i]));
    if (it != load.param_steps.end() && it->second >= 0) added_at[i] = steps - it->second;
  }
  return [this, options, install_states, steps, added_at] {
    for (size_t g = 0; g < param_groups_.size(); ++g) {
      param_groups_[g].set_options(std::move((*options)[g]));
    }
    install_states();
    push_options_to_local();
    steps_ = steps;
    added_at_ = added_at;
    write_state_entries();
  };
}

}  // namespace shampoo
