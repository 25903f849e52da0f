#pragma once
/// The engine behind DistributedShampoo: the outline of a step (begin, compute, finish, abort),
/// the group-merging front end (param groups -> virtual groups), the Distributor; its checkpoints
/// are EngineCheckpoint's (engine_checkpoint.h, checkpoint.cpp). The registry of parameters and
/// blocks (param_registry.h), the step transaction (step_transaction.h) and the ranks' agreement
/// check (rank_agreement.h) are their own units. It holds no pointer to the optimizer object (which
/// may be moved); the optimizer passes its param groups.

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "distributor/distributor.h"
#include "parallel/checkpoints/distributed_checkpoint.h"
#include "shampoo/distributed_shampoo.h"
#include "shampoo/param_registry.h"
#include "shampoo/step_transaction.h"
#include "shampoo/virtual_group.h"

namespace shampoo::detail {

class ShampooEngine {
 public:
  ShampooEngine(const ShampooOptions& defaults, DistributedOptions distributed);

  /// Validates and appends a param group (to `groups` too), registers its parameters and blocks
  /// and rebuilds the virtual groups, keeping the state of existing blocks.
  void add_group(const torch::optim::OptimizerParamGroup& group,
                 std::vector<torch::optim::OptimizerParamGroup>& groups);
  /// Registers what was appended to `groups` behind the engine's back (through the base class's
  /// add_param_group or add_parameters) as add_group does; returns whether anything was.
  /// Collective in distributed mode when it registers something (the ranks' agreement).
  bool register_added_params(std::vector<torch::optim::OptimizerParamGroup>& groups);

  void step(std::vector<torch::optim::OptimizerParamGroup>& groups);
  /// One ordinary step of the registered parameters `params` (indices) only: the others are not
  /// read, so their storage may be released (full sharding).
  void step(std::vector<torch::optim::OptimizerParamGroup>& groups,
            const std::vector<int64_t>& params);

  /// A step in three phases, for optimizer-in-backward: begin (check the groups, open the
  /// communication buffer), compute the blocks of some parameters as their gradients arrive
  /// (applied in place in a single process, written for the AllGather otherwise), finish (the
  /// one AllGather, the application of every block, and the step count of every group that had
  /// an update). `incremental`: compute_params will be called more than once (in backward).
  ///
  /// A step either completes or changes nothing: each phase that throws first undoes the step
  /// (abort_step) and rethrows. What can throw is checked before anything changes; where a
  /// later phase can still throw (distributed, incremental, an amortized computation at the
  /// limit of the failure policy), the state the step changes is saved first.
  void begin_step(std::vector<torch::optim::OptimizerParamGroup>& groups, bool incremental = false);
  void compute_params(std::vector<torch::optim::OptimizerParamGroup>& groups,
                      const std::vector<int64_t>& params);
  void finish_step();
  /// Undoes the open step: puts back the saved state and parameters and closes the step. In
  /// distributed mode it first joins the step's AllGather flagged as failed (unless that was
  /// already attempted), so the other ranks undo their step too instead of waiting.
  void abort_step();
  bool step_open() const { return transaction_.is_open(); }
  /// Index of `param` among the registered parameters, or -1.
  int64_t param_index(const at::Tensor& param) const;
  /// The rank (of the whole process group) owning every block of `param`; nullopt when it is
  /// not registered; an error when its blocks have several owners or with trainer subgroups.
  std::optional<int> param_owner(const at::Tensor& param) const;

  // Checkpoints: EngineCheckpoint (engine_checkpoint.h, checkpoint.cpp), over this engine.
  /// This rank in the trainer group.
  int rank() const;

  /// Iterate averaging: moves the parameters of the groups with averaging to the evaluation
  /// sequence (`eval`) or back to the training sequence; nothing when already there. Collective
  /// in distributed mode (one AllGather: the owners hold Z). A step in eval mode is an error.
  void set_eval_mode(bool eval, std::vector<torch::optim::OptimizerParamGroup>& groups);
  bool eval_mode() const { return eval_mode_; }

  ShampooStats stats() const;
  MemorySummary memory_summary() const;
  int64_t group_step(size_t group) const { return group_steps_.at(group); }
  double group_lr_sum(size_t group) const { return group_lr_sums_.at(group); }
  /// Per registered parameter, in registration order: (the parameter, its param group, its
  /// number of blocks).
  struct ParamSummary {
    at::Tensor param;
    int64_t group = 0;
    int64_t num_blocks = 0;
  };
  std::vector<ParamSummary> param_summaries() const;
  const DistributedOptions& distributed_options() const { return distributed_; }
  void set_failure_injector(FailureInjector fn,
                            std::vector<torch::optim::OptimizerParamGroup>& groups);
  /// Test seam: called at each FaultPoint of every step; a throw there fails the step.
  void set_fault_injector(StepFaultInjector fn, bool journal) {
    fault_ = std::move(fn);
    fault_journals_ = journal;
  }

