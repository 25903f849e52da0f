#pragma once
/// Optimizer-state sharding (ZeRO-1 / fairscale OSS) for any torch::optim optimizer: whole
/// parameters are assigned to the ranks, balanced by size; each rank keeps optimizer state only
/// for its own parameters and steps them; one AllGather of the updated parameters per step brings
/// every rank up to date. Gradients must be averaged before step() (GradientSynchronizer); with
/// GradientSynchronizer::shard_gradients(optimizer) each rank receives only the gradients of the
/// parameters it owns (ZeRO-2).
///
///   shampoo::ShardedOptimizer opt(
///       model->parameters(),
///       shampoo::group_optimizer_factory<torch::optim::Adam>(torch::optim::AdamOptions(1e-3)),
///       group);

#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <unordered_map>
#include <vector>

#include "parallel/checkpoints/distributed_checkpoint.h"
#include "parallel/optimizers/optimizer_factory.h"
#include "parallel/optimizers/portable_checkpoint.h"

namespace shampoo {
namespace detail {
class OwnerMajorLayout;  // parallel/communication/ownership_plan.h
class OwnershipPlan;
class LocalOptimizer;  // parallel/optimizers/local_optimizer.h
class OptionsPush;     // parallel/optimizers/options_push.h
}  // namespace detail

/// The entry of a parameter in ShardedOptimizer::state() (LibTorch's per-parameter state map,
/// keyed by the parameter's TensorImpl): every parameter has one on every rank. A summary: the
/// optimizer state itself is in the owner's local_optimizer().
struct ShardedParamState : torch::optim::OptimizerCloneableParamState<ShardedParamState> {
  /// Completed steps of this optimizer since the parameter was added (every rank counts them,
  /// whichever rank owns the parameter; the owner's local state counts only the steps in which
  /// the parameter had a gradient).
  TORCH_ARG(int64_t, step) = 0;
  /// The rank that keeps the parameter's optimizer state and steps it.
  TORCH_ARG(int64_t, owner) = 0;

