#pragma once
/// The engine's group-merging front end: the param groups as the engine registered them, their
/// parameters and blocks (the registry), the virtual groups they merge into (one elementwise chain
/// per virtual group), the blocks' owners (asked of the Distributor when blocks are added), and
/// each group's step counts. ShampooEngine steps what this holds; EngineCheckpoint saves and
/// loads it. Registration also covers what was appended through the torch::optim::Optimizer base
/// class, which does not tell the optimizer.

#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "distributor/distributor.h"
#include "shampoo/distributed_shampoo.h"
#include "shampoo/param_registry.h"
#include "shampoo/virtual_group.h"

namespace shampoo::detail {

class GroupFrontEnd {
 public:
  /// `distributed` and `distributor` belong to the engine that holds this front end.
  GroupFrontEnd(const ShampooOptions& defaults, const DistributedOptions& distributed,
                Distributor& distributor);

  /// Validates and appends a param group (to `groups` too), registers its parameters and blocks
  /// and rebuilds the virtual groups, keeping the state of existing blocks.
  void add_group(const torch::optim::OptimizerParamGroup& group,
                 std::vector<torch::optim::OptimizerParamGroup>& groups);
  /// Registers what was appended to `groups` behind the optimizer's back (through the base
  /// class's add_param_group or add_parameters) as add_group does; returns whether anything was.
  /// Collective in distributed mode when it registers something (the ranks' agreement).
  bool register_added(std::vector<torch::optim::OptimizerParamGroup>& groups);
  /// Checks that the param groups were not changed behind the optimizer's back: none removed,
  /// no parameter removed, no structural option changed, every option valid.
  void check(const std::vector<torch::optim::OptimizerParamGroup>& groups) const;

  /// Builds the virtual groups for the current registry (owners of new blocks are assigned
  /// first), without state; the current ones stay in place.
  std::vector<std::unique_ptr<VirtualGroup>> build_virtual_groups(
      const std::vector<torch::optim::OptimizerParamGroup>& groups);
  /// The state of every block this rank owns, by block id.
  std::map<BlockId, BlockState> export_states() const;
  /// Replaces the virtual groups by `built`; the counters of the replaced ones are kept.
  void replace_virtual_groups(std::vector<std::unique_ptr<VirtualGroup>> built);
  /// Test seam: every virtual group built from now on (and the current ones, rebuilt with their
  /// state) calls `fn` before each amortized computation.
  void set_failure_injector(FailureInjector fn,
                            std::vector<torch::optim::OptimizerParamGroup>& groups);

  /// Whether any virtual group uses iterate averaging.
  bool any_averaging() const;
  /// Index of `param` among the registered parameters, or -1.
  int64_t param_index(const at::Tensor& param) const;
  /// The rank (of the whole process group) owning every block of `param`; nullopt when it is
  /// not registered; an error when its blocks have several owners or with trainer subgroups.
  std::optional<int> param_owner(const at::Tensor& param) const;
  /// Each registered parameter's entry in the optimizer's state(): a ShampooParamState with its
  /// group's step count, its group and its number of blocks (made where missing).
  void write_state_entries(
      ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>>& state) const;
  /// The amortized computations' counters of every virtual group built so far (replaced ones
  /// included).
  AmortizedCounters counters() const;

  ParamRegistry registry;
  std::vector<std::unique_ptr<VirtualGroup>> virtual_groups;
  /// Per param group: the steps it took (a group advances when one of its blocks was updated).
  std::vector<int64_t> group_steps;
  /// Schedule-Free: per param group Σ lr^p over its completed steps (0 without it).
  std::vector<double> group_lr_sums;
  /// Each group's peak_lr as resolved when it was added: a wrapper that pushes its own copy of
  /// the options (peak_lr −1 there) gets it back at the next step.
  std::vector<double> group_peak_lrs;

 private:
  /// Param group -> virtual group (the first structurally equal one of the same parameter dtype
  /// when merging). Sets group_virtual_; returns per virtual group its structure and member
  /// param groups.
  void merge_groups(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                    std::vector<ShampooOptions>& structures,
                    std::vector<std::vector<int64_t>>& members);
  /// Replaces the virtual groups by freshly built ones holding the current states (after a
  /// registry change).
  void rebuild(const std::vector<torch::optim::OptimizerParamGroup>& groups, bool require_all);

  ShampooOptions defaults_;
  const DistributedOptions& distributed_;
  Distributor& distributor_;
  std::vector<int64_t> group_virtual_;  // virtual group of each param group
  FailureInjector inject_failure_;
  AmortizedCounters retired_counters_;  // of virtual groups replaced by rebuilds and loads
};

/// The ShampooOptions of a param group (an error naming the group when it has another type).
ShampooOptions& options_of(torch::optim::OptimizerParamGroup& group, size_t index);
const ShampooOptions& options_of(const torch::optim::OptimizerParamGroup& group, size_t index);

/// peak_lr −1 becomes the group's lr: done once, when the group is added to the optimizer.
void resolve_peak_lr(ShampooOptions& options);

}  // namespace shampoo::detail
