#include "shampoo/training_checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <utility>

#include "parallel/collectives.h"
#include "parallel/fully_sharded.h"
#include "parallel/process_group.h"

namespace shampoo {
namespace {

constexpr const char* kWho = "training checkpoint";

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// The parameters (unless `with_parameters` is false: a fully sharded model saves them itself),
/// then the buffers, by name (the module's own tensors).
NamedTensors named_state(const torch::nn::Module& model, bool with_parameters) {
  NamedTensors named;
  if (with_parameters) {
    for (const auto& item : model.named_parameters()) named.emplace_back(item.key(), item.value());
  }
  for (const auto& item : model.named_buffers()) named.emplace_back(item.key(), item.value());
  return named;
}

void write_named_tensors(torch::serialize::OutputArchive& archive, const NamedTensors& named) {
  std::string names;
  for (size_t i = 0; i < named.size(); ++i) {
    names += named[i].first + "\n";
    archive.write("tensor_" + std::to_string(i), named[i].second.detach().cpu());
  }
  archive.write("names", c10::IValue(names));
}

NamedTensors read_named_tensors(torch::serialize::InputArchive& archive) {
  c10::IValue names;
  TORCH_CHECK(archive.try_read("names", names) && names.isString(), kWho,
              ": the model's entry is damaged");
  NamedTensors named;
  std::istringstream lines(names.toStringRef());
  std::string name;
  while (std::getline(lines, name)) {
    at::Tensor tensor;
    TORCH_CHECK(archive.try_read("tensor_" + std::to_string(named.size()), tensor), kWho,
                ": the model's tensor ", name, " is missing");
    named.emplace_back(name, tensor);
  }
  return named;
}

std::string rank_key(const char* what, int rank, int world) {
  return std::string(what) + "/rank-" + std::to_string(rank) + "-of-" + std::to_string(world);
}

/// The bytes of a LibTorch optimizer's own archive, as a uint8 tensor (loading then maps its
/// tensors to the run's device).
at::Tensor archive_bytes(const torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive whole;
  optimizer.save(whole);
  std::ostringstream out;
  whole.save_to(out);
  const auto text = out.str();
  auto bytes = at::empty({static_cast<int64_t>(text.size())}, at::kByte);
  std::memcpy(bytes.data_ptr(), text.data(), text.size());
  return bytes;
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
}

DistributedCheckpointable* TrainingCheckpoint::checkpointable() const {
  return dynamic_cast<DistributedCheckpointable*>(state_.optimizer);
}

bool TrainingCheckpoint::fully_sharded() const {
  return dynamic_cast<FullyShardedOptimizer*>(state_.optimizer) != nullptr;
}

void TrainingCheckpoint::sync_for_checkpoint() const {
  if (const auto* distributed = checkpointable()) distributed->sync_for_checkpoint();
}

void TrainingCheckpoint::save_common(torch::serialize::OutputArchive& common) const {
  const auto unit = common.compilation_unit();
  common.write("world_size", c10::IValue(static_cast<int64_t>(world_size_)));
  auto named = named_state(*state_.model, !fully_sharded());
  if (!saved_buffers_.empty()) {
    TORCH_CHECK(saved_buffers_.size() <= named.size(), kWho, ": more saved buffers than tensors");
    const size_t first_buffer = named.size() - saved_buffers_.size();
    for (size_t i = 0; i < saved_buffers_.size(); ++i) {
      named[first_buffer + i].second = saved_buffers_[i];
    }
  }
  torch::serialize::OutputArchive model(unit);
  write_named_tensors(model, named);
  common.write("model", model);

  torch::serialize::OutputArchive optimizer(unit);
  if (const auto* distributed = checkpointable()) {
    optimizer.write("kind", c10::IValue(distributed->checkpoint_kind()));
    torch::serialize::OutputArchive own(unit);
    distributed->save_common(own);
    optimizer.write("common", own);
  } else {
    optimizer.write("kind", c10::IValue(std::string("replicated")));
    optimizer.write("state", archive_bytes(*state_.optimizer));
  }
  common.write("optimizer", optimizer);
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
  const auto* distributed = checkpointable();
  // Hybrid sharding: the replicas hold the same shards, so replica 0 writes them (every rank
  // still writes its own generators); any rank reads them back, whatever its replica.
  if (distributed != nullptr &&
      (distributed->checkpoint_replica() == 0 || distributed->every_replica_writes())) {
    auto nested = pieces.nested("optimizer/");
    distributed->save_pieces(nested);
  }
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

std::function<void()> TrainingCheckpoint::prepare_model(
    torch::serialize::InputArchive& common) const {
  torch::serialize::InputArchive archive;
  TORCH_CHECK(common.try_read("model", archive), kWho, ": no model in the checkpoint");
  const auto saved = read_named_tensors(archive);
  const auto live = named_state(*state_.model, !fully_sharded());
  TORCH_CHECK(saved.size() == live.size(), kWho, ": the model has ", saved.size(),
              " parameters and buffers there, ", live.size(),
              " here (a checkpoint of another model?)");
  for (size_t i = 0; i < live.size(); ++i) {
    const auto& [name, tensor] = live[i];
    TORCH_CHECK(saved[i].first == name && saved[i].second.sizes() == tensor.sizes() &&
                    saved[i].second.dtype() == tensor.dtype(),
                kWho, ": the model's tensor ", i, " is ", saved[i].first, " ",
                saved[i].second.sizes(), " (", saved[i].second.dtype(), ") there and ", name, " ",
                tensor.sizes(), " (", tensor.dtype(), ") here (a checkpoint of another model?)");
  }
  return [saved, live] {
    at::NoGradGuard no_grad;
    // In place: the optimizer and a gradient synchronizer hold these tensors.
    for (size_t i = 0; i < live.size(); ++i) live[i].second.copy_(saved[i].second);
  };
}

std::function<void()> TrainingCheckpoint::prepare_optimizer(torch::serialize::InputArchive& common,
                                                            PieceReader& pieces) const {
  torch::serialize::InputArchive archive;
  c10::IValue kind;
  TORCH_CHECK(
      common.try_read("optimizer", archive) && archive.try_read("kind", kind) && kind.isString(),
      kWho, ": no optimizer in the checkpoint");
  auto* distributed = checkpointable();
  const std::string expected = distributed ? distributed->checkpoint_kind() : "replicated";
  TORCH_CHECK(kind.toStringRef() == expected, kWho, ": the optimizer there is a ",
              kind.toStringRef() == "replicated" ? "LibTorch optimizer" : kind.toStringRef(),
              ", here a ", expected == "replicated" ? "LibTorch optimizer" : expected);
  if (distributed != nullptr) {
    torch::serialize::InputArchive own;
    TORCH_CHECK(archive.try_read("common", own), kWho, ": the optimizer's entry is damaged");
    auto nested = pieces.nested("optimizer/");
    return distributed->prepare_load(own, nested);
  }
  at::Tensor bytes;
  TORCH_CHECK(archive.try_read("state", bytes), kWho, ": the optimizer's entry is damaged");
  const auto contiguous = bytes.contiguous();
  std::istringstream stream(std::string(static_cast<const char*>(contiguous.data_ptr()),
                                        static_cast<size_t>(contiguous.numel())));
  auto whole = std::make_shared<torch::serialize::InputArchive>();
  whole->load_from(stream, state_.device);
  auto* optimizer = state_.optimizer;
  return [optimizer, whole] { optimizer->load(*whole); };
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
  auto install_model = prepare_model(common);
  auto install_optimizer = prepare_optimizer(common, pieces);
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

namespace {

/// Reads the model entry of a training checkpoint of any kind (it loads nothing else).
class ModelReader final : public DistributedCheckpointable {
 public:
  explicit ModelReader(std::string kind) : kind_(std::move(kind)) {}
  std::string checkpoint_kind() const override { return kind_; }
  c10::intrusive_ptr<c10d::ProcessGroup> checkpoint_group() const override { return {}; }
  void save_common(torch::serialize::OutputArchive&) const override {
    TORCH_INTERNAL_ASSERT(false, "ModelReader only loads");
  }
  void save_pieces(PieceWriter&) const override {
    TORCH_INTERNAL_ASSERT(false, "ModelReader only loads");
  }
  std::function<void()> prepare_load(torch::serialize::InputArchive& common,
                                     PieceReader&) override {
    torch::serialize::InputArchive archive;
    TORCH_CHECK(common.try_read("model", archive), kWho, ": no model in the checkpoint");
    model = read_named_tensors(archive);
    return [] {};
  }
  NamedTensors model;

 private:
  std::string kind_;
};

}  // namespace

std::vector<std::pair<std::string, at::Tensor>> read_training_checkpoint_model(
    const std::filesystem::path& dir) {
  ModelReader reader(read_checkpoint_manifest(dir).kind);
  load_distributed_state(reader, dir);
  return reader.model;
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