 private:
  friend class EngineCheckpoint;  // checkpoint.cpp: reads and installs the state below
  /// Builds the virtual groups for the current registry (owners of new blocks are assigned
  /// first) and moves `states` into them.
  std::vector<std::unique_ptr<VirtualGroup>> build_virtual_groups(
      const std::vector<torch::optim::OptimizerParamGroup>& groups);
  /// The group-merging front end: param group -> virtual group (the first structurally equal one
  /// of the same parameter dtype when merging). Sets group_virtual_; returns per virtual group its
  /// structure and member param groups.
  void merge_groups(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                    std::vector<ShampooOptions>& structures,
                    std::vector<std::vector<int64_t>>& members);
  std::map<BlockId, BlockState> export_states() const;
  /// Block views of the gradients of `params` (checked: shape, dtype, finite values, squares
  /// that fit the state: statistics_overflow) and the max |gradient| of each.
  void collect_gradients(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                         const std::vector<int64_t>& params,
                         std::vector<std::vector<at::Tensor>>& grad_blocks,
                         std::vector<double>& grad_abs_max) const;
  void compute(std::vector<torch::optim::OptimizerParamGroup>& groups,
               const std::vector<int64_t>& params);
  /// Closes the open step; the groups with an updated block advance their step count.
  void close_step(bool completed);
  /// The agreement of an agreeing distributed step (DistributedOptions::agree_before_update):
  /// tells the other ranks whether this one `needs_journal`; throws, with the step closed and
  /// nothing changed, when a rank failed; returns whether any rank needs the journal.
  bool agree_before_update(bool needs_journal);
  /// After a failed step: when it had changed state without a copy, refuse further steps until a
  /// checkpoint is loaded.
  void note_broken_if_unjournaled();
  /// Replaces the virtual groups by freshly built ones holding the current states (after a
  /// registry change); counters of the old ones are kept.
  void rebuild(const std::vector<torch::optim::OptimizerParamGroup>& groups, bool require_all);
  /// Adds the counters of the current virtual groups to the retired ones (before replacing them).
  void retire_counters();
  /// Whether any virtual group uses iterate averaging.
  bool any_averaging() const;
  /// Checks that the param groups were not changed behind the optimizer's back.
  void check_groups(const std::vector<torch::optim::OptimizerParamGroup>& groups) const;

  ShampooOptions defaults_;
  DistributedOptions distributed_;
  std::unique_ptr<Distributor> distributor_;
  ParamRegistry registry_;
  std::vector<int64_t> group_steps_;
  // Schedule-Free: per param group Σ lr^p over its completed steps (0 without it), and the open
  // step's sums including its terms (committed for the groups that advance).
  std::vector<double> group_lr_sums_;
  /// Each group's peak_lr as resolved when it was added: a wrapper that pushes its own copy of
  /// the options (peak_lr −1 there) gets it back at the next step (restore_peak_lrs).
  std::vector<double> group_peak_lrs_;
  std::vector<double> step_lr_sums_;
  bool eval_mode_ = false;  // iterate averaging: parameters hold the evaluation sequence x
  std::vector<int64_t> group_virtual_;  // virtual group of each param group
  std::vector<std::unique_ptr<VirtualGroup>> virtual_groups_;
  FailureInjector inject_failure_;
  StepFaultInjector fault_;
  bool fault_journals_ = true;  // the fault injector makes every step keep its journal
  int64_t collectives_last_step_ = 0;
  StepTransaction transaction_;
  std::string broken_;  // not empty: why steps are refused until a checkpoint is loaded
  AmortizedCounters retired_counters_;  // of virtual groups replaced by rebuilds
};

/// The ShampooOptions of a param group (an error naming the group when it has another type).
ShampooOptions& options_of(torch::optim::OptimizerParamGroup& group, size_t index);
const ShampooOptions& options_of(const torch::optim::OptimizerParamGroup& group, size_t index);

/// peak_lr −1 becomes the group's lr: done once, when the group is added to the optimizer.
void resolve_peak_lr(ShampooOptions& options);

}  // namespace shampoo::detail
