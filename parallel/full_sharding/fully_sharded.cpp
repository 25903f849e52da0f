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
#include "parallel/full_sharding/fully_sharded_checkpoint.h"

namespace shampoo {

/// Its ScaledStepping: what a GradScaler given the model (or its optimizer()) unscales and steps.
class FullyShardedDataParallel::Scaling final : public ScaledStepping {
 public:
  explicit Scaling(FullyShardedDataParallel& owner) : owner_(owner) {}

  std::vector<at::Tensor> gradients_to_unscale(const char* caller) override {
    TORCH_CHECK(!owner_.options().overlap_step(), caller,
                ": this FullyShardedDataParallel steps each unit during backward (overlap_step, "
                "the default), before every gradient is known to be finite, so the scaler cannot "
                "skip a step; construct it with FullyShardedOptions().overlap_step(false)");
    return owner_.reduced_gradients();
  }
  void scaled_step() override { owner_.step(); }
  void skip_scaled_step() override { owner_.skip_step(); }
  void unscaled_step() override {
    if (!owner_.options().overlap_step()) owner_.step();  // with overlap it ran in backward
  }

 private:
  FullyShardedDataParallel& owner_;
};

namespace {

/// The ranks were given the same options where they decide the collectives (before any other
/// collective, so that a rank set otherwise is an error on every rank, not a crash or a hang).
void check_options_agree(c10d::ProcessGroup& group, const FullyShardedOptions& options,
                         bool param_groups) {
  using Setting = detail::SharedSetting;
  detail::check_settings_agree(
      group, detail::kFsdpWho,
      {Setting{"FullyShardedOptions.step_mode", static_cast<int64_t>(options.step_mode()),
               [](int64_t mode) -> std::string {
                 return mode == static_cast<int64_t>(ShardedStepMode::kLossless) ? "kLossless"
                                                                                 : "kLocalShard";
               }},
       Setting::flag("FullyShardedOptions.reshard_after_forward", options.reshard_after_forward()),
       Setting::flag("FullyShardedOptions.overlap_step", options.overlap_step()),
       Setting::number("FullyShardedOptions.accumulation_steps", options.accumulation_steps()),
       Setting::flag("FullyShardedOptions.broadcast_parameters", options.broadcast_parameters()),
       Setting::dtype("FullyShardedOptions.param_dtype", options.param_dtype()),
       Setting::dtype("FullyShardedOptions.reduce_dtype", options.reduce_dtype()),
       Setting::flag("FullyShardedOptions.undo_failed_steps", options.undo_failed_steps()),
       Setting::flag("FullyShardedOptions.replica_group (set)",
                     static_cast<bool>(options.replica_group())),
       Setting::flag("FullyShardedOptions.split_across_replicas", options.split_across_replicas()),
       Setting::flag("param groups (given to the constructor)", param_groups)});
}

/// Checks the options and arguments, then sets up `s` (the wrapper's state): its mesh, units,
/// optimizers and hooks.
void initialize(FullyShardedDataParallel& fsdp, detail::FsdpState& s,
                std::vector<ShardedUnit> units,
                std::optional<std::vector<torch::optim::OptimizerParamGroup>> param_groups,
                GroupOptimizerFactory factory, c10::intrusive_ptr<c10d::ProcessGroup> group,
                const FullyShardedOptions& options) {
  TORCH_CHECK(!param_groups || options.step_mode() == ShardedStepMode::kLossless, detail::kFsdpWho,
              "param groups need step_mode kLossless (local shards step a unit's rows with one "
              "optimizer)");
  TORCH_CHECK(group, detail::kFsdpWho, "the process group is null");
  TORCH_CHECK(factory, detail::kFsdpWho, "the optimizer factory is empty");
  check_options_agree(*group, options, param_groups.has_value());
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
  s.setup(fsdp, std::move(units), std::move(param_groups));
}

}  // namespace

FullyShardedDataParallel::FullyShardedDataParallel(std::vector<ShardedUnit> units,
                                                   GroupOptimizerFactory factory,
                                                   c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                   FullyShardedOptions options)
    : state_(std::make_shared<detail::FsdpState>()), scaling_(std::make_unique<Scaling>(*this)) {
  initialize(*this, *state_, std::move(units), std::nullopt, std::move(factory), std::move(group),
             options);
  checkpoint_ = std::make_unique<detail::FsdpCheckpoint>(*state_);
}

FullyShardedDataParallel::FullyShardedDataParallel(
    std::vector<ShardedUnit> units, std::vector<torch::optim::OptimizerParamGroup> param_groups,
    GroupOptimizerFactory factory, c10::intrusive_ptr<c10d::ProcessGroup> group,
    FullyShardedOptions options)
    : state_(std::make_shared<detail::FsdpState>()), scaling_(std::make_unique<Scaling>(*this)) {
  initialize(*this, *state_, std::move(units), std::move(param_groups), std::move(factory),
             std::move(group), options);
  checkpoint_ = std::make_unique<detail::FsdpCheckpoint>(*state_);
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

at::Tensor FullyShardedDataParallel::forward(size_t unit, const std::function<at::Tensor()>& fn) {
  TORCH_CHECK(unit < state_->units.size(), detail::kFsdpWho, "unit ", unit, " does not exist (",
              state_->units.size(), " units)");
  return state_->forward(unit, fn);
}

void FullyShardedDataParallel::step() { state_->step_all("step()"); }

void FullyShardedDataParallel::wait() { state_->wait_all(); }

std::vector<at::Tensor> FullyShardedDataParallel::reduced_gradients() {
  return state_->reduced_gradients("reduced_gradients()");
}

void FullyShardedDataParallel::skip_step() { state_->skip_all(); }

ScaledStepping& FullyShardedDataParallel::scaling_target() { return *scaling_; }

double FullyShardedDataParallel::clip_grad_norm_(double max_norm, double norm_type) {
  std::vector<at::Tensor> all;
  for (const auto& unit : state_->units) {
    for (const auto& slot : unit->params) all.push_back(slot.param);
  }
  return state_->clip_grad_norm(all, max_norm, norm_type, "clip_grad_norm_");
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

const FullyShardedOptions& FullyShardedDataParallel::options() const { return state_->options; }

FullyShardedStats FullyShardedDataParallel::stats() const {
  FullyShardedStats out;
  out.backward_passes = state_->pass.passes();
  out.steps_taken = state_->steps;
  for (const auto& unit : state_->units) {
    for (const auto& slot : unit->params) {
      out.shard_bytes += static_cast<int64_t>(slot.shard.nbytes());
      if (slot.reduced.defined()) out.gradient_bytes += static_cast<int64_t>(slot.reduced.nbytes());
      out.gathered_bytes +=
          static_cast<int64_t>(slot.param.unsafeGetTensorImpl()->storage().nbytes());
    }
  }
  return out;
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
      const auto dtype = fsdp.options().param_dtype();
      if (dtype && x.is_floating_point()) x = x.to(*dtype);
      x = fsdp.forward(fsdp.unit_index(std::to_string(index)), [&] { return module.forward(x); });
    }
    ++index;
  }
  return x;
}

}  // namespace shampoo
