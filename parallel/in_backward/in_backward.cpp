// Optimizer-in-backward: the sets of parameters and their optimizers, the backward pass that
// steps them as their gradients arrive, data parallelism and loss scaling.
#include "parallel/in_backward/in_backward.h"

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include "parallel/in_backward/in_backward_checkpoint.h"
#include "parallel/optimizers/capabilities.h"
#include "parallel/optimizers/internal_interfaces.h"

namespace shampoo {

struct InBackwardOptimizer::Interfaces
    : detail::AdaptersOf<InBackwardOptimizer, detail::ParameterOwnersOf> {
  /// The lookup registered with capabilities_of: a InBackwardOptimizer's internal objects.
  static bool lookup(torch::optim::Optimizer& optimizer, detail::Capabilities& found);
};

bool InBackwardOptimizer::Interfaces::lookup(torch::optim::Optimizer& optimizer,
                                             detail::Capabilities& found) {
  auto* in_backward = dynamic_cast<InBackwardOptimizer*>(&optimizer);
  if (in_backward != nullptr && in_backward->interfaces_) {  // null once moved from
    in_backward->interfaces_->bind(in_backward, found);
  }
  return in_backward != nullptr;
}

InBackwardOptimizer::InBackwardOptimizer()
    : torch::optim::Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                              std::make_unique<torch::optim::OptimizerOptions>()),
      state_(std::make_shared<State>()),
      interfaces_(std::make_unique<Interfaces>()),
      checkpoint_(std::make_unique<Checkpoint>(state_)) {
  detail::register_internal_interfaces(&Interfaces::lookup);
  state_->state_entries = &torch::optim::Optimizer::state();
}

InBackwardOptimizer::~InBackwardOptimizer() {
  if (!state_) return;
  for (const auto& entry : state_->entries) {
    detail::remove_grad_ready_callback(entry.param, entry.hook);
  }
  for (auto& set : state_->sets) {
    if (auto* phased = set.capabilities.phased) phased->set_in_backward(false);
  }
  if (state_->sync != nullptr) state_->sync->set_bucket_ready_callback(nullptr);
}

InBackwardOptimizer::InBackwardOptimizer(InBackwardOptimizer&& other) noexcept
    : torch::optim::Optimizer(std::move(other)),
      state_(std::move(other.state_)),
      interfaces_(std::move(other.interfaces_)),
      checkpoint_(std::move(other.checkpoint_)) {
  if (state_) state_->state_entries = &torch::optim::Optimizer::state();
}

InBackwardOptimizer& InBackwardOptimizer::operator=(InBackwardOptimizer&& other) noexcept {
  torch::optim::Optimizer::operator=(std::move(other));
  state_ = std::move(other.state_);
  interfaces_ = std::move(other.interfaces_);
  checkpoint_ = std::move(other.checkpoint_);
  if (state_) state_->state_entries = &torch::optim::Optimizer::state();
  return *this;
}

torch::optim::Optimizer& InBackwardOptimizer::add(std::vector<torch::Tensor> params,
                                                  OptimizerFactory factory) {
  TORCH_CHECK(factory, "apply_optimizer_in_backward: the optimizer factory is empty");
  TORCH_CHECK(!params.empty(), "apply_optimizer_in_backward: no parameters given");
  std::unordered_set<const void*> seen;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    TORCH_CHECK(p.defined() && p.requires_grad(), "apply_optimizer_in_backward: parameter ", i,
                " does not require grad, so it would never step");
    TORCH_CHECK(p.is_leaf(), "apply_optimizer_in_backward: parameter ", i, " is not a leaf tensor");
    TORCH_CHECK(state_->entry_of.count(p.unsafeGetTensorImpl()) == 0 &&
                    seen.insert(p.unsafeGetTensorImpl()).second,
                "apply_optimizer_in_backward: parameter ", i,
                " is registered twice (a parameter may have one in-backward optimizer only)");
  }
  State::Set set;
  set.optimizer = factory(params);
  TORCH_CHECK(set.optimizer != nullptr, "apply_optimizer_in_backward: the factory returned null");
  set.capabilities = detail::capabilities_of(*set.optimizer);
  TORCH_CHECK(state_->unscaler == nullptr || set.capabilities.phased != nullptr,
              "apply_optimizer_in_backward: a GradScaler is attached, and optimizer ",
              state_->sets.size(),
              " cannot undo a step (it is not one that steps in phases, such as "
              "DistributedShampoo): a later overflow in the same backward could not be skipped");
  if (auto* phased = set.capabilities.phased) phased->set_in_backward(true);
  set.params = params;
  const size_t set_index = state_->sets.size();
  state_->sets.push_back(std::move(set));
  std::weak_ptr<State> weak = state_;
  for (auto& p : params) {
    const size_t entry = state_->entries.size();
    State::Entry e;
    e.param = p;
    e.set = set_index;
    e.hook = detail::add_grad_ready_callback(p, [weak, entry](const at::Tensor&) {
      if (auto self = weak.lock()) self->on_grad_ready(entry);
    });
    e.joined = state_->steps;
    state_->entry_of[p.unsafeGetTensorImpl()] = entry;
    state_->entries.push_back(std::move(e));
  }
  state_->write_state_entries();
  return *state_->sets.back().optimizer;
}

