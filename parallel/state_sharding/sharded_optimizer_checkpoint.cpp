// ShardedOptimizer's checkpoints: its per-parameter state record, torch::save / torch::load of a
// world (save, load), world-size-independent checkpoint directories (DistributedCheckpointable:
// common entries, one piece per owned parameter) and whole-run checkpoints by parameter name
// (portable_checkpoint.h). The class and its step are in sharded_optimizer.cpp.
#include "parallel/state_sharding/sharded_optimizer_checkpoint.h"

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
#include "parallel/optimizers/options_push.h"

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

void ShardedOptimizer::Checkpoint::sync_before_save() const {
  // What was appended through the base class and options set since the last step are saved too.
  owner_.register_added_params();
  owner_.push_options_to_local();
}

void ShardedOptimizer::save(torch::serialize::OutputArchive& archive) const {
  checkpoint_->sync_before_save();
  archive.write("world_size", c10::IValue(static_cast<int64_t>(group_->getSize())));
  archive.write("rank", c10::IValue(static_cast<int64_t>(group_->getRank())));
  archive.write("num_params", c10::IValue(static_cast<int64_t>(params_.size())));
  archive.write("steps", c10::IValue(steps_));
  archive.write("param_steps", checkpoint_->param_steps(), /*is_buffer=*/true);
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
  const auto counts = checkpoint_->read_param_steps(archive, "ShardedOptimizer::load");
  torch::serialize::InputArchive inner;
  archive.read("local", inner);
  local_optimizer().load(inner);
  pull_options_from_local();
  checkpoint_->restore_param_steps(counts);
}

at::Tensor ShardedOptimizer::Checkpoint::param_steps() const {
  auto& o = owner_;
  std::vector<int64_t> counts;
  for (const auto added : o.added_at_) counts.push_back(o.steps_ - added);
  return at::tensor(counts, at::TensorOptions().dtype(at::kLong));
}

std::optional<std::pair<int64_t, std::vector<int64_t>>>
ShardedOptimizer::Checkpoint::read_param_steps(torch::serialize::InputArchive& archive,
                                               const char* who) const {
  auto& o = owner_;
  c10::IValue steps;
  if (!archive.try_read("steps", steps)) return std::nullopt;  // written before they were kept
  at::Tensor counts;
  TORCH_CHECK(steps.isInt() && archive.try_read("param_steps", counts, /*is_buffer=*/true) &&
                  counts.numel() == static_cast<int64_t>(o.params_.size()),
              who, ": the entries 'steps' and 'param_steps' are damaged");
  const auto flat = counts.to(at::kLong).contiguous();
  return std::make_pair(
      steps.toInt(),
      std::vector<int64_t>(flat.data_ptr<int64_t>(), flat.data_ptr<int64_t>() + flat.numel()));
}

void ShardedOptimizer::Checkpoint::restore_param_steps(
    const std::optional<std::pair<int64_t, std::vector<int64_t>>>& saved) {
  auto& o = owner_;
  if (saved) {
    o.steps_ = saved->first;
    for (size_t i = 0; i < o.params_.size(); ++i) o.added_at_[i] = o.steps_ - saved->second[i];
  }
  o.write_state_entries();
}

void ShardedOptimizer::Checkpoint::save_common(torch::serialize::OutputArchive& common) const {
  auto& o = owner_;
  common.write("local_type", c10::IValue(local_type(o.local_optimizer())));
  detail::write_param_shapes(common, o.params_);
  common.write("group_sizes", at::tensor(o.group_sizes_, at::TensorOptions().dtype(at::kLong)),
               /*is_buffer=*/true);
  common.write("steps", c10::IValue(o.steps_));
  common.write("param_steps", param_steps(), /*is_buffer=*/true);
  const auto& groups = o.local_optimizer().param_groups();
  common.write("num_local_groups", c10::IValue(static_cast<int64_t>(groups.size())));
  for (size_t g = 0; g < groups.size(); ++g) {
    torch::serialize::OutputArchive options;
    groups[g].options().serialize(options);
    common.write("local_group_" + std::to_string(g), options);
  }
}

void ShardedOptimizer::Checkpoint::save_pieces(PieceWriter& pieces) const {
  auto& o = owner_;
  local_type(o.local_optimizer());
  const int rank = o.group_->getRank();
  for (size_t i = 0; i < o.params_.size(); ++i) {
    if (o.plan_->owner_of(static_cast<int64_t>(i)) != rank) continue;
    pieces.add("param/" + std::to_string(i),
               detail::param_state_piece(o.local_optimizer(), o.params_[i]));
  }
}

