// The engine's group-merging front end (group_front_end.h): registering groups and parameters
// (also those appended through the torch::optim::Optimizer base class), their block plans,
// merging groups into virtual groups and rebuilding them, the checks that a group's structure did
// not change, what the registry answers about a parameter.
#include "shampoo/group_front_end.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <variant>
#include <vector>

#include "parallel/optimizers/parameter_owners.h"
#include "preconditioners/iterative_roots.h"
#include "shampoo/factor_choice.h"
#include "shampoo/option_fields.h"
#include "shampoo/rank_agreement.h"
#include "shampoo/step_scalars.h"

namespace shampoo::detail {

namespace {

/// RootSolver::kNewtonSchulz computes roots that are powers of two only (as the reference, which
/// refuses other roots at construction): a parameter with a block whose exponent along some dim
/// is another 1/p is an error naming it, the block, the dim and the way out.
void check_newton_schulz_roots(const ShampooOptions& options, const BlockPlan& plan,
                               const std::string& parameter) {
  const auto* config = root_inverse_config(options.preconditioner());
  if (config == nullptr || config->solver != RootSolver::kNewtonSchulz) return;
  for (size_t b = 0; b < plan.blocks.size(); ++b) {
    const auto& shape = plan.blocks[b].sizes;
    const auto exponents = block_factor_choice(options, plan, shape).dim_exponents;
    for (size_t k = 0; k < exponents.size(); ++k) {
      const double e = exponents[k];
      TORCH_CHECK(e == 0.0 || power_of_two_root(integer_root(e)), parameter, ": block ", b,
                  " has shape ", at::IntArrayRef(shape), " (order ", shape.size(),
                  ") and the inverse exponent ", e, " along dim ", k,
                  ", but RootSolver::kNewtonSchulz computes roots 1/p for p a power of two "
                  "(blocks of order 1, 2 and 4 by default). Give this parameter a param group "
                  "with another solver, or set inverse_exponent_override for order ",
                  shape.size(), " to such an exponent");
    }
  }
}

/// The reference's warning about a Newton–Schulz schedule whose last (a, b, c) does not sum to 1
/// (the iteration then has no fixed point at the root), once per param group when it is added.
void warn_newton_schulz_schedule(const ShampooOptions& options, size_t group) {
  const auto* config = root_inverse_config(options.preconditioner());
  if (config == nullptr || config->solver != RootSolver::kNewtonSchulz) return;
  const auto& last = config->coefficients.back();
  const double sum = last[0] + last[1] + last[2];
  if (std::abs(sum - 1.0) <= 1e-9 * std::max(1.0, std::abs(sum))) return;
  TORCH_WARN("param group ", group, ": preconditioner.coefficients: the last (a, b, c) sums to ",
             sum,
             ", not 1: the Newton–Schulz iteration has no fixed point at 1 and ends in a band "
             "around the inverse root, not at it");
}

/// The block plans of a new group's parameters. A family whose blocks must have a given order
/// (spectral descent: 2-D blocks, its list's kBlockOrder) makes a parameter whose plan has a block
/// of another order an error naming it, its shape, its blocks and the ways out (docs/math.md,
/// "Spectral descent").
std::vector<BlockPlan> block_plans(const ShampooOptions& options,
                                   const std::vector<at::Tensor>& params, size_t group,
                                   size_t first_param) {
  std::vector<BlockPlan> plans;
  const int64_t order = block_target_order(options);
  const char* family =
      std::visit([](const auto& c) { return family_name(c); }, options.preconditioner());
  for (size_t i = 0; i < params.size(); ++i) {
    plans.push_back(make_block_plan(params[i].sizes(), options.max_preconditioner_dim(),
                                    options.use_merge_dims(), order));
    check_newton_schulz_roots(
        options, plans.back(),
        c10::str("param group ", group, ": parameter ", i, " (parameter ", first_param + i,
                 " overall, shape ", params[i].sizes(), ")"));
    if (order == 1) continue;
    for (size_t b = 0; b < plans.back().blocks.size(); ++b) {
      const auto& shape = plans.back().blocks[b].sizes;
      TORCH_CHECK(
          static_cast<int64_t>(shape.size()) == order, "param group ", group, ": parameter ", i,
          " (parameter ", first_param + i, " overall, shape ", params[i].sizes(), "): ", family,
          " preconditions ", order, "-D blocks only, but its block ", b, " has shape ",
          at::IntArrayRef(shape), " (", shape.size(),
          "-D). Blocking drops size-1 dims, merges trailing dims down to ", order,
          " while their product stays <= max_preconditioner_dim (",
          options.max_preconditioner_dim(), ", use_merge_dims ",
          options.use_merge_dims() ? "true" : "false",
          ") and splits dims larger than it. Put the parameters of other orders (biases, norm "
          "scales, scalars) into a param group with another preconditioner, or, for a parameter "
          "of more dims, enable use_merge_dims and raise max_preconditioner_dim so that its dims "
          "merge into ",
          order);
    }
  }
  return plans;
}

void add_counters(AmortizedCounters& sum, const AmortizedCounters& more) {
  sum.computations += more.computations;
  sum.failures += more.failures;
  sum.retried_in_double += more.retried_in_double;
  sum.solver_fallbacks += more.solver_fallbacks;
  sum.batched_calls += more.batched_calls;
}

}  // namespace

void resolve_peak_lr(ShampooOptions& options) {
  if (options.peak_lr() == -1.0) options.peak_lr(options.lr());
}

ShampooOptions& options_of(torch::optim::OptimizerParamGroup& group, size_t index) {
  return const_cast<ShampooOptions&>(
      options_of(static_cast<const torch::optim::OptimizerParamGroup&>(group), index));
}

const ShampooOptions& options_of(const torch::optim::OptimizerParamGroup& group, size_t index) {
  const auto* options = dynamic_cast<const ShampooOptions*>(&group.options());
  TORCH_CHECK(options != nullptr, "param group ", index,
              ": options must be shampoo::ShampooOptions (a group added with another "
              "optimizer's options, e.g. torch::optim::AdamOptions, cannot be stepped by "
              "DistributedShampoo)");
  return *options;
}

GroupFrontEnd::GroupFrontEnd(const ShampooOptions& defaults, const DistributedOptions& distributed,
                             Distributor& distributor)
    : defaults_(defaults), distributed_(distributed), distributor_(distributor) {}

void GroupFrontEnd::add_group(const torch::optim::OptimizerParamGroup& group,
                              std::vector<torch::optim::OptimizerParamGroup>& groups) {
  // Groups appended through the base class first, so that this one keeps its index.
  register_added(groups);
  const size_t index = groups.size();
  std::unique_ptr<torch::optim::OptimizerOptions> options;
  if (group.has_options()) {
    const auto* shampoo_options = dynamic_cast<const ShampooOptions*>(&group.options());
    TORCH_CHECK(shampoo_options != nullptr, "param group ", index,
                ": options must be shampoo::ShampooOptions (got another optimizer's options)");
    options = std::make_unique<ShampooOptions>(*shampoo_options);
  } else {
    options = std::make_unique<ShampooOptions>(defaults_);
  }
  try {
    static_cast<const ShampooOptions&>(*options).validate();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "param group ", index, ": ", e.msg());
  }
  registry.check_new_params(group.params(), index);
  block_plans(static_cast<const ShampooOptions&>(*options), group.params(), index,
              registry.params.size());
  groups.emplace_back(group.params(), std::move(options));
  register_added(groups);
}

