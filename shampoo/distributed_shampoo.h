#pragma once
/// DistributedShampoo: the Shampoo optimizer as a torch::optim::Optimizer.
///
///   shampoo::DistributedShampoo opt(model->parameters(), shampoo::ShampooOptions(1e-3)
///                                      .betas({0.9, 0.999}).epsilon(1e-12)
///                                      .grafting(shampoo::AdamGraftingConfig{}));
///   loss.backward(); opt.step(); opt.zero_grad();
///
/// Param groups may differ in any option; groups that differ only in float hyperparameters run
/// as one virtual group (DistributedOptions::merge_param_groups). With a process group, blocks
/// are owned by ranks and one AllGather per step shares the results (DistributedOptions).

#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "parallel/checkpoints/distributed_checkpoint.h"
#include "parallel/optimizers/portable_checkpoint.h"
#include "preconditioners/memory_summary.h"
#include "shampoo/fault_point.h"
#include "shampoo/shampoo_options.h"

namespace shampoo {

namespace detail {
class ShampooEngine;
}

/// Counters of the optimizer on this rank.
struct ShampooStats {
  /// Virtual groups (param groups after merging).
  int64_t virtual_groups = 0;
  /// AllGathers issued by the last step (0 for a single process); the agreement before an
  /// ordinary distributed step (DistributedOptions::agree_before_update, one all-reduce of one
  /// int per rank) is not counted.
  int64_t collectives_last_step = 0;
  /// Amortized computations (root inverses or eigenbases, one per block) so far on this rank.
  int64_t amortized_computations = 0;
  int64_t failed_amortized_computations = 0;
  /// Decompositions that failed in the factor dtype and were retried in float64.
  int64_t double_precision_retries = 0;
  /// Roots a matmul-only solver (RootInvShampooConfig::solver) left unconverged, computed by eigh.
  int64_t root_solver_fallbacks = 0;
  /// Batched calls that made those computations: one per stack of equal block shapes, dim and
  /// chunk (the eigh or root solver's batch), however many blocks it holds.
  int64_t amortized_batched_calls = 0;
  /// Blocks in total and owned (computed) by this rank.
  int64_t total_blocks = 0;
  int64_t owned_blocks = 0;
  /// Bytes of optimizer state held by this rank.
  int64_t state_bytes = 0;
  /// Bytes of state and parameters the last step copied so that it could be undone had it
  /// failed: 0 for an ordinary step (one process, or distributed with agree_before_update)
  /// unless some rank foresaw that it may raise after changing state (an amortized computation
  /// at the limit of the failure policy, a factor update that could overflow); the state of the
  /// blocks stepped (this rank's) in backward, whose later parameters can still fail after
  /// blocks changed, and in a distributed step without the agreement.
  int64_t rollback_bytes_last_step = 0;
  /// Bytes of the AllGather send and receive buffers of one step (0 for a single process).
  int64_t bytes_sent_per_step = 0;
  int64_t bytes_received_per_step = 0;
};

/// The entry of a parameter in DistributedShampoo::state(), LibTorch's per-parameter state map
/// (keyed by the parameter's TensorImpl): every registered parameter has one, from its
/// registration on, kept true across steps, loads and added groups. It is a summary: the state
/// itself (factors, roots, grafting, momentum, by block) stays in the optimizer's virtual
/// groups, which memory_summary() describes. Replacing or erasing entries changes nothing in the
/// optimizer (they are written again after the next step).
struct ShampooParamState : torch::optim::OptimizerCloneableParamState<ShampooParamState> {
  /// Completed steps of the parameter's param group: the t of its bias corrections and
  /// amortized computations (Shampoo counts steps per param group; a group's step counts when
  /// any of its parameters had a gradient).
  TORCH_ARG(int64_t, step) = 0;
  /// Index of its param group in param_groups().
  TORCH_ARG(int64_t, param_group) = 0;
  /// Blocks the parameter was split into (docs/math.md, "Blocking").
  TORCH_ARG(int64_t, num_blocks) = 0;