 public:
  void serialize(torch::serialize::OutputArchive& archive) const override;
  void serialize(torch::serialize::InputArchive& archive) override;
};

class ShardedOptimizer : public torch::optim::Optimizer,
                         public DelegatingCheckpointable,
                         public DelegatingPortable {
 public:
  /// All parameters must share one dtype and device (any floating dtype, any strided layout:
  /// a channels_last weight is gathered in its logical order and written back in its layout).
  /// Every rank passes the same parameters. The factory (a GroupOptimizerFactory) makes this
  /// rank's local optimizer over its share of the first param group: the parameters of it this
  /// rank owns (possibly none: LibTorch's optimizers accept an empty list) and the group's
  /// options when it has some; it returns an optimizer with that one group. An empty list is
  /// accepted, as LibTorch's optimizers accept one (add groups later); step() without parameters is
  /// an error.
  ShardedOptimizer(std::vector<torch::Tensor> params, const GroupOptimizerFactory& factory,
                   c10::intrusive_ptr<c10d::ProcessGroup> group);
  /// The user's param groups, as for any torch::optim optimizer: each with its own options of the
  /// local optimizer's type (torch::optim::AdamOptions for a factory that makes an Adam), or
  /// none (the factory's defaults). The local optimizer gets the same groups, each with the
  /// parameters of it this rank owns (a group may be empty on a rank). param_groups() are these
  /// groups: their options (lr, weight decay, betas, ...) are copied into the local optimizer's
  /// groups at each step where they changed, so LibTorch's schedulers and generic code act on
  /// this optimizer.
  ///
  ///   std::vector<torch::optim::OptimizerParamGroup> groups;
  ///   groups.emplace_back(weights, std::make_unique<torch::optim::AdamOptions>(1e-3));
  ///   groups.emplace_back(biases, std::make_unique<torch::optim::AdamOptions>(3e-3));
  ///   shampoo::ShardedOptimizer opt(
  ///       std::move(groups),
  ///       shampoo::group_optimizer_factory<torch::optim::Adam>(torch::optim::AdamOptions(1e-3)),
  ///       pg);
  ShardedOptimizer(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                   const GroupOptimizerFactory& factory,
                   c10::intrusive_ptr<c10d::ProcessGroup> group);
  ~ShardedOptimizer() override;

  /// Steps this rank's parameters, then one AllGather of every rank's updated parameters.
  /// In backward (apply_optimizer_in_backward) the local steps run as gradients arrive and the
  /// AllGather once at the end of backward; step() is then an error. Groups and parameters
  /// appended through the base class (torch::optim::Optimizer::add_param_group, add_parameters)
  /// are registered first, as add_param_group registers them. Collective.
  torch::Tensor step(LossClosure closure = nullptr) override;

  /// Adds a group (its options of the local optimizer's type, or none: the defaults): owners
  /// for its parameters (the balance by size goes on from the current loads), the owned ones to
  /// the local optimizer as a group of their own. Hides torch::optim::Optimizer::add_param_group,
  /// which is not virtual; a group added through a base-class reference is registered the same
  /// way at the next step(). Collective: every rank adds the same group.
  void add_param_group(const torch::optim::OptimizerParamGroup& param_group);

  /// This rank's optimizer (over its own parameters, in groups that mirror param_groups()). Set
  /// options on this optimizer's param_groups() (schedulers too): at each step they are copied
  /// into the local optimizer where they changed since the last step. A learning rate set here
  /// alone (the way before param_groups() mirrored the user's groups) is taken over into
  /// param_groups(); set on both, it is an error. Other options set here directly stay until
  /// their group's options change (as on full sharding's optimizers()).
  torch::optim::Optimizer& local_optimizer();
  const torch::optim::Optimizer& local_optimizer() const;
  /// Owner rank of each parameter (in the order given, parameters added later after them).
  const std::vector<int>& owners() const;
  /// Who steps what (gradient sharding asks it): the process group of the owners and the owner
  /// of `param`, nullopt when it is not one of this optimizer's.
  c10::intrusive_ptr<c10d::ProcessGroup> owners_group() const { return group_; }
  std::optional<int> owner_of(const at::Tensor& param) const;
  /// Bytes of optimizer state on this rank (-1 when the optimizer type is not one of LibTorch's).
  int64_t state_bytes() const;

  /// Each rank saves its own optimizer state; loading needs the same world size and rank.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // World-size-independent checkpoints (save_distributed_checkpoint; DistributedCheckpointable):
  // one piece per parameter ("param/<i>", its state in the local optimizer) written by its
  // owner, and the options of every param group once; loading at any world size gives each rank
  // the states of the parameters it owns now. The local optimizer must be LibTorch's SGD, Adam,
  // AdamW, Adagrad or RMSprop (whose per-parameter state types are known).
  // Whole-run checkpoints that any layout loads (save_training_checkpoint;
  // PortableCheckpointable, parallel/optimizers/portable_checkpoint.h): each owner writes the
  // local optimizer's state of its parameters by name; loading gives each rank the states of the
  // parameters it owns now and the groups' saved options.
  // Both interfaces are answered by an internal object (ShardedOptimizer::Checkpoint,
  // sharded_optimizer_checkpoint.h).

 protected:
  DistributedCheckpointable& checkpoint_delegate() const override;
  PortableCheckpointable& portable_delegate() const override;

 private:
  // The wrappers reach its phased step (Phased) and its owners (an adapter forwarding to
  // owners_group and owner_of) through the internal interfaces (parallel/optimizers/
  // capabilities.h).
  struct Interfaces;  // the adapters and the lookup it registers, sharded_optimizer.cpp
  class Phased;       // its PhasedStep (optimizer-in-backward), sharded_optimizer.cpp
  class Checkpoint;   // its checkpoints, sharded_optimizer_checkpoint.h

  std::vector<torch::Tensor> params_;  // every registered parameter, in registration order
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::unique_ptr<detail::OwnershipPlan> plan_;       // item i = params_[i]
  std::unique_ptr<detail::OwnerMajorLayout> layout_;  // of params_, the AllGather after each step
  std::unordered_map<const void*, size_t> index_of_;  // TensorImpl -> position in params_
  std::vector<int64_t> group_sizes_;                  // per param group: parameters registered
  std::vector<int64_t> added_at_;  // per parameter: steps_ when it was registered
  int64_t steps_ = 0;              // completed steps
  at::Tensor send_;
  at::Tensor receive_;
  std::unique_ptr<detail::LocalOptimizer> local_;  // always made (over none, possibly)
  std::unique_ptr<detail::OptionsPush> push_;      // param_groups()' options into local_

  /// Registers the parameters of param_groups()[group] from position `first` on (checked first:
  /// dtype, device, leaves, no duplicates, the same on every rank): owners, segments, buffers.
  /// Returns this rank's new ones. Collective.
  std::vector<torch::Tensor> register_params(size_t group, size_t first);
  /// register_params' check on this rank: the first mistake among the new parameters ("" when
  /// none), and their elements in `numel`.
  std::string check_added(size_t group, size_t first, int64_t& numel) const;
  /// Registers param_groups()[g], a new group: its parameters, and its owned ones as a group of
  /// the local optimizer. Collective.
  void register_group(size_t g);
  /// Registers what the base class appended to param_groups() since the last call (new groups to
  /// the local optimizer too). Collective when something was.
  void register_added_params();
  /// Copies each group's options into the local optimizer's group where they changed (taking
  /// over an lr that was set on the local optimizer alone): options_push.h's rule.
  void push_options_to_local();
  /// After a load into the local optimizer: its options back into param_groups().
  void pull_options_from_local();
  void write_state_entries();
  /// A copy of a group's options; an error naming the group when their type is not the local
  /// optimizer's.
  std::unique_ptr<torch::optim::OptimizerOptions> checked_options(
      const torch::optim::OptimizerOptions& options, size_t group) const;

  /// The owners' updated parameters to every rank.
  void all_gather();

  std::unique_ptr<Interfaces> interfaces_;
  std::unique_ptr<Phased> phased_;
  std::unique_ptr<Checkpoint> checkpoint_;
};

}  // namespace shampoo
