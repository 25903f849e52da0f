#include "parallel/optimizers/capabilities.h"

#include "parallel/checkpoints/distributed_checkpoint.h"
#include "parallel/optimizers/loss_scaling.h"
#include "parallel/optimizers/parameter_owners.h"
#include "parallel/optimizers/partial_step.h"
#include "parallel/optimizers/phased_backward_step.h"
#include "parallel/optimizers/portable_checkpoint.h"

namespace shampoo {
namespace detail {

Capabilities capabilities_of(const torch::optim::Optimizer& optimizer) {
  // One object, several interfaces: a const optimizer's pointers are for reading (the header).
  auto* object = const_cast<torch::optim::Optimizer*>(&optimizer);
  Capabilities found;
  found.phased = dynamic_cast<PhasedBackwardStep*>(object);
  found.partial = dynamic_cast<PartialStep*>(object);
  found.owners = dynamic_cast<ParameterOwners*>(object);
  found.scaled = dynamic_cast<ScaledStepping*>(object);
  found.portable = dynamic_cast<PortableCheckpointable*>(object);
  found.checkpointable = dynamic_cast<DistributedCheckpointable*>(object);
  return found;
}

}  // namespace detail

PortableCheckpointable* as_portable(torch::optim::Optimizer& optimizer) {
  return detail::capabilities_of(optimizer).portable;
}

}  // namespace shampoo
