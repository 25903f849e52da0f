#pragma once
/// Fully sharded data parallelism (ZeRO-3, as PyTorch's FSDP2 `fully_shard`) for C++ models:
/// parameters, gradients and optimizer state are each split across the ranks, and a unit's full
/// parameters exist only while the unit runs forward or backward.
///
/// The model is cut into units (a layer, a block, any list of parameters). Every parameter of a
/// unit is split along dim 0 into one row chunk per rank (the last chunks padded). LibTorch
/// modules have no forward hooks, so each unit's forward runs through forward(unit, fn): its
/// parameters are all-gathered before fn runs and released after it (reshard_after_forward); a
/// hook on the unit's output gathers them again before the unit's backward. Once the unit's
/// gradients are complete they are reduced (averaged over the ranks), the full gradients are
/// released, and, with overlap_step, the unit's optimizer steps on a worker thread while backward
/// goes on with the earlier units. The step is waited on at the unit's next forward.
///
///   auto units = shampoo::sequential_units(model);   // one unit per layer with parameters
///   shampoo::FullyShardedDataParallel fsdp(
///       units,
///       shampoo::group_optimizer_factory<shampoo::DistributedShampoo>(shampoo::ShampooOptions(1e-3)),
///       group);
///   auto loss = loss_fn(shampoo::forward_sequential(fsdp, model, x), y);
///   loss.backward();                                // reduces and steps, unit by unit
///
/// Two step modes (FullyShardedOptions::step_mode):
/// - kLossless (default): every whole parameter has one owner rank (the greedy balance by bytes
///   that Shampoo's blocks and ZeRO-1 use). Its averaged gradient goes to the owner alone, the
///   owner's optimizer steps the whole parameter, and each rank gets its rows back. Results do not
///   depend on the world size; any optimizer works, Shampoo included.
/// - kLocalShard: every rank steps its own rows of every parameter with an optimizer over those
///   rows (FSDP2's plain mode). Elementwise optimizers (SGD, Adam, ...) give the same results;
///   Shampoo then preconditions row chunks, so its numerics change with the world size.
///
/// The module's parameter tensors stay the tensors autograd sees: while a unit is sharded they
/// have no storage and shape [0] (an ATen op that reads one outside forward(unit, fn) fails on
/// the shape). Optimizers come from the factory and belong to this object: lossless, one per rank
/// over the parameters it owns, across every unit, in optimizer()'s param groups (so Shampoo
/// merges them into virtual groups and batches their roots; the factory, a GroupOptimizerFactory,
/// is called once, with the rank's parameters of group 0 and that group's options, and the other
/// groups join it); local shards, one per unit and rank over its row chunks (the factory called
/// once per unit with them, without options).
///
/// Checkpoints (lossless): save_distributed_state(fsdp, dir) / load_distributed_state(fsdp, dir)
/// store every parameter's rows and every parameter's optimizer state keyed by unit and
/// parameter, so a run saved on 4 ranks resumes on 2, or on 1.

#include <ATen/ATen.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "parallel/checkpoints/distributed_checkpoint.h"
#include "parallel/optimizers/loss_scaling.h"
#include "parallel/optimizers/optimizer_factory.h"
#include "parallel/optimizers/portable_checkpoint.h"
#include "parallel/state_sharding/sharded_optimizer.h"

