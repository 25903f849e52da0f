#pragma once
/// The engine behind DistributedShampoo: the outline of a step (begin, compute, finish, abort) over
/// its group-merging front end (param groups -> virtual groups, the registry of parameters and
/// blocks, each group's step counts: group_front_end.h) and the Distributor; its checkpoints are
/// EngineCheckpoint's (engine_checkpoint.h, checkpoint.cpp). The step transaction
/// (step_transaction.h) and the ranks' agreement check (rank_agreement.h) are their own units. It
/// holds no pointer to the optimizer object (which may be moved); the optimizer passes its param
/// groups.

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "distributor/distributor.h"
#include "parallel/checkpoints/distributed_checkpoint.h"
#include "shampoo/distributed_shampoo.h"
#include "shampoo/group_front_end.h"
#include "shampoo/step_transaction.h"
#include "shampoo/virtual_group.h"

namespace shampoo::detail {

class ShampooEngine {
 public:
  ShampooEngine(const ShampooOptions& defaults, DistributedOptions distributed);

  ShampooEngine(const ShampooEngine&) = delete;  // its front end refers to its members
  ShampooEngine& operator=(const ShampooEngine&) = delete;

  /// Param groups, parameters, blocks, virtual groups and step counts: adding groups (also what
  /// was appended through the base class), what the registry answers about a parameter.
  GroupFrontEnd& groups() { return front_; }
  const GroupFrontEnd& groups() const { return front_; }

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
  const DistributedOptions& distributed_options() const { return distributed_; }
  /// Test seam: called at each FaultPoint of every step; a throw there fails the step.
  void set_fault_injector(StepFaultInjector fn, bool journal) {
    fault_ = std::move(fn);
    fault_journals_ = journal;
  }

 private:
  friend class EngineCheckpoint;  // checkpoint.cpp: reads and installs the state below
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

  DistributedOptions distributed_;
  std::unique_ptr<Distributor> distributor_;
  GroupFrontEnd front_;  // after the two above, which it refers to
  // Schedule-Free: the open step's Σ lr^p per param group including its terms (committed to the
  // front end's group_lr_sums for the groups that advance).
  std::vector<double> step_lr_sums_;
  // An agreeing step: what every rank must have set alike (float_option_prints) and the groups'
  // lrs for its message.
  std::vector<int64_t> step_prints_;
  std::vector<double> step_lrs_;
  bool eval_mode_ = false;  // iterate averaging: parameters hold the evaluation sequence x
  StepFaultInjector fault_;
  bool fault_journals_ = true;  // the fault injector makes every step keep its journal
  int64_t collectives_last_step_ = 0;
  StepTransaction transaction_;
  std::string broken_;  // not empty: why steps are refused until a checkpoint is loaded
};

}  // namespace shampoo::detail
