#pragma once
/// Which rank steps each parameter: what gradient sharding (ZeRO-2,
/// GradientSynchronizer::shard_gradients) needs to know of an optimizer whose ranks each own a
/// subset of the parameters. A parameter's averaged gradient is then reduced to its owner only,
/// and every other rank releases it.
///
/// Implemented by ShardedOptimizer (whole parameters), DistributedShampoo (with
/// DistributedOptions::shard_by_parameter, so that every block of a parameter has one owner) and
/// InBackwardOptimizer (the owners of its sets' optimizers; LibTorch optimizers step every
/// parameter on every rank).

#include <ATen/ATen.h>

#include <optional>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace shampoo {

class ParameterOwners {
 public:
  /// owner_of's answer for a parameter that every rank steps: its gradient is all-reduced.
  static constexpr int kEveryRank = -1;

  virtual ~ParameterOwners() = default;

  /// The process group whose ranks the owners are (null: one process).
  virtual c10::intrusive_ptr<c10d::ProcessGroup> owners_group() const = 0;
  /// The rank of owners_group() that steps `param` (and alone needs its gradient), kEveryRank
  /// when every rank steps it, or nullopt when `param` is not one of this optimizer's. An error
  /// when the ownership of `param` cannot be expressed per parameter.
  virtual std::optional<int> owner_of(const at::Tensor& param) const = 0;

 protected:
  ParameterOwners() = default;
  ParameterOwners(const ParameterOwners&) = default;
  ParameterOwners& operator=(const ParameterOwners&) = default;
  ParameterOwners(ParameterOwners&&) = default;
  ParameterOwners& operator=(ParameterOwners&&) = default;
};

}  // namespace shampoo
