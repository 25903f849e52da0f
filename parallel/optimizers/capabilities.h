#pragma once
/// What an optimizer offers a wrapper beyond torch::optim::Optimizer: the interfaces of
/// optimizers/ and checkpoints/ it implements, looked up in one place (capabilities.cpp holds
/// the library's only casts to them). A wrapper looks an optimizer up once and keeps the result.

#include <torch/optim/optimizer.h>

namespace shampoo {

class DistributedCheckpointable;
class ParameterOwners;
class PartialStep;
class PhasedBackwardStep;
class PortableCheckpointable;
class ScaledStepping;

namespace detail {

struct Capabilities {
  /// Steps in phases during backward (phased_backward_step.h): DistributedShampoo,
  /// ShardedOptimizer.
  PhasedBackwardStep* phased = nullptr;
  /// Keeps state across its parameters and steps some of them (partial_step.h): DistributedShampoo.
  PartialStep* partial = nullptr;
  /// Its parameters are owned by ranks (parameter_owners.h).
  ParameterOwners* owners = nullptr;
  /// A wrapper the GradScaler steps through (loss_scaling.h).
  ScaledStepping* scaled = nullptr;
  /// Saves its state by parameter name (portable_checkpoint.h).
  PortableCheckpointable* portable = nullptr;
  /// Saves world-size-independent checkpoint directories (distributed_checkpoint.h).
  DistributedCheckpointable* checkpointable = nullptr;
};

/// The interfaces `optimizer` implements. The pointers are to `optimizer` itself; a caller
/// holding it as const uses them for reading only.
Capabilities capabilities_of(const torch::optim::Optimizer& optimizer);

}  // namespace detail
}  // namespace shampoo