bool GroupFrontEnd::register_added(std::vector<torch::optim::OptimizerParamGroup>& groups) {
  // torch::optim::Optimizer::add_param_group and add_parameters are not virtual: through a
  // base-class reference they append a group (with a copy of its options, or of the defaults) or
  // parameters (to group 0) to param_groups() without telling this engine. Whatever was appended
  // since the last call is registered here, as DistributedShampoo::add_param_group registers it:
  // checked in full first, then blocks, owners and virtual groups (merged where it can be).
  const size_t registered = group_steps.size();
  struct Added {
    size_t group;
    size_t first;  // of the group's parameters, the first not registered
    std::vector<BlockPlan> plans;
  };
  std::vector<Added> added;
  std::unordered_map<const void*, size_t> claimed;  // among the parameters being added
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& params = groups[g].params();
    const size_t first = g < registered ? static_cast<size_t>(registry.group_sizes[g]) : 0;
    if (g < registered && params.size() <= first) continue;  // fewer: check() says so
    const auto& options = options_of(groups[g], g);
    if (g >= registered) {
      try {
        options.validate();
      } catch (const c10::Error& e) {
        TORCH_CHECK(false, "param group ", g,
                    " (added through torch::optim::Optimizer): ", e.msg());
      }
    }
    registry.check_new_params(params, g, first);
    for (size_t i = first; i < params.size(); ++i) {
      const auto [it, fresh] = claimed.emplace(params[i].unsafeGetTensorImpl(), g);
      TORCH_CHECK(fresh, "param group ", g, ": parameter ", i, " is also in param group ",
                  it->second, " (a tensor may belong to one group only)");
    }
    const std::vector<at::Tensor> fresh_params(params.begin() + static_cast<int64_t>(first),
                                               params.end());
    added.push_back({g, first, block_plans(options, fresh_params, g, registry.params.size())});
  }
  if (added.empty()) return false;
  for (const auto& a : added) {
    if (a.first == 0) warn_newton_schulz_schedule(options_of(groups[a.group], a.group), a.group);
  }
  for (auto& a : added) {
    const auto& params = groups[a.group].params();
    registry.add(
        std::vector<at::Tensor>(params.begin() + static_cast<int64_t>(a.first), params.end()),
        static_cast<int64_t>(a.group), std::move(a.plans));
    if (a.group >= registered) {
      group_steps.push_back(0);
      group_lr_sums.push_back(0.0);
      auto& options = options_of(groups[a.group], a.group);
      resolve_peak_lr(options);
      group_peak_lrs.push_back(options.peak_lr());
    }
  }
  check_ranks_agree(distributor_, groups, registry);
  rebuild(groups, /*require_all=*/false);
  return true;
}

