#pragma once
/// How a public optimizer implements the internal interfaces (phased_step.h, block_states.h,
/// parameter_owners.h) behind its class, so that its installed header needs none of them: it
/// keeps one adapter per interface in an AdaptersOf (each forwards to the object, whose members it
/// may reach as a friend), and registers a lookup that binds them to the object asked about and
/// returns them (capabilities.h). Rebinding on every lookup lets the adapters follow an optimizer
/// that was moved.

#include <atomic>
#include <tuple>
#include <vector>

#include "parallel/optimizers/block_states.h"
#include "parallel/optimizers/capabilities.h"
#include "parallel/optimizers/parameter_owners.h"
#include "parallel/optimizers/phased_step.h"

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

/// Forwards to the object's private phased_step_open, begin_phased_step(in_pass),
/// step_parameters, finish_phased_step, abort_phased_step and set_in_backward.
template <class T>
class PhasedStepOf final : public PhasedStep, public AdapterOf<T> {
 public:
  void set_in_backward(bool in_backward) override { this->object().set_in_backward(in_backward); }
  bool step_open() const override { return this->object().phased_step_open(); }
  void begin(bool in_pass) override { this->object().begin_phased_step(in_pass); }
  void step_parameters(const std::vector<at::Tensor>& params) override {
    this->object().step_parameters(params);
  }
  void finish() override { this->object().finish_phased_step(); }
  void abort() override { this->object().abort_phased_step(); }
  void set_in(Capabilities& found) { found.phased = this; }
};

template <class T>
class BlockStatesOf final : public BlockStates, public AdapterOf<T> {
 public:
  void register_appended() override { this->object().register_appended(); }
  void save_block_pieces(PieceWriter& pieces, const BlockPieceName& name_of) const override {
    this->object().save_block_pieces(pieces, name_of);
  }
  std::function<void()> prepare_block_load(PieceReader& pieces, const BlockPieceName& name_of,
                                           std::vector<int64_t> group_steps,
                                           std::vector<double> group_lr_sums,
                                           std::optional<bool> eval_mode) override {
    return this->object().prepare_block_load(pieces, name_of, std::move(group_steps),
                                             std::move(group_lr_sums), eval_mode);
  }
  bool in_eval_mode() const override { return this->object().in_eval_mode(); }
  int64_t group_step(size_t group) const override { return this->object().group_step(group); }
  double group_lr_sum(size_t group) const override { return this->object().group_lr_sum(group); }
  void set_in(Capabilities& found) { found.blocks = this; }
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
