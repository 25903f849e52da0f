#pragma once
/// How a public optimizer implements the internal interfaces (phased_backward_step.h,
/// partial_step.h, parameter_owners.h) behind its class, so that its installed header needs none
/// of them: it keeps one adapter per interface (each forwards to the object, whose members it
/// may reach as a friend), and registers a lookup that binds them to the object asked about and
/// returns them (capabilities.h). Rebinding on every lookup lets the adapters follow an optimizer
/// that was moved.

#include <atomic>
#include <vector>

#include "parallel/optimizers/capabilities.h"
#include "parallel/optimizers/parameter_owners.h"
#include "parallel/optimizers/partial_step.h"
#include "parallel/optimizers/phased_backward_step.h"

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

template <class T>
class PhasedStepOf final : public PhasedBackwardStep, public AdapterOf<T> {
 public:
  void set_in_backward(bool in_backward) override { this->object().set_in_backward(in_backward); }
  bool backward_step_open() const override { return this->object().backward_step_open(); }
  void begin_backward_step() override { this->object().begin_backward_step(); }
  void step_parameters(const std::vector<at::Tensor>& params) override {
    this->object().step_parameters(params);
  }
  void finish_backward_step() override { this->object().finish_backward_step(); }
  void abort_backward_step() override { this->object().abort_backward_step(); }
};

template <class T>
class PartialStepOf final : public PartialStep, public AdapterOf<T> {
 public:
  void step_only(const std::vector<at::Tensor>& params) override {
    this->object().step_only(params);
  }
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
};

}  // namespace detail
}  // namespace shampoo
