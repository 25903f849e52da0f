#pragma once
/// The inside of full sharding (detail::FsdpState): the units and their parameters, the ranks,
/// and what runs a unit's forward, the backward pass and the steps. Its parts live in files of
/// their own: the ranks and groups (shard_mesh.h), a sharded parameter (param_slot.h), a unit
/// (fsdp_unit.h), optimizer()'s groups (fully_sharded_groups.h), checkpoints
/// (fully_sharded_checkpoint.h); construction is fully_sharded_setup.cpp, the backward pass
/// fully_sharded_backward.cpp, the step fully_sharded_step.cpp. Internal: not installed.

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "parallel/data_parallel/backward_pass.h"
#include "parallel/full_sharding/fsdp_unit.h"
#include "parallel/full_sharding/fully_sharded.h"
#include "parallel/full_sharding/fully_sharded_groups.h"
#include "parallel/full_sharding/shard_mesh.h"
#include "parallel/full_sharding/step_worker.h"
#include "parallel/optimizers/local_optimizer.h"
#include "parallel/optimizers/undo_record.h"

namespace shampoo::detail {

struct FsdpState : std::enable_shared_from_this<FsdpState> {
  ShardMesh mesh;
  FullyShardedOptions options;
  GroupOptimizerFactory factory;
  // Lossless: the one optimizer of this rank, over the parameters it owns in optimizer()'s groups.
  std::unique_ptr<LocalOptimizer> rank_optimizer;
  std::vector<std::unique_ptr<FsdpUnit>> units;
  std::map<std::string, size_t> unit_by_name;
  std::unordered_map<const c10::TensorImpl*, std::pair<size_t, size_t>> slot_of;
  std::vector<size_t> forward_order;  // units run with gradients in this pass, in order
  size_t next_to_gather = 0;          // in reverse forward order, for backward
  size_t next_to_reduce = 0;
  // The passes and the accumulation (options.accumulation_steps()): stepped() when a step ends
  // one, with overlap at the end of its last pass, without in step().
  BackwardPass pass;
  int64_t steps = 0;
  bool holding = false;  // between gather_all() and release_all()
  std::recursive_mutex mutex;
  std::unique_ptr<StepWorker> worker;
  FsdpGroups groups{*this};  // optimizer() and its param groups
  // The open pass (overlap): what undoes the units stepped so far, and the first unit's failure
  // (set on the worker, the same unit on every rank; read after the worker is waited on).
  std::vector<UndoRecord> pass_undo;
  std::string pass_failure;

  /// Units stepped during backward keep what undoes their step until the pass ends.
  bool journal() const { return options.overlap_step() && options.undo_failed_steps(); }
  bool lossless() const { return options.step_mode() == ShardedStepMode::kLossless; }
  FsdpUnit& unit(size_t index) { return *units[index]; }
  /// (unit, index in the unit) of `param`; an error for a tensor that is no unit's parameter.
  std::pair<size_t, size_t> position_of(const at::Tensor& param) const;
  ParamSlot& slot_for(const at::Tensor& param);

  // construction (fully_sharded_setup.cpp): units checked and agreed on by the ranks, subgroups,
  // rank 0's values, owners, shards, optimizer() and the rank's optimizers, the gradient hooks.
  void setup(FullyShardedDataParallel& owner, std::vector<ShardedUnit> given,
             std::optional<std::vector<torch::optim::OptimizerParamGroup>> param_groups);

  // forward, backward and the gradient reduction (fully_sharded_backward.cpp)
  at::Tensor forward(size_t u, const std::function<at::Tensor()>& fn);
  void open_pass();
  void before_unit_backward(size_t u);
  void on_grad_ready(size_t u, size_t i);
  void close_pass();
  /// Averages the unit's gradients over the ranks into what this rank steps, releases the full
  /// gradients, and steps the unit on the worker (overlap) or marks it for step().
  void reduce(FsdpUnit& unit);

  // the step and its undo (fully_sharded_step.cpp)
  void step_unit(FsdpUnit& unit, c10d::ProcessGroup& via);
  std::string step_reduced(FsdpUnit& unit, UndoRecord& undo);
  bool undo_pass();
  void commit_pass();
  void check_step_after_backward(const char* function) const;
  void step_all(const char* function);
  void step_all_owned();
  void check_finite_before_steps();
  void skip_all();
  std::vector<at::Tensor> reduced_gradients(const char* function);
  /// clip_grad_norm_ over `params` (unit parameters), whose norms are combined in this order;
  /// `function` names the caller in errors.
  double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm, double norm_type,
                        const char* function);
  void finish_step();
  void wait_all();
};

/// Every rank's message for a unit whose step failed on the ranks `failed`; `here` is this
/// rank's own reason (empty when it did not fail).
std::string failure_message(const ShardMesh& mesh, const FsdpUnit& unit,
                            const std::vector<int>& failed, const std::string& here);
/// The end of a failure's message: what the failed iteration left.
std::string failure_outcome(bool undone);

}  // namespace shampoo::detail
