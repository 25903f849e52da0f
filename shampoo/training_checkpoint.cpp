#include "shampoo/training_checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <c10/util/TypeIndex.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <typeinfo>
#include <utility>

#include "parallel/communication/collectives.h"
#include "parallel/communication/process_group.h"
#include "parallel/optimizers/capabilities.h"
#include "shampoo/training_checkpoint_internal.h"

namespace shampoo {
namespace {

constexpr const char* kWho = detail::kTrainingCheckpointWho;
using detail::NamedTensors;

std::string rank_key(const char* what, int rank, int world) {
  return std::string(what) + "/rank-" + std::to_string(rank) + "-of-" + std::to_string(world);
}

void set_generator_state(at::Generator generator, const at::Tensor& state) {
  // A default generator is shared by the process; its mutex guards set_state.
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state.cpu());
}

}  // namespace

TrainingCheckpoint::TrainingCheckpoint(TrainingState state,
                                       c10::intrusive_ptr<c10d::ProcessGroup> group)
    : state_(state), group_(std::move(group)) {
  TORCH_CHECK(state_.model != nullptr, kWho, ": TrainingState::model is null");
  TORCH_CHECK(state_.optimizer != nullptr, kWho, ": TrainingState::optimizer is null");
  if (group_) {
    rank_ = group_->getRank();
    world_size_ = group_->getSize();
  }
  for (const auto& item : state_.model->named_parameters()) {
    names_.emplace(item.value().unsafeGetTensorImpl(), item.key());
  }
  if (as_portable(*state_.optimizer) == nullptr && detail::has_param_states(*state_.optimizer)) {
    replicated_ = std::make_unique<detail::ReplicatedPortable>(*state_.optimizer);
  }
  // Every rank of the job saves and loads together: a group with fewer ranks than train (a
  // shard group under hybrid sharding, none under data parallelism) would have two ranks write
  // the same files.
  if (const auto* distributed = checkpointable()) {
    if (const auto inner = distributed->checkpoint_group()) {
      const int64_t ranks =
          static_cast<int64_t>(inner->getSize()) * distributed->checkpoint_replicas();
      TORCH_CHECK(world_size_ == ranks, kWho, ": the optimizer trains on ", ranks, " ranks",
                  distributed->checkpoint_replicas() > 1
                      ? " (its shard group times the replicas of hybrid sharding)"
                      : "",
                  ", the checkpoint's process group has ", world_size_,
                  "; give save_training_checkpoint / load_training_checkpoint the group of every "
                  "rank that trains (the world group)");
    }
  }
}

DistributedCheckpointable* TrainingCheckpoint::checkpointable() const {
  return detail::capabilities_of(*state_.optimizer).checkpointable;
}

PortableCheckpointable* TrainingCheckpoint::portable() const {
  if (auto* own = as_portable(*state_.optimizer)) {
    return own->portable_supported() ? own : nullptr;
  }
  return replicated_.get();
}

std::string detail::optimizer_kind(const DistributedCheckpointable* distributed) {
  return distributed != nullptr ? distributed->checkpoint_kind() : "replicated";
}

std::string TrainingCheckpoint::name_of(const at::Tensor& param) const {
  const auto it = names_.find(param.unsafeGetTensorImpl());
  TORCH_CHECK(it != names_.end(), kWho,
              ": the optimizer steps a tensor of shape ", param.sizes(),
              " that is not one of the model's parameters (TrainingState::model must hold "
              "every parameter the optimizer steps)");
  return it->second;
}

std::vector<std::pair<std::string, at::Tensor>> TrainingCheckpoint::named_state(
    bool with_parameters) const {
  NamedTensors named;
  if (with_parameters) {
    for (const auto& item : state_.model->named_parameters()) {
      named.emplace_back(item.key(), item.value());
    }
  }
  for (const auto& item : state_.model->named_buffers()) named.emplace_back(item.key(), item.value());
  return named;
}

void TrainingCheckpoint::sync_for_checkpoint() const {
  if (const auto* distributed = checkpointable()) distributed->sync_for_checkpoint();
}

void TrainingCheckpoint::save_common(torch::serialize::OutputArchive& common) const {
  common.write("world_size", c10::IValue(static_cast<int64_t>(world_size_)));
  if (portable() != nullptr) {
    common.write("format", c10::IValue(detail::kTrainingCheckpointFormat));
    save_model(common);
    save_optimizer(common);
  } else {
    save_common_by_layout(common);
  }
  save_run_common(common);
}


