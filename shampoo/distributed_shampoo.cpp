#include "shampoo/distributed_shampoo.h"

#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>

#include "parallel/optimizers/internal_interfaces.h"
#include "parallel/optimizers/options_push.h"
#include "parallel/optimizers/phased_step.h"
#include "shampoo/distributed_shampoo_checkpoint.h"
#include "shampoo/engine_checkpoint.h"
#include "shampoo/shampoo_engine.h"
#include "shampoo/state_size.h"

namespace shampoo {

struct DistributedShampoo::Interfaces
    : detail::AdaptersOf<DistributedShampoo, detail::ParameterOwnersOf> {
  /// The lookup registered with capabilities_of: a DistributedShampoo's internal objects.
  static bool lookup(torch::optim::Optimizer& optimizer, detail::Capabilities& found);
};

/// PhasedStep: the step split into begin, per-parameter block work (as gradients arrive, in
/// backward; the parameters of a unit, in full sharding) and finish (the one AllGather). A step
/// not `in_pass` is one of the parameters given to the one step_parameters call alone. While in
/// backward, step() and a step not in a pass are errors.
class DistributedShampoo::Phased final : public PhasedStep {
 public:
  explicit Phased(DistributedShampoo& owner) : owner_(&owner) {}
  /// After the optimizer moved: the object that owns this one now.
  void rebind(DistributedShampoo& owner) { owner_ = &owner; }
  bool in_backward() const { return in_backward_; }

  void set_in_backward(bool in_backward) override { in_backward_ = in_backward; }
  bool step_open() const override { return owner_->engine_->step_open(); }
  void begin(bool in_pass) override;
  void step_parameters(const std::vector<at::Tensor>& params) override;
  void finish() override;
  /// Undoes the open step (after an error); nothing to undo when none is open.
  void abort() override;

 private:
  void write_state_entries() { owner_->engine_->groups().write_state_entries(owner_->state_); }

  DistributedShampoo* owner_;  // which owns this object
  bool in_backward_ = false;
};

bool DistributedShampoo::Interfaces::lookup(torch::optim::Optimizer& optimizer,
                                            detail::Capabilities& found) {
  auto* shampoo = dynamic_cast<DistributedShampoo*>(&optimizer);
  if (shampoo != nullptr && shampoo->interfaces_) {  // null once moved from
    shampoo->interfaces_->bind(shampoo, found);
    found.phased = shampoo->phased_.get();
    found.blocks = shampoo->checkpoint_.get();
  }
  return shampoo != nullptr;
}

DistributedShampoo::DistributedShampoo(std::vector<torch::Tensor> params, ShampooOptions defaults,
                                       DistributedOptions distributed)
    : DistributedShampoo(
          std::vector<torch::optim::OptimizerParamGroup>{
              torch::optim::OptimizerParamGroup(std::move(params))},
          std::move(defaults), std::move(distributed)) {}

DistributedShampoo::DistributedShampoo(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                                       ShampooOptions defaults, DistributedOptions distributed)
    // The base constructor gets no groups: its add_param_group would not register them here.
    : torch::optim::Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                              std::make_unique<ShampooOptions>(defaults)),
      engine_(std::make_unique<detail::ShampooEngine>(defaults, std::move(distributed))),
      interfaces_(std::make_unique<Interfaces>()),
      phased_(std::make_unique<Phased>(*this)),
      checkpoint_(std::make_unique<Checkpoint>(*this)) {
  detail::register_internal_interfaces(&Interfaces::lookup);
  // The options push of the wrappers that drive it (ZeRO-1, full sharding) compares by type.
  detail::register_options_equality(typeid(ShampooOptions),
                                    &detail::options_equal_as<ShampooOptions>);
  // Once per optimizer, over all groups (a group of biases alone has a large ratio), before the
  // groups are registered and their state allocated.
  detail::warn_if_state_is_large(param_groups, defaults);
  for (const auto& group : param_groups) add_param_group(group);
}