void GroupFrontEnd::rebuild(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                            bool require_all) {
  auto states = export_states();
  auto built = build_virtual_groups(groups);
  for (auto& vg : built) vg->import_states(states, require_all);
  replace_virtual_groups(std::move(built));
}

void GroupFrontEnd::replace_virtual_groups(std::vector<std::unique_ptr<VirtualGroup>> built) {
  for (const auto& vg : virtual_groups) add_counters(retired_counters_, vg->counters());
  virtual_groups = std::move(built);
}

void GroupFrontEnd::write_state_entries(
    ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>>& state) const {
  for (const auto& entry : registry.params) {
    auto& slot = state[entry.param.unsafeGetTensorImpl()];
    auto* mine = dynamic_cast<ShampooParamState*>(slot.get());
    if (mine == nullptr) {
      slot = std::make_unique<ShampooParamState>();
      mine = static_cast<ShampooParamState*>(slot.get());
    }
    mine->step(group_steps.at(static_cast<size_t>(entry.group)))
        .param_group(entry.group)
        .num_blocks(static_cast<int64_t>(entry.plan.blocks.size()));
  }
}

AmortizedCounters GroupFrontEnd::counters() const {
  AmortizedCounters sum = retired_counters_;
  for (const auto& vg : virtual_groups) add_counters(sum, vg->counters());
  return sum;
}

void GroupFrontEnd::set_failure_injector(FailureInjector fn,
                                         std::vector<torch::optim::OptimizerParamGroup>& groups) {
  inject_failure_ = std::move(fn);
  rebuild(groups, /*require_all=*/true);
}

bool GroupFrontEnd::any_averaging() const {
  return std::any_of(virtual_groups.begin(), virtual_groups.end(),
                     [](const auto& vg) { return averaging_enabled(vg->structural_options()); });
}

int64_t GroupFrontEnd::param_index(const at::Tensor& param) const {
  return registry.index_of(param);
}

std::optional<int> GroupFrontEnd::param_owner(const at::Tensor& param) const {
  const int64_t p = param_index(param);
  if (p < 0) return std::nullopt;
  TORCH_CHECK(distributor_.distributed(),
              "DistributedShampoo: no process group (DistributedOptions::process_group), so every "
              "rank steps every parameter: gradient sharding needs a distributed optimizer");
  TORCH_CHECK(distributor_.world_size() == distributor_.global_world_size(),
              "DistributedShampoo: gradient sharding reduces each gradient to one rank of the "
              "whole process group, but DistributedOptions.num_trainers_per_group (",
              distributed_.num_trainers_per_group(),
              ") splits the blocks over subgroups; use num_trainers_per_group -1");
  const auto& entry = registry.params[p];
  const auto first = entry.first_block;
  const auto count = static_cast<int64_t>(entry.plan.blocks.size());
  if (count == 0) return ParameterOwners::kEveryRank;
  const int owner = distributor_.owner(first);
  for (int64_t b = first + 1; b < first + count; ++b) {
    TORCH_CHECK(distributor_.owner(b) == owner, "DistributedShampoo: the blocks of parameter ", p,
                " (shape ", entry.param.sizes(), ", ", count, " blocks) are owned by ranks ", owner,
                " and ", distributor_.owner(b),
                "; gradient sharding needs every block of a parameter on one rank: build the "
                "optimizer with DistributedOptions().shard_by_parameter(true)");
  }
  return owner;
}