void TrainingCheckpoint::save_run_common(torch::serialize::OutputArchive& common) const {
  const auto unit = common.compilation_unit();
  if (state_.scaler != nullptr) {
    torch::serialize::OutputArchive scaler(unit);
    state_.scaler->save(scaler);
    common.write("grad_scaler", scaler);
  }
  if (state_.values != nullptr) {
    torch::serialize::OutputArchive values(unit);
    std::string names;
    for (const auto& [name, value] : *state_.values) {
      TORCH_CHECK(name.find('\n') == std::string::npos, kWho, ": value name '", name,
                  "' holds a newline");
      names += name + "\n";
      if (value.isTensor()) {
        values.write("value_" + name, value.toTensor().detach().cpu());
      } else {
        TORCH_CHECK(value.isInt() || value.isDouble() || value.isBool() || value.isString(), kWho,
                    ": value '", name, "' is a ", value.tagKind(),
                    "; expected an int, a double, a bool, a string or a tensor");
        values.write("value_" + name, value);
      }
    }
    values.write("names", c10::IValue(names));
    common.write("values", values);
  }
}

void TrainingCheckpoint::save_pieces(PieceWriter& pieces) const {
  if (const auto* optimizer = portable()) {
    auto nested = pieces.nested("optimizer/");
    const PortableSave save{[this](const at::Tensor& p) { return name_of(p); }, rank_, &pieces};
    optimizer->save_portable_pieces(nested, save);
  } else {
    save_pieces_by_layout(pieces);
  }
  save_rank_pieces(pieces);
}

void TrainingCheckpoint::save_rank_pieces(PieceWriter& pieces) const {
  if (state_.random_state) {
    torch::serialize::OutputArchive random;
    random.write("cpu", at::detail::getDefaultCPUGenerator().get_state());
    if (state_.device.is_cuda()) {
      random.write("device", at::globalContext().defaultGenerator(state_.device).get_state());
    }
    pieces.add(rank_key("random", rank_, world_size_), std::move(random));
  }
  if (state_.gradients) {
    torch::serialize::OutputArchive gradients;
    const auto params = state_.model->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].grad().defined()) {
        gradients.write("grad_" + std::to_string(i), params[i].grad().detach().cpu());
      }
    }
    pieces.add(rank_key("gradients", rank_, world_size_), std::move(gradients));
  }
}


std::function<void()> TrainingCheckpoint::prepare_scaler(
    torch::serialize::InputArchive& common) const {
  auto archive = std::make_shared<torch::serialize::InputArchive>();
  const bool saved = common.try_read("grad_scaler", *archive);
  TORCH_CHECK(saved || state_.scaler == nullptr, kWho,
              ": written by a run without a GradScaler, and this one has one (its scale would "
              "start over); resume with the settings of the run that wrote it");
  TORCH_CHECK(!saved || state_.scaler != nullptr, kWho,
              ": written by a run with a GradScaler, whose scale this run would lose; give "
              "TrainingState::scaler");
  if (!saved) return [] {};
  return state_.scaler->prepare_load(archive);
}

std::function<void()> TrainingCheckpoint::prepare_values(
    torch::serialize::InputArchive& common) const {
  if (state_.values == nullptr) return [] {};
  torch::serialize::InputArchive archive;
  auto values = std::make_shared<std::map<std::string, c10::IValue>>();
  if (common.try_read("values", archive)) {
    c10::IValue names;
    TORCH_CHECK(archive.try_read("names", names) && names.isString(), kWho,
                ": the values' entry is damaged");
    std::istringstream lines(names.toStringRef());
    std::string name;
    while (std::getline(lines, name)) {
      c10::IValue value;
      at::Tensor tensor;
      if (archive.try_read("value_" + name, tensor)) {
        value = tensor.to(state_.device);
      } else {
        TORCH_CHECK(archive.try_read("value_" + name, value), kWho, ": value '", name,
                    "' is missing");
      }
      (*values)[name] = value;
    }
  }
  auto* target = state_.values;
  return [values, target] { *target = *values; };
}

