#pragma once
/// The fault points of one DistributedShampoo step: the places where the fault seam of the tests
/// (DistributedShampoo::set_fault_injector_for_testing) calls its function, whose throw fails the
/// step there. A failed step changes nothing (docs/training.md, "When a step fails").

#include <functional>

namespace shampoo {

/// Where in a step a fault is injected (each point is passed once per step that reaches it).
enum class FaultPoint {
  kStatisticsUpdated,  ///< filter, grafting and factor statistics and amortized roots changed
  kBeforeUpdate,       ///< every block is preconditioned; no update written yet
  kComputed,           ///< this rank's blocks are applied (single process) or ready to send
  kExchange,           ///< just before the AllGather (distributed) / the end of the step
};

using StepFaultInjector = std::function<void(FaultPoint)>;

/// The former name of FaultPoint.
using StepPhase = FaultPoint;

}  // namespace shampoo