torch::Tensor InBackwardOptimizer::step(LossClosure /*closure*/) {
  TORCH_CHECK(false,
              "InBackwardOptimizer::step(): the optimizers step during loss.backward() "
              "(apply_optimizer_in_backward); do not call step() by hand");
}

size_t InBackwardOptimizer::num_optimizers() const { return state_->sets.size(); }

torch::optim::Optimizer& InBackwardOptimizer::optimizer(size_t index) {
  TORCH_CHECK(index < state_->sets.size(), "InBackwardOptimizer::optimizer: index ", index,
              " out of range (", state_->sets.size(), " optimizers)");
  return *state_->sets[index].optimizer;
}

void InBackwardOptimizer::set_accumulation_steps(int64_t k) {
  TORCH_CHECK(k >= 1, "InBackwardOptimizer::set_accumulation_steps: got ", k, ", expected >= 1");
  TORCH_CHECK(!state_->pass.is_open(), "set_accumulation_steps during a backward pass");
  state_->pass.set_accumulation_steps(k);
  state_->update_sync();
}

InBackwardOptimizer::NoStep::NoStep(InBackwardOptimizer& owner) : owner_(owner) {
  ++owner_.state_->no_step;
  owner_.state_->update_sync();
}

InBackwardOptimizer::NoStep::~NoStep() {
  --owner_.state_->no_step;
  owner_.state_->update_sync();
}

void InBackwardOptimizer::attach(GradientSynchronizer& sync) {
  state_->sync = &sync;
  std::weak_ptr<State> weak = state_;
  sync.set_bucket_ready_callback([weak](const std::vector<at::Tensor>& params) {
    if (auto self = weak.lock()) {
      self->open_pass();  // the synchronizer's hook may run before ours in this pass
      if (self->pass.stepping()) self->step_params_or_abort(params);
    }
  });
  state_->update_sync();
}

c10::intrusive_ptr<c10d::ProcessGroup> InBackwardOptimizer::owners_group() const {
  return state_->one_group(
      [](const torch::optim::Optimizer& optimizer) -> c10::intrusive_ptr<c10d::ProcessGroup> {
        const ParameterOwners* owners = detail::capabilities_of(optimizer).owners;
        return owners != nullptr ? owners->owners_group() : nullptr;
      },
      "shards its parameters over another process group than the ones before it; gradient "
      "sharding needs one process group");
}

std::optional<int> InBackwardOptimizer::owner_of(const at::Tensor& param) const {
  const auto it = state_->entry_of.find(param.unsafeGetTensorImpl());
  if (it == state_->entry_of.end()) return std::nullopt;
  const auto& set = state_->sets[state_->entries[it->second].set];
  const ParameterOwners* owners = set.capabilities.owners;
  if (owners == nullptr) return ParameterOwners::kEveryRank;
  return owners->owner_of(param).value_or(ParameterOwners::kEveryRank);
}

std::vector<at::Tensor> InBackwardOptimizer::gradients_to_unscale(const char* caller) {
  TORCH_CHECK(false, caller,
              ": an InBackwardOptimizer steps during backward, so a scaler cannot "
              "unscale or skip its step afterwards; call scaler.attach(optimizer) once (each set "
              "of gradients is then unscaled before it steps) and scaler.update() after backward");
}

void InBackwardOptimizer::set_unscaler(BackwardUnscaler* unscaler) {
  TORCH_CHECK(!state_->pass.is_open(),
              "InBackwardOptimizer: a GradScaler is attached or detached "
              "during a backward pass; do it between iterations");
  if (unscaler != nullptr) {
    for (size_t i = 0; i < state_->sets.size(); ++i) {
      TORCH_CHECK(state_->sets[i].capabilities.phased != nullptr,
                  "GradScaler with optimizer-in-backward: optimizer ", i,
                  " steps its parameters during backward and cannot undo those steps (a "
                  "LibTorch optimizer, or another that does not step in phases), so a gradient "
                  "that overflows later in the same backward could not skip the step. Use "
                  "DistributedShampoo in backward (its step can be undone), or the ordinary "
                  "step with scaler.step(optimizer)");
    }
  }
  state_->unscaler = unscaler;
}

int64_t InBackwardOptimizer::backward_passes() const { return state_->pass.passes(); }
int64_t InBackwardOptimizer::steps_taken() const { return state_->steps; }

InBackwardOptimizer apply_optimizer_in_backward(std::vector<torch::Tensor> params,
                                                OptimizerFactory factory) {
  InBackwardOptimizer optimizer;
  optimizer.add(std::move(params), std::move(factory));
  return optimizer;
}

}  // namespace shampoo