 public:
  void serialize(torch::serialize::OutputArchive& archive) const override;
  void serialize(torch::serialize::InputArchive& archive) override;
  bool operator==(const ShampooParamState& other) const {
    return step_ == other.step_ && param_group_ == other.param_group_ &&
           num_blocks_ == other.num_blocks_;
  }
};

class DistributedShampoo : public torch::optim::Optimizer,
                           public DelegatingCheckpointable,
                           public DelegatingPortable {
 public:
  /// Parameters may be Float, Double, BFloat16 or Half, in any strided layout (a channels_last
  /// conv weight is blocked by its logical shape and updated in its layout); bf16 and fp16
  /// parameters are stepped in float32 (their state and the update are float32, the result is
  /// rounded into the parameter). An empty parameter list is accepted, as LibTorch's optimizers
  /// accept one (add groups later with add_param_group); step() without parameters is an error.
  explicit DistributedShampoo(std::vector<torch::Tensor> params, ShampooOptions defaults = {},
                              DistributedOptions distributed = {});
  explicit DistributedShampoo(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                              ShampooOptions defaults = {}, DistributedOptions distributed = {});
  ~DistributedShampoo() override;
  DistributedShampoo(DistributedShampoo&&) noexcept;
  DistributedShampoo& operator=(DistributedShampoo&&) noexcept;

  /// One step for every parameter with a gradient. The closure, when given, is evaluated with
  /// gradients enabled first and its loss returned.
  torch::Tensor step(LossClosure closure = nullptr) override;

  /// Adds a group with its own ShampooOptions (the defaults when it has none). Groups added later
  /// keep their own step count and merge into a virtual group where their structural options
  /// allow. Its parameters must share one dtype. Hides torch::optim::Optimizer::add_param_group,
  /// which is not virtual; a group appended through a base-class reference (or parameters
  /// appended with the base class's add_parameters, which LibTorch puts into group 0) is
  /// registered the same way at the next step(), save, load, train() or eval(), and is stepped
  /// like a group given to the constructor. Collective in distributed mode.
  void add_param_group(const torch::optim::OptimizerParamGroup& param_group);

  /// Checkpoints: torch::save(optimizer, path) / torch::load(optimizer, path). Each rank writes
  /// the state of the blocks it owns; loading requires the same model, structural options and
  /// world size (clear error otherwise) and restores the groups' float options and step counts.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // World-size-independent checkpoints: shampoo::save_distributed_checkpoint(optimizer, dir) /
  // load_distributed_checkpoint (parallel/checkpoints/distributed_checkpoint.h;
  // DistributedCheckpointable). One piece per block, written by its owner in the first trainer
  // group; loading at any world size (and any num_trainers_per_group, merged or not) reads the
  // blocks each rank owns now.
  // Whole-run checkpoints that any layout loads (parallel/optimizers/portable_checkpoint.h;
  // PortableCheckpointable): rank 0 of the (first) trainer group writes every parameter's group
  // step count, each owner its blocks; loading checks the saved groups' structural options and
  // takes their float options.
  // Both interfaces are answered by an internal object (DistributedShampoo::Checkpoint,
  // shampoo/distributed_shampoo_checkpoint.h).

  /// Iterate averaging (ShampooOptions::iterate_averaging; docs/math.md, "Iterate averaging"):
  /// the parameters hold the training sequence y, where gradients are taken. eval() moves the
  /// parameters of the groups with averaging to the evaluation sequence x (evaluate and save the
  /// model there), train() back to y; either does nothing when already in that mode, and nothing
  /// to groups without averaging. step() in eval mode is an error. Collective in distributed
  /// mode: every rank calls it (the owner of a block holds its Z; one AllGather). The mode is
  /// saved in checkpoints.
  void train();
  void eval();
  /// False after eval() until train() (true for a new optimizer).
  bool is_training() const;

  ShampooStats stats() const;
  /// The bytes of optimizer state this rank holds, by kind (factors, inverse roots,
  /// eigenvectors, grafting, filtered gradient, momentum, ...), and the scratch the last step
  /// kept to be able to undo itself. state_total() equals stats().state_bytes. It counts what is
  /// allocated: the β1 filter M and momentum B (each the parameters' size) are allocated at the
  /// first step that uses them, so before the first step they are not in it (on a small GPT the
  /// state is 5.6x the parameters before the first step and 6.6x after; bench_state_memory).
  MemorySummary memory_summary() const;

  /// Who steps what (gradient sharding, GradientSynchronizer::shard_gradients, asks it): the
  /// process group of the owners (null: one process) and the rank that owns every block of
  /// `param` (-1 when every rank steps it, nullopt when it is not one of this optimizer's). An
  /// error when its blocks have several owners: build the optimizer with
  /// DistributedOptions::shard_by_parameter(true).
  c10::intrusive_ptr<c10d::ProcessGroup> owners_group() const;
  std::optional<int> owner_of(const at::Tensor& param) const;

  /// The options of param group `group` (a ShampooOptions).
  ShampooOptions& group_options(size_t group);
  /// Step count of param group `group`.
  int64_t group_step(size_t group) const;
  /// Schedule-Free: Σ lr^p over param group `group`'s completed steps (0 without it).
  double group_lr_sum(size_t group) const;
  const DistributedOptions& distributed_options() const;

  /// Test seam: makes the amortized computation of (block, dim) fail whenever the function
  /// returns true; block names are "parameter P block B".
  void set_failure_injector_for_testing(std::function<bool(const std::string&, int64_t)> fn);
  /// Test seam: `fn` is called at every FaultPoint of every step; what it throws fails the step
  /// there (which must then change nothing). Empty = off. `journal` false: the steps do not keep
  /// an undo journal because of it (a failure no check foresaw: the optimizer then refuses steps
  /// until a checkpoint is loaded).
  void set_fault_injector_for_testing(StepFaultInjector fn, bool journal = true);

 protected:
  DistributedCheckpointable& checkpoint_delegate() const override;
  PortableCheckpointable& portable_delegate() const override;

 private:
  // The wrappers reach its phased step (Phased), its block states (Checkpoint) and its owners (an
  // adapter forwarding to owners_group and owner_of) through the internal interfaces
  // (parallel/optimizers/capabilities.h).
  struct Interfaces;  // the adapters and the lookup it registers, distributed_shampoo.cpp
  class Phased;  // its PhasedStep (optimizer-in-backward, full sharding), distributed_shampoo.cpp
  class Checkpoint;  // its checkpoints and BlockStates, distributed_shampoo_checkpoint.h

  /// Registers groups and parameters appended through the base class, then writes state()'s
  /// entries (ShampooParamState) for every registered parameter (the engine's front end writes
  /// them: GroupFrontEnd::write_state_entries).
  void sync_groups_and_state();

  std::unique_ptr<detail::ShampooEngine> engine_;
  std::unique_ptr<Interfaces> interfaces_;
  std::unique_ptr<Phased> phased_;
  std::unique_ptr<Checkpoint> checkpoint_;
};

}  // namespace shampoo