void ShampooParamState::serialize(torch::serialize::OutputArchive& archive) const {
  archive.write("step", c10::IValue(step()));
  archive.write("param_group", c10::IValue(param_group()));
  archive.write("num_blocks", c10::IValue(num_blocks()));
}

void ShampooParamState::serialize(torch::serialize::InputArchive& archive) {
  for (auto [name, field] : {std::pair{"step", &step_}, std::pair{"param_group", &param_group_},
                             std::pair{"num_blocks", &num_blocks_}}) {
    c10::IValue value;
    TORCH_CHECK(archive.try_read(name, value) && value.isInt(), "ShampooParamState: entry '", name,
                "' is missing or not an int");
    *field = value.toInt();
  }
}

void DistributedShampoo::sync_groups_and_state() {
  engine_->groups().register_added(param_groups_);
  engine_->groups().write_state_entries(state_);
}

DistributedShampoo::~DistributedShampoo() = default;

DistributedShampoo::DistributedShampoo(DistributedShampoo&& other) noexcept
    : torch::optim::Optimizer(std::move(other)),
      engine_(std::move(other.engine_)),
      interfaces_(std::move(other.interfaces_)),
      phased_(std::move(other.phased_)),
      checkpoint_(std::move(other.checkpoint_)) {
  if (phased_) phased_->rebind(*this);
  if (checkpoint_) checkpoint_->rebind(*this);
}

DistributedShampoo& DistributedShampoo::operator=(DistributedShampoo&& other) noexcept {
  torch::optim::Optimizer::operator=(std::move(other));
  engine_ = std::move(other.engine_);
  interfaces_ = std::move(other.interfaces_);
  phased_ = std::move(other.phased_);
  checkpoint_ = std::move(other.checkpoint_);
  if (phased_) phased_->rebind(*this);
  if (checkpoint_) checkpoint_->rebind(*this);
  return *this;
}

void DistributedShampoo::add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
  TORCH_CHECK(!engine_->step_open(),
              "DistributedShampoo::add_param_group: a step is in progress (optimizer-in-backward "
              "during loss.backward()); add groups between steps");
  engine_->groups().add_group(param_group, param_groups_);
  engine_->groups().write_state_entries(state_);
}

torch::Tensor DistributedShampoo::step(LossClosure closure) {
  TORCH_CHECK(!phased_->in_backward(),
              "DistributedShampoo::step(): this optimizer runs in backward "
              "(apply_optimizer_in_backward); its steps happen during loss.backward()");
  torch::Tensor loss;
  if (closure) {
    c10::AutoGradMode enable_grad(true);
    loss = closure();
  }
  c10::NoGradGuard no_grad;
  RECORD_USER_SCOPE("shampoo::step");
  sync_groups_and_state();
  try {
    engine_->step(param_groups_);
  } catch (...) {
    engine_->groups().write_state_entries(state_);
    throw;
  }
  engine_->groups().write_state_entries(state_);
  return loss;
}

namespace {

/// Indices of `params` among `engine`'s registered parameters; `what` names the caller in the
/// error for one that is not registered.
std::vector<int64_t> indices_of(const detail::ShampooEngine& engine,
                                const std::vector<torch::Tensor>& params, const char* what) {
  std::vector<int64_t> indices;
  for (const auto& p : params) {
    const int64_t index = engine.groups().param_index(p);
    TORCH_CHECK(index >= 0, "DistributedShampoo: a parameter given to ", what,
                " is not registered with this optimizer");
    indices.push_back(index);
  }
  return indices;
}

}  // namespace

void DistributedShampoo::Phased::begin(bool in_pass) {
  TORCH_CHECK(in_pass || !in_backward_,
              "DistributedShampoo: a step of some parameters outside a pass, but this optimizer "
              "runs in backward (apply_optimizer_in_backward); its steps happen during "
              "loss.backward()");
  c10::NoGradGuard no_grad;
  owner_->sync_groups_and_state();
  // In a pass, compute_params runs more than once (incremental); alone, once.
  owner_->engine_->begin_step(owner_->param_groups_, /*incremental=*/in_pass);
}

