// Full sharding: the param groups of optimizer() (the user's), their registration across ranks and
// their options copied into the optimizers.
#include "parallel/full_sharding/fully_sharded_groups.h"

#include <ATen/core/grad_mode.h>

#include <typeinfo>

#include "parallel/communication/collectives.h"
#include "parallel/full_sharding/fully_sharded_state.h"

namespace shampoo::detail {
FsdpGroups::FsdpGroups(FsdpState& state)
    : state_(state), push_(kFsdpWho, "optimizer()", "optimizers()") {}

LocalOptimizer::GroupOptions FsdpGroups::options_of() {
  return [this](size_t g) -> const torch::optim::OptimizerOptions& {
    return facade_->param_groups().at(g).options();
  };
}

void FsdpGroups::push_options() {
  std::vector<LocalOptimizer*> driven;
  if (state_.rank_optimizer) driven.push_back(state_.rank_optimizer.get());
  for (auto& unit : state_.units) {
    if (unit->optimizer) driven.push_back(unit->optimizer.get());
  }
  // Local shards: one param group, group 0 of every unit's optimizer.
  push_.push(facade_->param_groups(), driven, /*single_group=*/!state_.lossless());
}

void FsdpGroups::add_group(size_t g) {
  const auto& options = facade_->param_groups()[g].options();
  TORCH_CHECK(typeid(options) == typeid(facade_->defaults()), kFsdpWho, "param group ", g,
              ": its options are a ", c10::demangle(typeid(options).name()),
              ", but the factory's optimizers take ",
              c10::demangle(typeid(facade_->defaults()).name()));
  sizes_.push_back(0);
  push_.add_group(options);
}

std::vector<at::Tensor> FsdpGroups::register_params(size_t g, size_t first) {
  const auto& params = facade_->param_groups()[g].params();
  std::string error;
  std::vector<int64_t> positions;
  std::unordered_map<const c10::TensorImpl*, size_t> fresh;
  for (size_t i = first; i < params.size() && error.empty(); ++i) {
    const auto where = "param group " + std::to_string(g) + ": parameter " + std::to_string(i);
    const auto* impl = params[i].defined() ? params[i].unsafeGetTensorImpl() : nullptr;
    const auto found = state_.slot_of.find(impl);
    if (found == state_.slot_of.end()) {
      error = where + " is no unit's parameter (optimizer() steps the units' parameters)";
      continue;
    }
    const auto [u, k] = found->second;
    if (state_.unit(u).params[k].in_a_group() || !fresh.emplace(impl, i).second) {
      error = where + " is already in a param group (a parameter belongs to one group)";
    } else {
      positions.push_back(static_cast<int64_t>(u));
      positions.push_back(static_cast<int64_t>(k));
    }
  }
  // The positions, as every rank must have them.
  const auto all =
      gather_int64(*state_.mesh.group, {error.empty() ? 0 : 1, fingerprint(positions)});
  TORCH_CHECK(error.empty(), kFsdpWho, error);
  for (int r = 0; r < state_.mesh.world; ++r) {
    TORCH_CHECK(all[r][0] == 0, kFsdpWho, "adding param group ", g, " failed on rank ", r,
                " (its error says why)");
    TORCH_CHECK(all[r][1] == all[0][1], kFsdpWho, "param group ", g,
                " holds other parameters on rank ", r,
                " than on rank 0; every rank must pass the same groups");
  }
  std::vector<at::Tensor> added(params.begin() + static_cast<int64_t>(first), params.end());
  for (const auto& p : added) {
    auto& slot = state_.slot_for(p);
    slot.param_group = static_cast<int>(g);
    slot.joined_at = state_.steps;
  }
  sizes_[g] += added.size();
  return added;
}

void FsdpGroups::add_later_params(const std::vector<at::Tensor>& added, size_t g) {
  TORCH_CHECK(state_.lossless(), kFsdpWho,
              "param groups added after construction need step_mode kLossless");
  at::NoGradGuard no_grad;
  for (const auto& p : added) {
    const auto [u, i] = state_.position_of(p);
    auto& unit = state_.unit(u);
    auto& slot = unit.params[i];
    TORCH_CHECK(!unit.gathered, kFsdpWho, "param group ", g,
                ": add param groups between iterations (unit '", unit.name, "' is gathered)");
    unit.materialize(slot,
                     "the all-gather of a parameter joining param group " + std::to_string(g));
    if (slot.steps_on(state_.mesh)) state_.rank_optimizer->add(g, {slot.param}, options_of());
    release_full(slot.param, unit.dtype);
  }
}

void FsdpGroups::sync() {
  if (!facade_) return;
  auto& groups = facade_->param_groups();
  bool added = false;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (g >= sizes_.size()) add_group(g);
    if (groups[g].params().size() > sizes_[g]) {
      add_later_params(register_params(g, sizes_[g]), g);
      added = true;
    }
  }
  if (added) write_state_entries();
}

void FsdpGroups::forget_after(size_t before) {
  if (sizes_.size() > before && sizes_.back() == 0) {
    sizes_.pop_back();
    push_.pop_group();
  }
}