namespace shampoo {

/// A unit of a fully sharded model: parameters gathered together, before the unit's forward and
/// again before its backward.
struct ShardedUnit {
  std::string name;
  std::vector<at::Tensor> params;
};

/// How the optimizer steps a fully sharded model.
enum class ShardedStepMode {
  /// Whole parameters stepped by one owner rank each (results independent of the world size).
  kLossless,
  /// Every rank steps its own row chunk of every parameter.
  kLocalShard,
};

struct FullyShardedOptions {
  TORCH_ARG(ShardedStepMode, step_mode) = ShardedStepMode::kLossless;
  /// Release a unit's full parameters after its forward (gathered again before its backward).
  TORCH_ARG(bool, reshard_after_forward) = true;
  /// Step each unit on a worker thread as soon as its gradients are reduced during backward,
  /// waited on at the unit's next forward (or wait()). Off: step() after backward.
  TORCH_ARG(bool, overlap_step) = true;
  /// Gradient accumulation: the reduced gradients of k backward passes are summed and the step
  /// runs on the k-th (k ≥ 1).
  TORCH_ARG(int64_t, accumulation_steps) = 1;
  /// Copy rank 0's parameter values to every rank at construction.
  TORCH_ARG(bool, broadcast_parameters) = true;
  /// Mixed precision: the dtype of the gathered parameters, so of the all-gather and of the
  /// forward and backward compute (e.g. at::kBFloat16); unset = the parameters' own. The shards,
  /// the reduced gradients, the optimizer state and the step stay in the parameters' own dtype.
  TORCH_ARG(std::optional<at::ScalarType>, param_dtype) = std::nullopt;
  /// Mixed precision: the dtype the gradients are reduced in; unset = param_dtype's.
  TORCH_ARG(std::optional<at::ScalarType>, reduce_dtype) = std::nullopt;
  /// The optimizer state and the step on the CPU while the model trains on a GPU: not supported
  /// yet (true is an error that says so).
  TORCH_ARG(bool, offload_state_to_cpu) = false;
  /// With overlap_step: each unit's step during backward keeps what undoes it until the pass
  /// ends (the optimizer's state before the step, this rank's rows), so that a unit failing later
  /// in the pass (a non-finite averaged gradient on some rank, an optimizer's error) undoes the
  /// whole iteration on every rank, as data parallelism's failed step changes nothing. It costs a
  /// copy of the state each step changes (DistributedShampoo's journal in backward; LibTorch
  /// optimizers' per-parameter state). false: no copies; a failure then leaves the units stepped
  /// before it stepped, and the error says so.
  TORCH_ARG(bool, undo_failed_steps) = true;
  /// Hybrid sharding (FSDP2's HSDP): the ranks that hold the same shards in the other shard
  /// groups (make_hybrid_groups(world).replica), the wrapper's process group being this rank's
  /// shard group (make_hybrid_groups(world).shard). Parameters, gradients and optimizer state are
  /// sharded within the shard group; each gradient is reduced within it and then all-reduced
  /// across the replica group (averaged over every rank of both), so the frequent collectives
  /// stay within a node and only the reduced shards cross nodes. Null: no replicas. Checkpoints
  /// and save_full_model are written by replica 0 (every replica learns the outcome).
  TORCH_ARG(c10::intrusive_ptr<c10d::ProcessGroup>, replica_group) = {};
  /// Hybrid, lossless: each parameter is stepped, and its optimizer state kept, by one replica
  /// only (owners planned over every rank of both groups, as the Distributor's
  /// num_trainers_per_group splits blocks), its averaged gradient reduced to that replica and its
  /// new value broadcast to the others. A rank then holds 1/replicas of its shard group's
  /// optimizer state, for one broadcast per parameter and step across replicas. The results equal
  /// the replicated ones. Checkpoints: save_training_checkpoint over every rank (each replica
  /// saves its own state); save_distributed_checkpoint, written by one replica, is refused.
  TORCH_ARG(bool, split_across_replicas) = false;