std::function<void()> TrainingCheckpoint::prepare_rank_pieces(
    torch::serialize::InputArchive& common, PieceReader& pieces) const {
  const int64_t saved_world = detail::read_int_entry(common, "world_size", kWho);
  std::function<void()> random = [] {};
  // At another number of ranks every rank takes rank 0's generators (a run seeded alike holds
  // the same on every rank).
  const auto random_key = saved_world == world_size_
                              ? rank_key("random", rank_, world_size_)
                              : rank_key("random", 0, static_cast<int>(saved_world));
  if (state_.random_state && pieces.contains(random_key)) {
    auto archive = pieces.read(random_key);
    at::Tensor cpu, device;
    TORCH_CHECK(archive.try_read("cpu", cpu), kWho, ": piece ", random_key, " is damaged");
    archive.try_read("device", device);
    const auto on = state_.device;
    random = [cpu, device, on] {
      set_generator_state(at::detail::getDefaultCPUGenerator(), cpu);
      if (on.is_cuda() && device.defined()) {
        set_generator_state(at::globalContext().defaultGenerator(on), device);
      }
    };
  }
  std::function<void()> gradients = [] {};
  const auto gradients_key = rank_key("gradients", rank_, world_size_);
  if (state_.gradients) {
    bool any_saved = false;
    for (int r = 0; r < saved_world && !any_saved; ++r) {
      any_saved = pieces.contains(rank_key("gradients", r, static_cast<int>(saved_world)));
    }
    TORCH_CHECK(!any_saved || saved_world == world_size_, kWho, ": saved with the gradients of ",
                saved_world, " ranks (in the middle of a gradient accumulation), which resume at ",
                saved_world, " ranks only (each holds its own partial sums), not at ", world_size_);
    if (pieces.contains(gradients_key)) {
      auto archive = pieces.read(gradients_key);
      const auto params = state_.model->parameters();
      std::vector<std::pair<at::Tensor, at::Tensor>> grads;
      for (size_t i = 0; i < params.size(); ++i) {
        at::Tensor grad;
        if (archive.try_read("grad_" + std::to_string(i), grad)) {
          TORCH_CHECK(grad.sizes() == params[i].sizes(), kWho, ": piece ", gradients_key,
                      " holds a gradient of another shape for parameter ", i);
          grads.emplace_back(params[i], grad.to(params[i].options().requires_grad(false)));
        } else {
          grads.emplace_back(params[i], at::Tensor());
        }
      }
      gradients = [grads] {
        for (const auto& [param, grad] : grads) param.mutable_grad() = grad;
      };
    }
  }
  return [random, gradients] {
    random();
    gradients();
  };
}

std::function<void()> TrainingCheckpoint::prepare_load(torch::serialize::InputArchive& common,
                                                       PieceReader& pieces) {
  std::function<void()> install_model;
  std::function<void()> install_optimizer;
  c10::IValue format;
  if (common.try_read("format", format)) {
    TORCH_CHECK(format.isInt() && format.toInt() == detail::kTrainingCheckpointFormat, kWho,
                ": format ", format.isInt() ? format.toInt() : -1, ", this version reads formats 1 and ",
                detail::kTrainingCheckpointFormat);
    TORCH_CHECK(portable() != nullptr, kWho,
                ": the checkpoint holds the optimizer's state by parameter, and this optimizer (a ",
                c10::demangle(typeid(*state_.optimizer).name()),
                ") keeps no state that is known per parameter");
    const auto saved = detail::read_model_entry(common, pieces);
    install_model = prepare_model(*saved.model);
    install_optimizer = prepare_optimizer(common, pieces, saved.model);
  } else {
    // The optimizer first: a checkpoint of another layout is refused as such.
    install_optimizer = prepare_optimizer_by_layout(common, pieces);
    install_model = prepare_model_by_layout(common);
  }
  auto install_scaler = prepare_scaler(common);
  auto install_values = prepare_values(common);
  auto install_rank = prepare_rank_pieces(common, pieces);
  return [install_model, install_optimizer, install_scaler, install_values, install_rank] {
    install_model();
    install_optimizer();
    install_scaler();
    install_values();
    install_rank();
  };
}


void save_training_checkpoint(const std::filesystem::path& dir, const TrainingState& state,
                              c10::intrusive_ptr<c10d::ProcessGroup> group) {
  TrainingCheckpoint checkpoint(state, group);
  save_distributed_state(checkpoint, dir, std::move(group));
}

bool load_training_checkpoint(const std::filesystem::path& dir, const TrainingState& state,
                              c10::intrusive_ptr<c10d::ProcessGroup> group) {
  const bool here = distributed_checkpoint_exists(dir);
  if (group && group->getSize() > 1) {
    const auto all = detail::gather_int64(*group, {here ? 1 : 0});
    for (int r = 0; r < group->getSize(); ++r) {
      TORCH_CHECK((all[r][0] != 0) == here, kWho, ": ", dir.string(),
                  " holds a committed "
                  "checkpoint on rank ",
                  here ? group->getRank() : r, " but not on rank ", here ? r : group->getRank(),
                  "; every rank must see the same folder (on "
                  "several machines, a filesystem every node mounts)");
    }
  }
  if (!here) return false;
  TrainingCheckpoint checkpoint(state, group);
  load_distributed_state(checkpoint, dir, std::move(group));
  return true;
}

}  // namespace shampoo