std::function<void()> ShardedOptimizer::Checkpoint::prepare_load(
    torch::serialize::InputArchive& common, PieceReader& pieces) {
  auto& o = owner_;
  const auto type = local_type(o.local_optimizer());
  c10::IValue saved_type;
  TORCH_CHECK(common.try_read("local_type", saved_type) && saved_type.isString(),
              "ShardedOptimizer checkpoint: entry 'local_type' is missing");
  TORCH_CHECK(saved_type.toStringRef() == type, "ShardedOptimizer checkpoint: written for a ",
              saved_type.toStringRef(), " on every shard, this one shards a ", type);
  detail::check_param_shapes(common, o.params_, "ShardedOptimizer checkpoint");
  const auto& groups = o.local_optimizer().param_groups();
  TORCH_CHECK(read_int(common, "num_local_groups") == static_cast<int64_t>(groups.size()),
              "ShardedOptimizer checkpoint: it has ", read_int(common, "num_local_groups"),
              " param groups, this optimizer has ", groups.size());
  at::Tensor sizes;
  if (common.try_read("group_sizes", sizes, /*is_buffer=*/true)) {
    TORCH_CHECK(at::equal(sizes.to(at::kLong),
                          at::tensor(o.group_sizes_, at::TensorOptions().dtype(at::kLong))),
                "ShardedOptimizer checkpoint: its param groups hold ", sizes,
                " parameters, this optimizer's hold ", o.group_sizes_);
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
  const int rank = o.group_->getRank();
  for (size_t i = 0; i < o.params_.size(); ++i) {
    if (o.plan_->owner_of(static_cast<int64_t>(i)) != rank) continue;
    auto piece = pieces.read("param/" + std::to_string(i));
    states->emplace_back(o.params_[i].unsafeGetTensorImpl(),
                         detail::read_param_state_piece(
                             o.local_optimizer(), piece,
                             "ShardedOptimizer checkpoint: piece param/" + std::to_string(i)));
  }
  return [this, options, states, counts] {
    auto& local = owner_.local_optimizer();
    auto& local_groups = local.param_groups();
    for (size_t g = 0; g < local_groups.size(); ++g) {
      local_groups[g].set_options(std::move((*options)[g]));
    }
    for (auto& [key, state] : *states) {
      local.state().erase(key);
      if (state) local.state()[key] = std::move(state);
    }
    owner_.pull_options_from_local();
    restore_param_steps(*counts);
  };
}

std::vector<const torch::optim::OptimizerParamGroup*>
ShardedOptimizer::Checkpoint::portable_groups() const {
  sync_before_save();
  return detail::groups_of(owner_);
}

int64_t ShardedOptimizer::Checkpoint::portable_param_step(const at::Tensor& param) const {
  auto& o = owner_;
  const auto it = o.index_of_.find(param.unsafeGetTensorImpl());
  return it == o.index_of_.end() ? -1 : o.steps_ - o.added_at_[it->second];
}

void ShardedOptimizer::Checkpoint::save_portable_pieces(PieceWriter& pieces,
                                                        const PortableSave& save) const {
  sync_before_save();
  owner_.local_->save_pieces(pieces, save.names);
}

void ShardedOptimizer::Checkpoint::save_portable_layout(
    torch::serialize::OutputArchive& layout) const {
  layout.write("steps", c10::IValue(owner_.steps_));
}

std::function<void()> ShardedOptimizer::Checkpoint::prepare_portable_load(
    const PortableLoad& load) {
  auto& o = owner_;
  TORCH_CHECK(load.group_options.size() == o.param_groups_.size(),
              "ShardedOptimizer checkpoint: options for ", load.group_options.size(),
              " param groups, this optimizer has ", o.param_groups_.size());
  auto options = std::make_shared<std::vector<std::unique_ptr<torch::optim::OptimizerOptions>>>();
  for (size_t g = 0; g < o.param_groups_.size(); ++g) {
    options->push_back(detail::read_options(o.param_groups_[g], *load.group_options[g]));
  }
  auto install_states = o.local_->prepare_load(*load.pieces, load.names);
  int64_t steps = load.steps_taken;
  c10::IValue saved_steps;
  if (load.layout && load.layout->try_read("steps", saved_steps) && saved_steps.isInt()) {
    steps = saved_steps.toInt();
  }
  std::vector<int64_t> added_at(o.params_.size(), steps);
  for (size_t i = 0; i < o.params_.size(); ++i) {
    const auto it = load.param_steps.find(load.names(o.params_[i]));
    if (it != load.param_steps.end() && it->second >= 0) added_at[i] = steps - it->second;
  }
  return [this, options, install_states, steps, added_at] {
    for (size_t g = 0; g < owner_.param_groups_.size(); ++g) {
      owner_.param_groups_[g].set_options(std::move((*options)[g]));
      owner_.push_->replaced(g);
    }
    install_states();
    owner_.push_options_to_local();
    owner_.steps_ = steps;
    owner_.added_at_ = added_at;
    owner_.write_state_entries();
  };
}

DistributedCheckpointable& ShardedOptimizer::checkpoint_delegate() const { return *checkpoint_; }

PortableCheckpointable& ShardedOptimizer::portable_delegate() const { return *checkpoint_; }

}  // namespace shampoo
