#pragma once
/// How a public optimizer implements an internal interface behind its class, so that its
/// installed header needs none of them: either an internal object of its own implements the
/// interface (DistributedShampoo's and ShardedOptimizer's Phased for phased_step.h,
/// DistributedShampoo's Checkpoint for block_states.h), or it keeps an adapter that forwards to
/// its public members (ParameterOwnersOf, for parameter_owners.h) in an AdaptersOf. It registers
/// a lookup that binds them to the object asked about and returns them (capabilities.h);
/// rebinding on every lookup lets the adapters follow an optimizer that was moved.

#include <atomic>
#include <tuple>

#include "parallel/optimizers/capabilities.h"
#include "parallel/optimizers/parameter_owners.h"

namespace shampoo {
namespace detail {

/// The object an adapter forwards to.
template <class T>
class AdapterOf {
 public:
  void bind(T* object) { object_.store(object, std::memory_order_relaxed); }

 protected:
  T& object() const { return *object_.load(std::memory_order_relaxed); }

 private:
  std::atomic<T*> object_{nullptr};
};

/// Forwards to the object's public owners_group and owner_of.
template <class T>
class ParameterOwnersOf final : public ParameterOwners, public AdapterOf<T> {
 public:
  c10::intrusive_ptr<c10d::ProcessGroup> owners_group() const override {
    return this->object().owners_group();
  }
  std::optional<int> owner_of(const at::Tensor& param) const override {
    return this->object().owner_of(param);
  }
  void set_in(Capabilities& found) { found.owners = this; }
};

/// The adapters a class of type T keeps (one per interface it implements).
template <class T, template <class> class... Adapter>
class AdaptersOf {
 public:
  /// Binds every adapter to `object` and sets it in `found`.
  void bind(T* object, Capabilities& found) {
    std::apply(
        [&](auto&... adapter) {
          (adapter.bind(object), ...);
          (adapter.set_in(found), ...);
        },
        adapters_);
  }

 private:
  std::tuple<Adapter<T>...> adapters_;
};

}  // namespace detail
}  // namespace shampoo