void FsdpGroups::install_options(
    std::vector<std::unique_ptr<torch::optim::OptimizerOptions>>& options) {
  auto& groups = facade_->param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    groups[g].set_options(std::move(options[g]));
    push_.replaced(g);  // copied into the optimizers at the next defined point
  }
}

void FsdpGroups::write_state_entries() {
  if (!facade_) return;
  auto& entries = facade_->state();
  for (const auto& unit : state_.units) {
    for (const auto& slot : unit->params) {
      if (!slot.in_a_group()) continue;
      auto& entry = entries[slot.param.unsafeGetTensorImpl()];
      auto* mine = dynamic_cast<ShardedParamState*>(entry.get());
      if (mine == nullptr) {
        entry = std::make_unique<ShardedParamState>();
        mine = static_cast<ShardedParamState*>(entry.get());
      }
      mine->step(state_.steps - slot.joined_at).owner(slot.owner);
    }
  }
}

void FsdpGroups::make(FullyShardedDataParallel& owner,
                      std::optional<std::vector<torch::optim::OptimizerParamGroup>> given) {
  const ParamSlot* smallest = nullptr;
  for (const auto& unit : state_.units) {
    for (const auto& slot : unit->params) {
      if (smallest == nullptr || slot.numel() < smallest->numel()) smallest = &slot;
    }
  }
  std::unique_ptr<torch::optim::OptimizerOptions> defaults;
  std::unique_ptr<torch::optim::OptimizerOptions> first_options;
  {
    auto probe = state_.factory(torch::optim::OptimizerParamGroup({smallest->param}));
    TORCH_CHECK(probe != nullptr, kFsdpWho, "the optimizer factory returned null");
    defaults = probe->defaults().clone();
    first_options = probe->param_groups().at(0).options().clone();
  }
  if (!given) {
    std::vector<at::Tensor> all;
    for (const auto& unit : state_.units) {
      for (const auto& slot : unit->params) all.push_back(slot.param);
    }
    given.emplace();
    given->emplace_back(std::move(all), std::move(first_options));
  }
  facade_.reset(new FullyShardedOptimizer(owner, {}, std::move(defaults)));
  for (size_t g = 0; g < given->size(); ++g) {
    facade_->torch::optim::Optimizer::add_param_group((*given)[g]);
    add_group(g);
    register_params(g, 0);
  }
}

}  // namespace shampoo::detail

namespace shampoo {

// ----- optimizer(): the model's optimizer as LibTorch code holds one -----

torch::optim::Optimizer& FullyShardedDataParallel::optimizer() {
  return state_->groups.optimizer();
}

FullyShardedOptimizer::FullyShardedOptimizer(
    FullyShardedDataParallel& owner, std::vector<torch::optim::OptimizerParamGroup> groups,
    std::unique_ptr<torch::optim::OptimizerOptions> defaults)
    : torch::optim::Optimizer(std::move(groups), std::move(defaults)), owner_(owner) {}

ScaledStepping& FullyShardedOptimizer::scaling_target() { return owner_.scaling_target(); }

double FullyShardedOptimizer::clip_grad_norm_(double max_norm, double norm_type) {
  std::vector<at::Tensor> params;
  for (const auto& group : param_groups()) {
    params.insert(params.end(), group.params().begin(), group.params().end());
  }
  return owner_.state_->clip_grad_norm(params, max_norm, norm_type, "clip_grad_norm_");
}

torch::Tensor FullyShardedOptimizer::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure) {
    c10::AutoGradMode enable_grad(true);
    loss = closure();  // its backward steps the units, with overlap_step
  }
  auto& s = *owner_.state_;
  if (!s.options.overlap_step()) s.step_all("optimizer().step()");
  return loss;
}

void FullyShardedOptimizer::add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
  auto& s = *owner_.state_;
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  s.groups.sync();  // groups appended through the base class before this one
  const size_t before = param_groups_.size();
  torch::optim::Optimizer::add_param_group(param_group);
  try {
    s.groups.sync();
  } catch (...) {  // checked on every rank before anything was registered
    s.groups.forget_after(before);
    param_groups_.erase(param_groups_.begin() + static_cast<int64_t>(before), param_groups_.end());
    throw;
  }
}

void FullyShardedOptimizer::save(torch::serialize::OutputArchive&) const {
  TORCH_CHECK(false, detail::kFsdpWho,
              "torch::save(optimizer) cannot hold a fully sharded model's state (each rank has "
              "its rows and the state of the parameters it owns); save with "
              "shampoo::save_distributed_checkpoint(optimizer, dir) (or "
              "save_distributed_state(fsdp, dir)), which also holds the parameters");
}

void FullyShardedOptimizer::load(torch::serialize::InputArchive&) {
  TORCH_CHECK(false, detail::kFsdpWho,
              "torch::load(optimizer) cannot restore a fully sharded model; load with "
              "shampoo::load_distributed_checkpoint(optimizer, dir) (or "
              "load_distributed_state(fsdp, dir))");
}

DistributedCheckpointable& FullyShardedOptimizer::checkpoint_delegate() const { return owner_; }

}  // namespace shampoo
