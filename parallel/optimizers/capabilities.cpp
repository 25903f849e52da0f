#include "parallel/optimizers/capabilities.h"

#include <algorithm>
#include <mutex>
#include <vector>

#include "parallel/checkpoints/distributed_checkpoint.h"
#include "parallel/optimizers/loss_scaling.h"
#include "parallel/optimizers/portable_checkpoint.h"

namespace shampoo {
namespace detail {
namespace {

struct Lookups {
  std::mutex mutex;
  std::vector<InternalInterfaceLookup> functions;
};

Lookups& lookups() {
  static Lookups registered;
  return registered;
}

}  // namespace

void register_internal_interfaces(InternalInterfaceLookup lookup) {
  auto& all = lookups();
  std::lock_guard<std::mutex> lock(all.mutex);
  if (std::find(all.functions.begin(), all.functions.end(), lookup) == all.functions.end()) {
    all.functions.push_back(lookup);
  }
}

Capabilities capabilities_of(const torch::optim::Optimizer& optimizer) {
  // One object, several interfaces: a const optimizer's pointers are for reading (the header).
  auto& object = const_cast<torch::optim::Optimizer&>(optimizer);
  Capabilities found;
  found.scaled = dynamic_cast<ScaledStepping*>(&object);
  found.portable = dynamic_cast<PortableCheckpointable*>(&object);
  found.checkpointable = find_checkpointable(optimizer);
  // A lookup casts and fills `found`; it registers nothing, so it runs under the lock.
  auto& all = lookups();
  std::lock_guard<std::mutex> lock(all.mutex);
  for (const auto lookup : all.functions) {
    if (lookup(object, found)) break;
  }
  return found;
}

}  // namespace detail

PortableCheckpointable* as_portable(torch::optim::Optimizer& optimizer) {
  return detail::capabilities_of(optimizer).portable;
}

}  // namespace shampoo