void GroupFrontEnd::merge_groups(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                                 std::vector<ShampooOptions>& structures,
                                 std::vector<std::vector<int64_t>>& members) {
  // Front end: param group -> virtual group (first structurally equal one of the same parameter
  // dtype when merging: a virtual group runs one elementwise chain, of one dtype).
  std::vector<std::optional<at::ScalarType>> dtypes;  // none while a virtual group has no params
  group_virtual_.assign(groups.size(), 0);
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& options = options_of(groups[g], g);
    const auto& group_params = groups[g].params();
    const auto dtype = group_params.empty()
                           ? std::nullopt
                           : std::optional<at::ScalarType>(group_params.front().scalar_type());
    int64_t vg = -1;
    if (distributed_.merge_param_groups()) {
      for (size_t k = 0; k < structures.size(); ++k) {
        if (structurally_equal(structures[k], options) &&
            (!dtype || !dtypes[k] || *dtype == *dtypes[k])) {
          vg = static_cast<int64_t>(k);
          break;
        }
      }
    }
    if (vg == -1) {
      vg = static_cast<int64_t>(structures.size());
      structures.push_back(options);
      dtypes.emplace_back();
      members.emplace_back();
    }
    if (dtype) dtypes[vg] = dtype;
    members[vg].push_back(static_cast<int64_t>(g));
    group_virtual_[g] = vg;
  }
}

std::vector<std::unique_ptr<VirtualGroup>> GroupFrontEnd::build_virtual_groups(
    const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  std::vector<ShampooOptions> structures;
  std::vector<std::vector<int64_t>> members;
  merge_groups(groups, structures, members);
  for (auto& block : registry.blocks)
    block.virtual_group = group_virtual_[registry.params[block.param].group];

  // Owners of blocks not yet known to the distributor. Communication units: one for everything
  // when merging (one AllGather per step), one per virtual group otherwise.
  const int64_t known = distributor_.num_blocks();
  std::vector<DistributedBlock> fresh;
  for (int64_t b = known; b < static_cast<int64_t>(registry.blocks.size()); ++b) {
    DistributedBlock d;
    d.id = registry.blocks[b].id;
    d.numel = registry.blocks[b].numel;
    d.unit = distributed_.merge_param_groups() ? 0 : registry.blocks[b].virtual_group;
    d.device = registry.params[registry.blocks[b].param].param.device();
    fresh.push_back(d);
  }
  const auto owners = distributor_.add_blocks(fresh);
  for (size_t i = 0; i < owners.size(); ++i) registry.blocks[known + i].owner = owners[i];

  std::vector<std::unique_ptr<VirtualGroup>> built;
  for (size_t k = 0; k < structures.size(); ++k) {
    std::vector<int64_t> owned;
    for (int64_t b = 0; b < static_cast<int64_t>(registry.blocks.size()); ++b) {
      if (registry.blocks[b].virtual_group == static_cast<int64_t>(k) && distributor_.owns(b)) {
        owned.push_back(b);
      }
    }
    built.push_back(std::make_unique<VirtualGroup>(structures[k], members[k], std::move(owned),
                                                   registry.blocks, registry.params,
                                                   inject_failure_));
  }
  return built;
}

std::map<BlockId, BlockState> GroupFrontEnd::export_states() const {
  std::map<BlockId, BlockState> states;
  for (const auto& vg : virtual_groups) vg->export_states(states);
  return states;
}

void GroupFrontEnd::check(const std::vector<torch::optim::OptimizerParamGroup>& groups) const {
  // Groups and parameters appended through the base class are registered before this check
  // (register_added); what is left is a removal.
  TORCH_CHECK(groups.size() == group_steps.size(), "DistributedShampoo: ", groups.size(),
              " param groups, but ", group_steps.size(), " were registered; ",
              groups.size() < group_steps.size()
                  ? "param groups cannot be removed, build a new optimizer instead"
                  : "groups added through the base class are registered at the next step(), "
                    "save, train() or eval() (a collective in distributed mode), not here");
  for (size_t g = 0; g < groups.size(); ++g) {
    TORCH_CHECK(static_cast<int64_t>(groups[g].params().size()) == registry.group_sizes[g],
                "DistributedShampoo: param group ", g, " has ", groups[g].params().size(),
                " parameters, but ", registry.group_sizes[g],
                " were registered; parameters cannot be removed from a group, build a new "
                "optimizer instead");
    const auto& options = options_of(groups[g], g);
    const auto& structure = virtual_groups[group_virtual_[g]]->structural_options();
    const auto* changed = structural_difference(options, structure);
    TORCH_CHECK(changed == nullptr, "DistributedShampoo: param group ", g, ": structural option ",
                describe_difference(*changed, options, structure),
                " (its value at construction); only the float options (",
                option_names(OptionKind::kFloat),
                ") may change after construction, build a new optimizer instead");
    try {
      options.validate();
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "param group ", g, ": ", e.msg());
    }
  }
}

}  // namespace shampoo::detail