void DistributedShampoo::Phased::step_parameters(const std::vector<torch::Tensor>& params) {
  c10::NoGradGuard no_grad;
  auto& engine = *owner_->engine_;
  try {
    engine.compute_params(owner_->param_groups_, indices_of(engine, params, "step_parameters"));
  } catch (...) {
    if (!engine.step_open()) write_state_entries();  // undone by the engine
    throw;
  }
}

void DistributedShampoo::Phased::finish() {
  c10::NoGradGuard no_grad;
  try {
    owner_->engine_->finish_step();
  } catch (...) {
    write_state_entries();
    throw;
  }
  write_state_entries();
}

void DistributedShampoo::Phased::abort() {
  c10::NoGradGuard no_grad;
  owner_->engine_->abort_step();  // nothing when no step is open
  write_state_entries();
}

// Saving registers what the base class appended first (a collective in distributed mode, as the
// save itself is), so that the checkpoint holds every group; state() is the optimizer's own
// bookkeeping, written through the one place that writes it.
void DistributedShampoo::save(torch::serialize::OutputArchive& archive) const {
  const_cast<DistributedShampoo&>(*this).sync_groups_and_state();
  detail::EngineCheckpoint(*engine_).save(archive, param_groups_);
}

void DistributedShampoo::load(torch::serialize::InputArchive& archive) {
  sync_groups_and_state();
  detail::EngineCheckpoint(*engine_).load(archive, param_groups_);
  engine_->groups().write_state_entries(state_);
}

void DistributedShampoo::train() {
  c10::NoGradGuard no_grad;
  sync_groups_and_state();
  engine_->set_eval_mode(false, param_groups_);
}

void DistributedShampoo::eval() {
  c10::NoGradGuard no_grad;
  sync_groups_and_state();
  engine_->set_eval_mode(true, param_groups_);
}

bool DistributedShampoo::is_training() const { return !engine_->eval_mode(); }

ShampooStats DistributedShampoo::stats() const { return engine_->stats(); }

MemorySummary DistributedShampoo::memory_summary() const {
  auto summary = engine_->memory_summary();
  const auto estimate =
      detail::estimate_state_size(param_groups_, static_cast<const ShampooOptions&>(defaults()));
  if (estimate) {
    for (const auto& p : estimate->params) {
      summary.params.push_back(
          {p.param, p.group, p.shape, p.treatment, p.param_bytes, p.state_bytes});
    }
  }
  return summary;
}

c10::intrusive_ptr<c10d::ProcessGroup> DistributedShampoo::owners_group() const {
  return engine_->distributed_options().process_group();
}

std::optional<int> DistributedShampoo::owner_of(const at::Tensor& param) const {
  return engine_->groups().param_owner(param);
}

ShampooOptions& DistributedShampoo::group_options(size_t group) {
  TORCH_CHECK(group < param_groups_.size(), "group_options: group ", group, " out of range (",
              param_groups_.size(), " groups)");
  return detail::options_of(param_groups_[group], group);
}

double DistributedShampoo::group_lr_sum(size_t group) const {
  TORCH_CHECK(group < param_groups_.size(), "group_lr_sum: group ", group, " out of range (",
              param_groups_.size(), " groups)");
  return engine_->groups().group_lr_sums.at(group);
}

int64_t DistributedShampoo::group_step(size_t group) const {
  TORCH_CHECK(group < param_groups_.size(), "group_step: group ", group, " out of range (",
              param_groups_.size(), " groups)");
  return engine_->groups().group_steps.at(group);
}

const DistributedOptions& DistributedShampoo::distributed_options() const {
  return engine_->distributed_options();
}

void DistributedShampoo::set_failure_injector_for_testing(
    std::function<bool(const std::string&, int64_t)> fn) {
  engine_->groups().set_failure_injector(std::move(fn), param_groups_);
}

void DistributedShampoo::set_fault_injector_for_testing(StepFaultInjector fn, bool journal) {
  engine_->set_fault_injector(std::move(fn), journal);
}

}  // namespace shampoo
