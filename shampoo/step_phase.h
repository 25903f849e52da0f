#pragma once
/// The phases of one DistributedShampoo step, named for the fault seam of the tests
/// (DistributedShampoo::set_fault_injector_for_testing): a function called at each phase, whose
/// throw fails the step there. A failed step changes nothing (README, "When a step fails").

#include <functional>

namespace shampoo {

enum class StepPhase {
  kStatisticsUpdated,  ///< filter, grafting and factor statistics and amortized roots changed
  kBeforeUpdate,       ///< every block is preconditioned; no update written yet
  kComputed,           ///< this rank's blocks are applied (single process) or ready to send
  kExchange,           ///< just before the AllGather (distributed) / the end of the step
};

using StepFaultInjector = std::function<void(StepPhase)>;

}  // namespace shampoo
