// Full sharding: the param groups of optimizer() (the user's), their registration across ranks and
// their options copied into the optimizers.
#include <ATen/core/grad_mode.h>

#include <sstream>
#include <typeinfo>

#include "parallel/communication/collectives.h"
#include "parallel/full_sharding/fully_sharded_state.h"

namespace shampoo {

/// The options as bytes, to notice a change (OptimizerOptions has no operator==).
std::string FullyShardedDataParallel::State::options_bytes(
    const torch::optim::OptimizerOptions& options) {
  torch::serialize::OutputArchive archive;
  options.serialize(archive);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

/// Copies each group's options into the optimizers of its parameters where they changed since
/// the last copy: the one point per iteration where options take effect (the start of backward
/// with overlap, of step() without). Options set on one of optimizers() directly stay until
/// then.
void FullyShardedDataParallel::State::push_group_options() {
  auto& groups = facade->param_groups();
  for (size_t g = 0; g < group_sizes.size(); ++g) {
    auto bytes = options_bytes(groups[g].options());
    if (bytes == pushed[g]) continue;
    if (rank_optimizer) rank_optimizer->set_options(g, groups[g].options());
    for (auto& unit : units) {
      if (unit->optimizer) unit->optimizer->set_options(0, groups[g].options());
    }
    pushed[g] = std::move(bytes);
  }
}

/// Registers the parameters of param group `g` from position `first` on: unit parameters in
/// no other group, the same on every rank (checked before anything changes, then agreed on).
/// Returns the registered parameters. Collective.
std::vector<at::Tensor> FullyShardedDataParallel::State::register_group_params(size_t g,
                                                                               size_t first) {
  const auto& params = facade->param_groups()[g].params();
  std::string error;
  std::vector<int64_t> positions;
  std::unordered_map<const c10::TensorImpl*, size_t> fresh;
  for (size_t i = first; i < params.size() && error.empty(); ++i) {
    const auto where = "param group " + std::to_string(g) + ": parameter " + std::to_string(i);
    const auto slot = params[i].defined() ? slot_of.find(impl_of(params[i])) : slot_of.end();
    if (slot == slot_of.end()) {
      error = where + " is no unit's parameter (optimizer() steps the units' parameters)";
    } else if (group_of.count(impl_of(params[i])) != 0 ||
               !fresh.emplace(impl_of(params[i]), i).second) {
      error = where + " is already in a param group (a parameter belongs to one group)";
    } else {
      positions.push_back(static_cast<int64_t>(slot->second.first));
      positions.push_back(static_cast<int64_t>(slot->second.second));
    }
  }
  // The positions, as every rank must have them.
  const auto all =
      detail::gather_int64(*group, {error.empty() ? 0 : 1, detail::fingerprint(positions)});
  TORCH_CHECK(error.empty(), kWho, error);
  for (int r = 0; r < world; ++r) {
    TORCH_CHECK(all[r][0] == 0, kWho, "adding param group ", g, " failed on rank ", r,
                " (its error says why)");
    TORCH_CHECK(all[r][1] == all[0][1], kWho, "param group ", g, " holds other parameters on rank ",
                r,
                " than on rank 0; every rank must pass "
                "the same groups");
  }
  std::vector<at::Tensor> added(params.begin() + static_cast<int64_t>(first), params.end());
  for (const auto& p : added) {
    group_of[impl_of(p)] = g;
    joined_at[impl_of(p)] = steps;
  }
  group_sizes[g] += added.size();
  return added;
}

/// Parameters that joined a group after construction (lossless): every rank gathers each one's
/// full value (collective), its owner adds it to its optimizer. Only between iterations, when
/// no unit is gathered.
void FullyShardedDataParallel::State::add_later_params(const std::vector<at::Tensor>& added,
                                                       size_t g) {
  TORCH_CHECK(lossless(), kWho, "param groups added after construction need step_mode kLossless");
  at::NoGradGuard no_grad;
  for (const auto& p : added) {
    const auto [u, i] = position_of(p);
    auto& unit = this->unit(u);
    auto& slot = unit.params[i];
    TORCH_CHECK(!unit.gathered, kWho, "param group ", g,
                ": add param groups between iterations (unit '", unit.name, "' is gathered)");
    materialize(unit, slot,
                "the all-gather of a parameter joining param group " + std::to_string(g));
    if (steps_here(slot)) rank_optimizer->add(g, {slot.param}, group_options());
    detail::release_full(slot.param, unit.dtype);
  }
}

/// Registers what was appended to optimizer()'s param groups since the last call (through its
/// add_param_group, or the base class's add_param_group or add_parameters). Collective when
/// something was; only between iterations.
void FullyShardedDataParallel::State::sync_groups() {
  if (!facade) return;
  auto& groups = facade->param_groups();
  bool added = false;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (g >= group_sizes.size()) {
      TORCH_CHECK(typeid(groups[g].options()) == typeid(facade->defaults()), kWho, "param group ",
                  g, ": its options are a ", c10::demangle(typeid(groups[g].options()).name()),
                  ", but the factory's optimizers take ",
                  c10::demangle(typeid(facade->defaults()).name()));
      group_sizes.push_back(0);
      pushed.push_back(options_bytes(groups[g].options()));
    }
    if (groups[g].params().size() > group_sizes[g]) {
      add_later_params(register_group_params(g, group_sizes[g]), g);
      added = true;
    }
  }
  if (added) write_state_entries();
}

/// state() of optimizer(): per parameter of a group, its steps since it joined and its owner.
void FullyShardedDataParallel::State::write_state_entries() {
  if (!facade) return;
  auto& state = facade->state();
  for (const auto& [impl, g] : group_of) {
    auto& entry = state[const_cast<c10::TensorImpl*>(impl)];
    auto* mine = dynamic_cast<ShardedParamState*>(entry.get());
    if (mine == nullptr) {
      entry = std::make_unique<ShardedParamState>();
      mine = static_cast<ShardedParamState*>(entry.get());
    }
    const auto [u, i] = slot_of.at(impl);
    mine->step(steps - joined_at.at(impl)).owner(unit(u).params[i].owner);
  }
}

/// optimizer(): its defaults and, without the user's groups, its one group's options are the
/// factory's, read off an optimizer the factory makes over the smallest parameter (while the
/// parameters are still whole) and then drops. Then the groups' parameters are registered.
void FullyShardedDataParallel::State::make_facade(
    FullyShardedDataParallel& owner,
    std::optional<std::vector<torch::optim::OptimizerParamGroup>> given) {
  const ParamSlot* smallest = nullptr;
  for (const auto& unit : units) {
    for (const auto& slot : unit->params) {
      if (smallest == nullptr || slot.numel() < smallest->numel()) smallest = &slot;
    }
  }
  std::unique_ptr<torch::optim::OptimizerOptions> defaults;
  std::unique_ptr<torch::optim::OptimizerOptions> first_options;
  {
    auto probe = factory(torch::optim::OptimizerParamGroup({smallest->param}));
    TORCH_CHECK(probe != nullptr, kWho, "the optimizer factory returned null");
    defaults = probe->defaults().clone();
    first_options = probe->param_groups().at(0).options().clone();
  }
  user_groups = given.has_value();
  if (!given) {
    std::vector<at::Tensor> all;
    for (const auto& unit : units) {
      for (const auto& slot : unit->params) all.push_back(slot.param);
    }
    given.emplace();
    given->emplace_back(std::move(all), std::move(first_options));
  }
  facade.reset(new FullyShardedOptimizer(owner, {}, std::move(defaults)));
  for (size_t g = 0; g < given->size(); ++g) {
    facade->torch::optim::Optimizer::add_param_group((*given)[g]);
    const auto& options = facade->param_groups()[g].options();
    TORCH_CHECK(typeid(options) == typeid(facade->defaults()), kWho, "param group ", g,
                ": its options are a ", c10::demangle(typeid(options).name()),
                ", but the factory's optimizers take ",
                c10::demangle(typeid(facade->defaults()).name()));
    group_sizes.push_back(0);
    pushed.push_back(options_bytes(options));
    register_group_params(g, 0);
  }
}

// ----- optimizer(): the model's optimizer as LibTorch code holds one -----

torch::optim::Optimizer& FullyShardedDataParallel::optimizer() { return *state_->facade; }

FullyShardedOptimizer::FullyShardedOptimizer(
    FullyShardedDataParallel& owner, std::vector<torch::optim::OptimizerParamGroup> groups,
    std::unique_ptr<torch::optim::OptimizerOptions> defaults)
    : torch::optim::Optimizer(std::move(groups), std::move(defaults)), owner_(owner) {}

ScaledStepping& FullyShardedOptimizer::scaling_target() { return owner_; }

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
  s.sync_groups();  // groups appended through the base class before this one
  const size_t before = param_groups_.size();
  torch::optim::Optimizer::add_param_group(param_group);
  try {
    s.sync_groups();
  } catch (...) {  // checked on every rank before anything was registered
    if (s.group_sizes.size() > before && s.group_sizes.back() == 0) {
      s.group_sizes.pop_back();
      s.pushed.pop_back();
    }
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
