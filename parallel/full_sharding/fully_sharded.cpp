#include "parallel/full_sharding/fully_sharded.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <filesystem>
#include <sstream>
#include <utility>

#include "parallel/communication/collectives.h"
#include "parallel/communication/process_group.h"
#include "parallel/data_parallel/grad_ready_hooks.h"
#include "parallel/data_parallel/spread_grad_norm.h"
#include "parallel/full_sharding/fully_sharded_checkpoint.h"

namespace shampoo {

FullyShardedDataParallel::FullyShardedDataParallel(std::vector<ShardedUnit> units,
                                                   GroupOptimizerFactory factory,
                                                   c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                   FullyShardedOptions options)
    : state_(std::make_shared<detail::FsdpState>()) {
  init(std::move(units), std::nullopt, std::move(factory), std::move(group), options);
}

FullyShardedDataParallel::FullyShardedDataParallel(
    std::vector<ShardedUnit> units, std::vector<torch::optim::OptimizerParamGroup> param_groups,
    GroupOptimizerFactory factory, c10::intrusive_ptr<c10d::ProcessGroup> group,
    FullyShardedOptions options)
    : state_(std::make_shared<detail::FsdpState>()) {
  TORCH_CHECK(options.step_mode() == ShardedStepMode::kLossless, detail::kFsdpWho,
              "param groups need step_mode kLossless (local shards step a unit's rows with one "
              "optimizer)");
  init(std::move(units), std::move(param_groups), std::move(factory), std::move(group), options);
}

void FullyShardedDataParallel::init(
    std::vector<ShardedUnit> units,
    std::optional<std::vector<torch::optim::OptimizerParamGroup>> param_groups,
    GroupOptimizerFactory factory, c10::intrusive_ptr<c10d::ProcessGroup> group,
    FullyShardedOptions options) {
  TORCH_CHECK(group, detail::kFsdpWho, "the process group is null");
  TORCH_CHECK(factory, detail::kFsdpWho, "the optimizer factory is empty");
  TORCH_CHECK(!options.offload_state_to_cpu(), detail::kFsdpWho,
              "offload_state_to_cpu: a CPU-resident optimizer state (the state and the step on "
              "the CPU while the model trains on a GPU) is not supported yet; leave it false");
  TORCH_CHECK(options.accumulation_steps() >= 1, detail::kFsdpWho, "accumulation_steps: got ",
              options.accumulation_steps(), ", expected at least 1");
  for (const auto& [name, dtype] : {std::pair{"param_dtype", options.param_dtype()},
                                    std::pair{"reduce_dtype", options.reduce_dtype()}}) {
    TORCH_CHECK(!dtype || at::isFloatingType(*dtype), detail::kFsdpWho, name, ": got ", *dtype,
                ", expected a floating-point dtype");
  }
  TORCH_CHECK(!options.split_across_replicas() || options.replica_group(), detail::kFsdpWho,
              "split_across_replicas needs a replica_group (hybrid sharding)");
  TORCH_CHECK(!options.split_across_replicas() || options.step_mode() == ShardedStepMode::kLossless,
              detail::kFsdpWho, "split_across_replicas needs step_mode kLossless");
  auto& s = *state_;
  auto& mesh = s.mesh;
  mesh.group = std::move(group);
  mesh.rank = mesh.group->getRank();
  mesh.world = mesh.group->getSize();
  mesh.global_ranks = detail::global_ranks(*mesh.group);
  mesh.replica_group = options.replica_group();
  if (mesh.replica_group) {
    mesh.replicas = mesh.replica_group->getSize();
    mesh.replica = mesh.replica_group->getRank();
  }
  mesh.split = options.split_across_replicas() && mesh.replicas > 1;
  s.options = options;
  s.factory = std::move(factory);
  s.pass.set_accumulation_steps(options.accumulation_steps());
  s.setup(*this, std::move(units), std::move(param_groups));
  checkpoint_ = std::make_unique<detail::FsdpCheckpoint>(s);
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  try {
    state_->wait_all();
  } catch (...) {  // a failed step was the caller's to see through wait(); nothing to do here
  }
  state_->worker.reset();
  for (auto& unit : state_->units) {
    for (auto& slot : unit->params) detail::remove_grad_ready_callback(slot.param, slot.hook);
  }
}

size_t FullyShardedDataParallel::num_units() const { return state_->units.size(); }

size_t FullyShardedDataParallel::unit_index(const std::string& name) const {
  const auto it = state_->unit_by_name.find(name);
  if (it == state_->unit_by_name.end()) {
    std::ostringstream names;
    for (const auto& unit : state_->units) {
      names << (names.tellp() > 0 ? ", '" : "'") << unit->name << "'";
    }
    TORCH_CHECK(false, detail::kFsdpWho, "no unit is named '", name, "'; the units are ",
                names.str());
  }
  return it->second;
}

const std::string& FullyShardedDataParallel::unit_name(size_t unit) const {
  TORCH_CHECK(unit < state_->units.size(), detail::kFsdpWho, "unit ", unit, " does not exist (",
              state_->units.size(), " units)");
  return state_->units[unit]->name;
}

at::Tensor FullyShardedDataParallel::forward(size_t unit, const std::function<at::Tensor()>& fn) {
  unit_name(unit);  // checks the index
  return state_->forward(unit, fn);
}

void FullyShardedDataParallel::step() { state_->step_all("step()"); }

void FullyShardedDataParallel::wait() { state_->wait_all(); }

std::vector<at::Tensor> FullyShardedDataParallel::reduced_gradients() {
  return state_->reduced_gradients("reduced_gradients()");
}

void FullyShardedDataParallel::skip_step() { state_->skip_all(); }

std::vector<at::Tensor> FullyShardedDataParallel::gradients_to_unscale(const char* caller) {
  TORCH_CHECK(!state_->options.overlap_step(), caller,
              ": this FullyShardedDataParallel steps each unit during backward (overlap_step, the "
              "default), before every gradient is known to be finite, so the scaler cannot skip "
              "a step; construct it with FullyShardedOptions().overlap_step(false)");
  return reduced_gradients();
}

void FullyShardedDataParallel::unscaled_step() {
  if (!state_->options.overlap_step()) step();  // with overlap it ran in backward
}

double FullyShardedDataParallel::clip_grad_norm_(double max_norm, double norm_type) {
  std::vector<at::Tensor> all;
  for (const auto& unit : state_->units) {
    for (const auto& slot : unit->params) all.push_back(slot.param);
  }
  return clip_grad_norm_of(all, max_norm, norm_type, "clip_grad_norm_");
}

double FullyShardedDataParallel::clip_grad_norm_of(const std::vector<at::Tensor>& params,
                                                   double max_norm, double norm_type,
                                                   const char* function) {
  auto& s = *state_;
  s.reduced_gradients(function);  // for its check: an error with overlap_step
  TORCH_CHECK(s.lossless(), detail::kFsdpWho, function,
              ": needs step_mode kLossless (local shards hold row chunks, whose norms do not add "
              "up to a whole parameter's bit for bit)");
  TORCH_CHECK(!s.mesh.split, detail::kFsdpWho, function,
              ": with split_across_replicas each replica holds the averaged gradients of the "
              "parameters it steps only, and clipping by their norm across the replicas is not "
              "supported yet; clip with the state replicated (split_across_replicas(false))");
  std::vector<detail::SpreadGradient> spread;
  for (const auto& p : params) {
    const auto [u, i] = s.position_of(p);
    const auto& slot = s.unit(u).params[i];
    // The owner holds the parameter's whole averaged gradient; nobody else holds any of it.
    spread.push_back({slot.reduced, slot.reduced, s.unit(u).options});
  }
  const auto who = std::string(detail::kFsdpWho) + function;
  return detail::clip_spread_grad_norm_(*s.mesh.group, spread, max_norm, norm_type, who.c_str());
}

void FullyShardedDataParallel::gather_all() {
  auto& s = *state_;
  s.wait_all();
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  for (auto& unit : s.units) unit->gather(*s.mesh.group);
  s.holding = true;
}

void FullyShardedDataParallel::release_all() {
  auto& s = *state_;
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  for (auto& unit : s.units) unit->reshard();
  s.holding = false;
}

torch::optim::Optimizer* FullyShardedDataParallel::optimizer_of(const at::Tensor& param) {
  auto& s = *state_;
  const auto [u, i] = s.position_of(param);
  if (!s.lossless()) return s.unit(u).optimizer ? s.unit(u).optimizer->get() : nullptr;
  const auto& slot = s.unit(u).params[i];
  const bool stepped_here = slot.steps_on(s.mesh) && slot.in_a_group();
  return stepped_here ? s.rank_optimizer->get() : nullptr;
}

std::vector<torch::optim::Optimizer*> FullyShardedDataParallel::optimizers() {
  std::vector<torch::optim::Optimizer*> out;
  if (state_->rank_optimizer && state_->rank_optimizer->get() != nullptr) {
    out.push_back(state_->rank_optimizer->get());
  }
  for (auto& unit : state_->units) {
    if (unit->optimizer) out.push_back(unit->optimizer->get());
  }
  return out;
}

int FullyShardedDataParallel::owner_of(const at::Tensor& param) const {
  return state_->lossless() ? state_->slot_for(param).owner : -1;
}

at::Tensor FullyShardedDataParallel::shard_of(const at::Tensor& param) const {
  return state_->slot_for(param).shard;
}

at::Tensor FullyShardedDataParallel::full_value(const at::Tensor& param) {
  auto& s = *state_;
  s.wait_all();
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  const auto& slot = s.slot_for(param);
  // The shards' own values (not a lower-precision compute copy), padded to whole chunks.
  auto input = at::empty({slot.chunk_numel()}, slot.shard.options().requires_grad(false));
  slot.write_shard(input);
  auto gathered = at::empty({s.mesh.world * slot.chunk_numel()}, input.options());
  detail::wait_one(detail::start_all_gather(*s.mesh.group, gathered, input),
                   "full_value's all-gather", s.mesh.rank);
  return gathered.narrow(0, 0, slot.numel()).view(slot.sizes).clone();
}

std::optional<at::ScalarType> FullyShardedDataParallel::param_dtype() const {
  return state_->options.param_dtype();
}

const FullyShardedOptions& FullyShardedDataParallel::options() const { return state_->options; }

int64_t FullyShardedDataParallel::backward_passes() const { return state_->pass.passes(); }
int64_t FullyShardedDataParallel::steps_taken() const { return state_->steps; }

int64_t FullyShardedDataParallel::shard_bytes() const {
  int64_t bytes = 0;
  for (const auto& unit : state_->units) {
    for (const auto& slot : unit->params) bytes += static_cast<int64_t>(slot.shard.nbytes());
  }
  return bytes;
}

int64_t FullyShardedDataParallel::gradient_bytes() const {
  int64_t bytes = 0;
  for (const auto& unit : state_->units) {
    for (const auto& slot : unit->params) {
      if (slot.reduced.defined()) bytes += static_cast<int64_t>(slot.reduced.nbytes());
    }
  }
  return bytes;
}

int64_t FullyShardedDataParallel::gathered_bytes() const {
  int64_t bytes = 0;
  for (const auto& unit : state_->units) {
    for (const auto& slot : unit->params) {
      bytes += static_cast<int64_t>(slot.param.unsafeGetTensorImpl()->storage().nbytes());
    }
  }
  return bytes;
}

const c10::intrusive_ptr<c10d::ProcessGroup>& FullyShardedDataParallel::process_group() const {
  return state_->mesh.group;
}

DistributedCheckpointable& FullyShardedDataParallel::checkpoint_delegate() const {
  return *checkpoint_;
}

PortableCheckpointable& FullyShardedDataParallel::portable_delegate() const { return *checkpoint_; }

void save_full_model(FullyShardedDataParallel& fsdp, const torch::nn::Module& model,
                     const std::filesystem::path& path) {
  auto& s = *fsdp.state_;
  s.wait_all();
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  TORCH_CHECK(!s.holding, detail::kFsdpWho,
              "save_full_model: call it outside gather_all() / release_all()");
  std::string error;
  for (auto& unit : s.units) {
    TORCH_CHECK(!unit->gathered, detail::kFsdpWho, "save_full_model: unit '", unit->name,
                "' is gathered; call it between iterations");
    for (auto& slot : unit->params) unit->materialize(slot, "save_full_model's all-gather");
  }
  // One writer per job: rank 0 of replica 0's shard group (under hybrid sharding every replica
  // holds the same model; two writers would share the temporary file). The temporary name is
  // the writer's own, so that a second job writing the same path cannot rename its half.
  const bool writer = s.mesh.rank == 0 && s.mesh.replica == 0;
  if (writer) {
    try {
      torch::serialize::OutputArchive archive;
      model.save(archive);
      const auto temporary = path.string() + ".tmp-" + std::to_string(::getpid());
      archive.save_to(temporary);
      std::filesystem::rename(temporary, path);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  for (auto& unit : s.units) unit->release_storage();
  // Every rank returns once the file is there, or with the writer's error: its flag reaches its
  // shard group, then every replica.
  int64_t failed = detail::gather_int64(*s.mesh.group, {error.empty() ? 0 : 1})[0][0];
  if (s.mesh.replicas > 1) failed = detail::gather_int64(*s.mesh.replica_group, {failed})[0][0];
  TORCH_CHECK(error.empty(), detail::kFsdpWho, "save_full_model: writing ", path.string(),
              " failed: ", error);
  TORCH_CHECK(failed == 0, detail::kFsdpWho, "save_full_model: the writing rank (rank 0",
              s.mesh.replicas > 1 ? " of replica 0's shard group" : "", ") failed to write ",
              path.string(), " (its error says why)");
}

std::vector<ShardedUnit> sequential_units(const torch::nn::Sequential& model) {
  std::vector<ShardedUnit> units;
  for (size_t i = 0; i < model->size(); ++i) {
    auto params = model->ptr(i)->parameters();
    if (!params.empty()) units.push_back({std::to_string(i), std::move(params)});
  }
  return units;
}

at::Tensor forward_sequential(FullyShardedDataParallel& fsdp, torch::nn::Sequential& model,
                              at::Tensor input) {
  at::Tensor x = std::move(input);
  size_t index = 0;
  for (auto& module : *model) {
    if (module.ptr()->parameters().empty()) {
      x = module.forward(x);
    } else {
      // Mixed precision: the unit computes in the gathered parameters' dtype.
      if (fsdp.param_dtype() && x.is_floating_point()) x = x.to(*fsdp.param_dtype());
      x = fsdp.forward(fsdp.unit_index(std::to_string(index)), [&] { return module.forward(x); });
    }
    ++index;
  }
  return x;
}

}  // namespace shampoo
