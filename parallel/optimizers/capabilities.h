#pragma once
/// What an optimizer offers a wrapper beyond torch::optim::Optimizer: the interfaces of
/// optimizers/ and checkpoints/ it implements, looked up in one place (capabilities.cpp). A
/// wrapper looks an optimizer up once and keeps the result.
///
/// Two kinds of interface. The public ones (ScaledStepping, PortableCheckpointable,
/// DistributedCheckpointable, installed with the headers a user includes) are base classes of the
/// public optimizers and found by a cast. The internal ones (PhasedStep, BlockStates,
/// ParameterOwners: not installed) live behind the public classes: each class that implements them
/// registers a lookup (register_internal_interfaces) that answers for its objects with adapters it
/// keeps (internal_interfaces.h).

#include <torch/optim/optimizer.h>

namespace shampoo {

class DistributedCheckpointable;
class BlockStates;
class ParameterOwners;
class PhasedStep;
class PortableCheckpointable;
class ScaledStepping;

namespace detail {

struct Capabilities {
  /// Steps in phases: begin, the work of some parameters, finish (phased_step.h):
  /// DistributedShampoo, ShardedOptimizer.
  PhasedStep* phased = nullptr;
  /// Keeps its state by block, across its parameters (block_states.h): DistributedShampoo.
  BlockStates* blocks = nullptr;
  /// Its parameters are owned by ranks (parameter_owners.h): DistributedShampoo,
  /// ShardedOptimizer, InBackwardOptimizer.
  ParameterOwners* owners = nullptr;
  /// A wrapper the GradScaler steps through (loss_scaling.h).
  ScaledStepping* scaled = nullptr;
  /// Saves its state by parameter name (portable_checkpoint.h).
  PortableCheckpointable* portable = nullptr;
  /// Saves world-size-independent checkpoint directories (distributed_checkpoint.h).
  DistributedCheckpointable* checkpointable = nullptr;
};

/// The interfaces `optimizer` implements. The pointers are to `optimizer` itself or to adapters
/// it owns, valid while it lives where it is (look it up again after moving it); a caller holding
/// it as const uses them for reading only.
Capabilities capabilities_of(const torch::optim::Optimizer& optimizer);

/// Answers for the optimizers of one class: when `optimizer` is one, sets the internal interfaces
/// it implements in `found` (phased, blocks, owners) and returns true; otherwise returns false.
using InternalInterfaceLookup = bool (*)(torch::optim::Optimizer& optimizer, Capabilities& found);

/// Adds `lookup` to those capabilities_of asks (once: a second call with the same function does
/// nothing). A class calls it from its constructors, so that it is registered before any of its
/// objects can be looked up; thread-safe.
void register_internal_interfaces(InternalInterfaceLookup lookup);

}  // namespace detail
}  // namespace shampoo