 public:
  /// Every field equal.
  bool operator==(const FullyShardedOptions&) const = default;
};

/// FullyShardedDataParallel::stats(): passes and steps so far, and the bytes this rank holds now.
struct FullyShardedStats {
  int64_t backward_passes = 0;  ///< backward passes seen
  int64_t steps_taken = 0;      ///< steps taken (overlapped or step())
  int64_t shard_bytes = 0;      ///< this rank's parameter shards
  /// reduced gradients kept for the step (between backward and step(), or during accumulation)
  int64_t gradient_bytes = 0;
  int64_t gathered_bytes = 0;  ///< full parameters gathered right now
};

class FullyShardedDataParallel;
namespace detail {
struct FsdpState;
class FsdpGroups;
class FsdpCheckpoint;
}  // namespace detail

/// The optimizer of a fully sharded model as LibTorch code holds one (a torch::optim::Optimizer&):
/// FullyShardedDataParallel::optimizer(). Its param groups are the user's (or one group of every
/// unit parameter); their options reach the optimizers that step the parameters (see
/// optimizer()). It does not step by itself:
/// - step(): with overlap_step the parameters were stepped during backward, so it only runs the
///   closure when given one; without overlap it is fsdp.step();
/// - zero_grad(): LibTorch's (the gradients live inside the wrapper, so there is nothing to
///   clear);
/// - add_param_group(): the parameters must be unit parameters in no other group; their
///   optimizers are made (on their owners) at the start of the next backward or step;
/// - state(): an entry per parameter of the groups (ShardedParamState: steps since added, owner);
/// - checkpoints: save_distributed_checkpoint(optimizer, dir) saves the whole wrapper (parameter
///   rows and every optimizer), as save_distributed_state(fsdp, dir); torch::save(optimizer)
///   is an error that says so.
class FullyShardedOptimizer final : public torch::optim::Optimizer,
                                    public DelegatingCheckpointable,
                                    public ScaledStepping,
                                    public DelegatingPortable {
 public:
  torch::Tensor step(LossClosure closure = nullptr) override;
  /// Hides torch::optim::Optimizer::add_param_group (not virtual; a group added through a
  /// base-class reference is registered the same way, at the next backward or step).
  void add_param_group(const torch::optim::OptimizerParamGroup& param_group);
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
  FullyShardedDataParallel& wrapper() { return owner_; }
  /// A GradScaler given this optimizer unscales and steps the model (its reduced gradients).
  ScaledStepping& scaling_target() override;
  /// shampoo::clip_grad_norm_ on this optimizer: FullyShardedDataParallel::clip_grad_norm_ over
  /// its param groups' parameters, whose norms are combined in that order (as LibTorch combines
  /// those of the parameters it is given).
  double clip_grad_norm_(double max_norm, double norm_type = 2.0);

 protected:
  /// Checkpoints (and whole-run checkpoints) save and load the whole wrapper.
  DistributedCheckpointable& checkpoint_delegate() const override;
  PortableCheckpointable& portable_delegate() const override;

 private:
  friend class detail::FsdpGroups;
  FullyShardedOptimizer(FullyShardedDataParallel& owner,
                        std::vector<torch::optim::OptimizerParamGroup> groups,
                        std::unique_ptr<torch::optim::OptimizerOptions> defaults);
  FullyShardedDataParallel& owner_;
};

class FullyShardedDataParallel : public DelegatingCheckpointable,
                                 public ScaledStepping,
                                 public DelegatingPortable {
 public:
  /// Shards `units` (the same units, in the same order, on every rank) over `group` and builds
  /// the optimizers with `factory`. Errors: a parameter in two units (or twice in one), one that
  /// is not a contiguous leaf that requires grad, a unit whose parameters differ in device or
  /// dtype, an empty unit, units that differ across ranks (checked before any other collective,
  /// so a mismatch is an error on every rank, not a hang). Collective.
  FullyShardedDataParallel(std::vector<ShardedUnit> units, GroupOptimizerFactory factory,
                           c10::intrusive_ptr<c10d::ProcessGroup> group,
                           FullyShardedOptions options = {});
  /// With the user's param groups, as for any torch::optim optimizer (lossless mode): each group
  /// holds unit parameters, with options of the factory's optimizer type (e.g.
  /// torch::optim::AdamOptions, shampoo::ShampooOptions) or none (the factory's). Each rank's
  /// one optimizer holds the rank's parameters of group g as its group g, with group g's
  /// options (DistributedShampoo merges groups that differ only in float options into one
  /// virtual group). Unit parameters in no group are not stepped (frozen), as with a LibTorch
  /// optimizer that was not given them; add_param_group on optimizer() adds them later.
  ///
  ///   std::vector<torch::optim::OptimizerParamGroup> groups;
  ///   groups.emplace_back(weights, std::make_unique<shampoo::ShampooOptions>(options));
  ///   groups.emplace_back(biases, std::make_unique<shampoo::ShampooOptions>(
  ///                                   shampoo::ShampooOptions(options).weight_decay(0.0)));
  ///   shampoo::FullyShardedDataParallel fsdp(units, std::move(groups), factory, group);
  ///   torch::optim::StepLR schedule(fsdp.optimizer(), 100, 0.5);
  FullyShardedDataParallel(std::vector<ShardedUnit> units,
                           std::vector<torch::optim::OptimizerParamGroup> param_groups,
                           GroupOptimizerFactory factory,
                           c10::intrusive_ptr<c10d::ProcessGroup> group,
                           FullyShardedOptions options = {});
  ~FullyShardedDataParallel() override;
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  size_t num_units() const;
  /// The index of the unit named `name`; an error naming the units when there is none.
  size_t unit_index(const std::string& name) const;

  /// Runs the unit's forward: waits for the unit's pending step, gathers its parameters, calls
  /// fn (which uses the module's parameters as usual), arranges the gathering before the unit's
  /// backward and, with reshard_after_forward, releases the parameters. Returns fn's output.
  at::Tensor forward(size_t unit, const std::function<at::Tensor()>& fn);

  /// Without overlap_step: steps every unit on the gradients reduced since the last step (after
  /// the k-th backward of an accumulation). With overlap_step it is an error (the steps run in
  /// backward). Collective.
  void step();
  /// Waits for every step in flight and rethrows the first failure of one.
  void wait();

  /// Without overlap_step: the averaged gradients this rank holds for step() (a GradScaler
  /// unscales them in place). An error with overlap_step.
  std::vector<at::Tensor> reduced_gradients();
  /// Without overlap_step: drops the reduced gradients instead of stepping (a GradScaler's
  /// skipped step; every rank must do the same). The same errors as step().
  void skip_step();

  /// GradScaler::unscale_(fsdp) and step(fsdp), or on optimizer(), reach an internal object
  /// (ScaledStepping): without overlap_step it unscales the reduced gradients and calls step() or
  /// skip_step(); with overlap_step unscaling is an error naming the scaler's call (the steps ran
  /// in backward, before every gradient was known to be finite), and a disabled scaler's step
  /// does nothing.
  ScaledStepping& scaling_target() override;
  /// Without overlap_step, lossless, between backward and step(): clips the reduced gradients by
  /// their global norm, as torch::nn::utils::clip_grad_norm_ on the full averaged gradients (bit
  /// for bit): one all-reduce of the per-parameter norms. Returns the total norm. Collective.
  double clip_grad_norm_(double max_norm, double norm_type = 2.0);

  /// Gathers every unit's full parameters and keeps them until release_all(), e.g. to evaluate:
  /// forwards in between (without gradients) neither gather nor release. Waits for the steps in
  /// flight first. Collective.
  void gather_all();
  /// Releases what gather_all() gathered.
  void release_all();

  /// The optimizer that steps `param` on this rank: lossless, the rank's one optimizer when the
  /// rank owns `param` and it is in a param group, else null; local shards, the unit's (over
  /// this rank's rows of its parameters), null when the rank holds none of them.
  torch::optim::Optimizer* optimizer_of(const at::Tensor& param);
  /// Every optimizer on this rank: lossless, the one optimizer (over no parameters on a rank
  /// that owns none); local shards, one per unit it holds rows of. Schedulers and generic
  /// code act on optimizer(). An lr set on these directly (one value on every one holding the
  /// group) is taken over into optimizer()'s groups at the next defined point; set on both
  /// sides, it is an error. Other options set here directly stay until their group's options in
  /// optimizer() change.
  std::vector<torch::optim::Optimizer*> optimizers();
  /// The model's optimizer as LibTorch code holds one (FullyShardedOptimizer): its param groups'
  /// options (lr, weight decay, ...) are copied into the rank's optimizer when they changed,
  /// at one defined point per iteration: the start of backward with overlap_step, the start of
  /// step() without. Every step of an iteration has ended when backward() (overlap) or step()
  /// returns, so a scheduler's step() or set_lr() between iterations applies to the next one.
  torch::optim::Optimizer& optimizer();
  /// The rank that steps `param` in lossless mode (-1 in local-shard mode); an error for a
  /// tensor that is no unit's parameter.
  int owner_of(const at::Tensor& param) const;
  /// This rank's row chunk of `param` (its shard, valid rows only: [rows, ...]).
  at::Tensor shard_of(const at::Tensor& param) const;
  /// The full value of `param` in its own dtype (a new tensor, gathered from every rank).
  /// Collective.
  at::Tensor full_value(const at::Tensor& param);
  /// The options it was built with (options().param_dtype(): the dtype units compute in, unset:
  /// the parameters' own).
  const FullyShardedOptions& options() const;

  /// Passes and steps so far, and the bytes this rank holds now.
  FullyShardedStats stats() const;

  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const;

  // World-size-independent checkpoints (save_distributed_checkpoint; DistributedCheckpointable),
  // lossless mode (local shards: an error). Pieces: each rank's rows of every parameter, and each
  // owner's optimizer of its parameters (DistributedShampoo's own pieces, or a LibTorch
  // optimizer's archive). Loading checks the units' names and shapes against the checkpoint's ("a
  // checkpoint of another model" names the first difference) and installs nothing unless every
  // rank read its part. Waits for the steps in flight first, and registers param groups added to
  // optimizer() since.
  // Whole-run checkpoints that any layout loads (save_training_checkpoint;
  // PortableCheckpointable, parallel/optimizers/portable_checkpoint.h), lossless mode: replica 0's
  // ranks write their rows of every parameter as the model's row pieces, each owner the state of
  // its parameters by name (every replica when the state is split across them), and the owners
  // the gradients of an accumulation in progress, which only full sharding resumes (at any world
  // size); loading reads this rank's rows, whoever wrote them.
  // Both interfaces are answered by an internal object (detail::FsdpCheckpoint,
  // fully_sharded_checkpoint.h).

 protected:
  DistributedCheckpointable& checkpoint_delegate() const override;
  PortableCheckpointable& portable_delegate() const override;

 private:
  friend class FullyShardedOptimizer;
  friend void save_full_model(FullyShardedDataParallel& fsdp, const torch::nn::Module& model,
                              const std::filesystem::path& path);
  class Scaling;  // its ScaledStepping, fully_sharded.cpp
  std::shared_ptr<detail::FsdpState> state_;
  std::unique_ptr<detail::FsdpCheckpoint> checkpoint_;
  std::unique_ptr<Scaling> scaling_;
};

/// Saves the whole model as the same model without sharding saves it (torch::save(model, path)),
/// so that the unsharded model loads it with torch::load(model, path): every parameter is
/// gathered in its own dtype (not param_dtype's), one rank writes the file (rank 0; under hybrid
/// sharding rank 0 of replica 0's shard group) to a temporary name of its own, then renames it,
/// the parameters are released again, and every rank of every replica returns once the file is
/// there or throws the writer's error. `model` is the module whose
/// parameters the units hold; its buffers are saved as they are. Collective; between
/// iterations. (torch::save(model) itself would write the empty [0]-shaped tensors the module
/// holds while sharded.)
void save_full_model(FullyShardedDataParallel& fsdp, const torch::nn::Module& model,
                     const std::filesystem::path& path);

/// One unit per module of `model` that has parameters, named by its index in the Sequential.
std::vector<ShardedUnit> sequential_units(const torch::nn::Sequential& model);

/// model->forward(input) with every module that has parameters run as its unit of `fsdp` (the
/// units of sequential_units(model)); with a param_dtype, a unit's floating-point input is cast
/// to it first.
at::Tensor forward_sequential(FullyShardedDataParallel& fsdp, torch::nn::Sequential& model,
                              at::Tensor input);

}  // namespace shampoo
