#include "parallel/state_sharding/sharded_optimizer.h"

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <typeinfo>
#include <unordered_set>

#include "parallel/communication/collectives.h"
#include "parallel/communication/ownership_plan.h"
#include "parallel/communication/process_group.h"
#include "parallel/optimizers/internal_interfaces.h"
#include "parallel/optimizers/libtorch_optimizers.h"
#include "parallel/optimizers/local_optimizer.h"
#include "parallel/optimizers/options_push.h"
#include "parallel/optimizers/phased_step.h"
#include "parallel/optimizers/undo_record.h"
#include "parallel/state_sharding/sharded_optimizer_checkpoint.h"

namespace shampoo {
namespace {

/// A placeholder for the base class's defaults until the local optimizer's are known.
struct WrapperOptions : torch::optim::OptimizerCloneableOptions<WrapperOptions> {};

/// The options of `groups`[k], as the local optimizer asks for them.
detail::LocalOptimizer::GroupOptions options_of(
    const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  return [&groups](size_t g) -> const torch::optim::OptimizerOptions& {
    return groups.at(g).options();
  };
}

void check_has_params(const std::vector<torch::Tensor>& params, const char* function) {
  TORCH_CHECK(!params.empty(), "ShardedOptimizer::", function,
              ": the optimizer has no parameters (it was built with an empty parameter list and "
              "none were added since); add them with add_param_group first");
}

}  // namespace

/// PhasedStep (optimizer-in-backward): the local steps of the owned parameters as their
/// gradients arrive, the one AllGather at the end of backward (so that the collective never
/// runs inside a gradient hook, in an order that differs between ranks). What a pass stepped is
/// copied first (values and local state, LibTorch's optimizers only), so that an aborted pass
/// (an error, or a GradScaler's overflow) leaves parameters and state as before. A step alone
/// (not in a pass) is the same.
class ShardedOptimizer::Phased final : public PhasedStep {
 public:
  explicit Phased(ShardedOptimizer& owner) : owner_(owner) {}
  void set_in_backward(bool in_backward) override;
  bool step_open() const override { return open_; }
  void begin(bool in_pass) override;
  void step_parameters(const std::vector<at::Tensor>& params) override;
  void finish() override;
  void abort() override;
  bool in_backward() const { return in_backward_; }

 private:
  ShardedOptimizer& owner_;  // which owns this object (and does not move)
  bool in_backward_ = false;
  bool open_ = false;
  /// In backward: the parameters and local states as they were before the pass, once each.
  detail::UndoRecord journal_;
};

struct ShardedOptimizer::Interfaces
    : detail::AdaptersOf<ShardedOptimizer, detail::ParameterOwnersOf> {
  /// The lookup registered with capabilities_of: a ShardedOptimizer's internal objects.
  static bool lookup(torch::optim::Optimizer& optimizer, detail::Capabilities& found);
};

bool ShardedOptimizer::Interfaces::lookup(torch::optim::Optimizer& optimizer,
                                          detail::Capabilities& found) {
  auto* sharded = dynamic_cast<ShardedOptimizer*>(&optimizer);
  if (sharded != nullptr && sharded->interfaces_) {
    sharded->interfaces_->bind(sharded, found);
    found.phased = sharded->phased_.get();
  }
  return sharded != nullptr;
}

ShardedOptimizer::ShardedOptimizer(std::vector<torch::Tensor> params,
                                   const GroupOptimizerFactory& factory,
                                   c10::intrusive_ptr<c10d::ProcessGroup> group)
    : ShardedOptimizer(
          std::vector<torch::optim::OptimizerParamGroup>{
              torch::optim::OptimizerParamGroup(std::move(params))},
          factory, std::move(group)) {}

ShardedOptimizer::ShardedOptimizer(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                                   const GroupOptimizerFactory& factory,
                                   c10::intrusive_ptr<c10d::ProcessGroup> group)
    // The base gets no groups: they are registered here, group 0 before the local optimizer
    // exists (the factory makes it over this rank's share of group 0).
    : torch::optim::Optimizer(std::vector<torch::optim::OptimizerParamGroup>{},
                              std::make_unique<WrapperOptions>()),
      group_(std::move(group)),
      interfaces_(std::make_unique<Interfaces>()),
      phased_(std::make_unique<Phased>(*this)),
      checkpoint_(std::make_unique<Checkpoint>(*this)) {
  detail::register_internal_interfaces(&Interfaces::lookup);
  TORCH_CHECK(group_, "ShardedOptimizer: process group is null");
  TORCH_CHECK(factory, "ShardedOptimizer: the optimizer factory is empty");
  TORCH_CHECK(!param_groups.empty(),
              "ShardedOptimizer: no param groups; pass at least one (it may have no parameters)");
  plan_ = std::make_unique<detail::OwnershipPlan>(group_->getSize());
  layout_ = std::make_unique<detail::OwnerMajorLayout>();
  param_groups_.emplace_back(param_groups[0].params());
  group_sizes_.push_back(0);
  // The factory gets this rank's parameters of group 0, with the group's options when it has
  // some (their type is checked against the optimizer's just after).
  auto first = torch::optim::OptimizerParamGroup(register_params(0, 0));
  if (param_groups[0].has_options()) first.set_options(param_groups[0].options().clone());
  local_ = std::make_unique<detail::LocalOptimizer>(factory, "ShardedOptimizer: ");
  push_ = std::make_unique<detail::OptionsPush>("ShardedOptimizer: ", "param_groups()",
                                                "local_optimizer()");
  local_->make(std::move(first));
  defaults_ = local_optimizer().defaults().clone();
  param_groups_[0].set_options(local_optimizer().param_groups()[0].options().clone());
  push_->add_group(param_groups_[0].options());
  for (size_t g = 1; g < param_groups.size(); ++g) add_param_group(param_groups[g]);
  write_state_entries();
}

ShardedOptimizer::~ShardedOptimizer() = default;

torch::optim::Optimizer& ShardedOptimizer::local_optimizer() { return *local_->get(); }

const torch::optim::Optimizer& ShardedOptimizer::local_optimizer() const { return *local_->get(); }

int64_t ShardedOptimizer::state_bytes() const { return optimizer_state_bytes(*local_->get()); }

const std::vector<int>& ShardedOptimizer::owners() const { return plan_->owners(); }

std::unique_ptr<torch::optim::OptimizerOptions> ShardedOptimizer::checked_options(
    const torch::optim::OptimizerOptions& options, size_t group) const {
  TORCH_CHECK(typeid(options) == typeid(*defaults_), "ShardedOptimizer: param group ", group,
              ": its options are a ", c10::demangle(typeid(options).name()),
              ", but the factory's optimizer takes ", c10::demangle(typeid(*defaults_).name()),
              " (give the group options of that type, or none for the factory's defaults)");
  return options.clone();
}

std::string ShardedOptimizer::check_added(size_t group, size_t first, int64_t& numel) const {
  const auto& params = param_groups_[group].params();
  std::string error;
  const auto fail = [&](size_t i, const std::string& what) {
    if (error.empty()) {
      error =
          "param group " + std::to_string(group) + ": parameter " + std::to_string(i) + " " + what;
    }
  };
  std::unordered_set<const void*> fresh;
  numel = 0;
  for (size_t i = first; i < params.size(); ++i) {
    const auto& p = params[i];
    if (!p.defined()) {
      fail(i, "is undefined");
      continue;
    }
    const auto& model = params_.empty() ? params[first] : params_.front();
    if (p.layout() != at::kStrided || !p.is_floating_point()) {
      fail(i, "must be a dense floating-point tensor, got " +
                  std::string(c10::toString(p.scalar_type())) + " " + c10::str(p.layout()));
    } else if (!p.is_leaf()) {
      fail(i, "is not a leaf tensor (can't optimize a non-leaf Tensor)");
    } else if (model.defined() &&
               (p.scalar_type() != model.scalar_type() || p.device() != model.device())) {
      fail(i, "is " + std::string(c10::toString(p.scalar_type())) + " on " + p.device().str() +
                  ", the first parameter is " + c10::toString(model.scalar_type()) + " on " +
                  model.device().str() +
                  "; all parameters must share one dtype and device (one AllGather buffer)");
    } else if (index_of_.count(p.unsafeGetTensorImpl()) != 0 ||
               !fresh.insert(p.unsafeGetTensorImpl()).second) {
      fail(i, "is already one of this optimizer's parameters (a tensor may be added once)");
    }
    numel += p.numel();
  }
  return error;
}

std::vector<torch::Tensor> ShardedOptimizer::register_params(size_t group, size_t first) {
  const auto& params = param_groups_[group].params();
  const int world = group_->getSize();
  const int rank = group_->getRank();
  // Checked here first, then agreed on: a mistake on one rank is an error on every rank.
  int64_t numel = 0;
  const auto error = check_added(group, first, numel);
  detail::Fingerprint shapes;  // the owners and the AllGather's layout follow the list
  for (size_t i = first; i < params.size(); ++i) {
    shapes.add(params[i].defined() ? static_cast<int64_t>(params[i].scalar_type()) : -1);
    if (params[i].defined()) shapes.add_list(params[i].sizes());
  }
  const std::vector<int64_t> mine{
      error.empty() ? 0 : 1, static_cast<int64_t>(params.size() - first), numel, shapes.value()};
  const auto all = detail::gather_int64(*group_, mine);
  TORCH_CHECK(error.empty(), "ShardedOptimizer: ", error);
  for (int r = 0; r < world; ++r) {
    TORCH_CHECK(all[r][0] == 0, "ShardedOptimizer: adding the parameters of param group ", group,
                " failed on rank ", r, " (its error says why)");
    TORCH_CHECK(all[r][1] == mine[1] && all[r][2] == mine[2], "ShardedOptimizer: param group ",
                group, ": rank ", r, " adds ", all[r][1], " parameters with ", all[r][2],
                " elements, rank ", rank, " adds ", mine[1], " with ", mine[2],
                "; every rank must pass the same parameters");
    TORCH_CHECK(all[r][3] == mine[3], "ShardedOptimizer: param group ", group, ": rank ", r,
                " adds as many parameters with as many elements as rank ", rank,
                ", but in other shapes or dtypes, or in another order; every rank must pass the "
                "same parameters in the same order");
  }
  // Whole parameters, balanced by size (the same on every rank, going on from the loads of the
  // parameters registered before).
  std::vector<int64_t> costs;
  for (size_t i = first; i < params.size(); ++i) {
    costs.push_back(
        detail::block_cost(params[i].numel(), static_cast<int64_t>(params[i].element_size())));
  }
  const auto first_item = static_cast<size_t>(plan_->add(costs));
  std::vector<torch::Tensor> own;
  for (size_t i = first; i < params.size(); ++i) {
    index_of_[params[i].unsafeGetTensorImpl()] = params_.size();
    params_.push_back(params[i]);
    added_at_.push_back(steps_);
    if (plan_->owner_of(static_cast<int64_t>(params_.size() - 1)) == rank) own.push_back(params[i]);
  }
  TORCH_INTERNAL_ASSERT(first_item + (params.size() - first) == params_.size());
  group_sizes_[group] += static_cast<int64_t>(params.size() - first);
  std::vector<int64_t> numels;
  for (const auto& p : params_) numels.push_back(p.numel());
  const auto before = layout_->segment_size();
  layout_ = std::make_unique<detail::OwnerMajorLayout>(world, numels, plan_->owners(),
                                                       /*with_flags=*/false);
  if (!params_.empty() && (layout_->segment_size() != before || !send_.defined())) {
    const auto options = params_.front().options().requires_grad(false);
    send_ = layout_->make_send(options);
    receive_ = layout_->make_receive(options);
  }
  return own;
}

void ShardedOptimizer::add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
  TORCH_CHECK(!phased_->step_open(),
              "ShardedOptimizer::add_param_group: a step is in progress (in backward); "
              "add groups between steps");
  register_added_params();
  const size_t g = param_groups_.size();
  auto options =
      param_group.has_options() ? checked_options(param_group.options(), g) : defaults_->clone();
  param_groups_.emplace_back(param_group.params(), std::move(options));
  try {
    register_group(g);
  } catch (...) {  // checked before anything was registered, on every rank alike
    param_groups_.pop_back();
    group_sizes_.resize(g);
    throw;
  }
  write_state_entries();
}

void ShardedOptimizer::register_group(size_t g) {
  group_sizes_.push_back(0);
  auto own = register_params(g, 0);
  local_->add(g, own, options_of(param_groups_));
  push_->add_group(param_groups_[g].options());
}

void ShardedOptimizer::register_added_params() {
  // torch::optim::Optimizer::add_param_group and add_parameters are not virtual: through a
  // base-class reference they append a group (with a copy of its options, or of the defaults)
  // or parameters (to group 0) without telling this optimizer.
  bool added = false;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    if (g >= group_sizes_.size()) {
      param_groups_[g].set_options(checked_options(param_groups_[g].options(), g));
      register_group(g);
      added = true;
    } else if (static_cast<int64_t>(param_groups_[g].params().size()) > group_sizes_[g]) {
      auto own = register_params(g, static_cast<size_t>(group_sizes_[g]));
      local_->add(g, own, options_of(param_groups_));
      added = true;
    }
  }
  if (added) write_state_entries();
}

void ShardedOptimizer::push_options_to_local() { push_->push(param_groups_, {local_.get()}); }

void ShardedOptimizer::pull_options_from_local() {
  const auto& local_groups = local_optimizer().param_groups();
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    param_groups_[g].set_options(local_groups[g].options().clone());
    push_->settled(g, param_groups_[g].options());
  }
}

void ShardedOptimizer::write_state_entries() {
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& entry = state_[params_[i].unsafeGetTensorImpl()];
    auto* mine = dynamic_cast<ShardedParamState*>(entry.get());
    if (mine == nullptr) {
      entry = std::make_unique<ShardedParamState>();
      mine = static_cast<ShardedParamState*>(entry.get());
    }
    mine->step(steps_ - added_at_[i]).owner(plan_->owner_of(static_cast<int64_t>(i)));
  }
}

std::optional<int> ShardedOptimizer::owner_of(const at::Tensor& param) const {
  const auto it = index_of_.find(param.unsafeGetTensorImpl());
  if (it == index_of_.end()) return std::nullopt;
  return plan_->owner_of(static_cast<int64_t>(it->second));
}

torch::Tensor ShardedOptimizer::step(LossClosure closure) {
  TORCH_CHECK(!phased_->in_backward(),
              "ShardedOptimizer::step(): this optimizer runs in backward "
              "(apply_optimizer_in_backward); its steps happen during loss.backward()");
  torch::Tensor loss;
  if (closure) {
    c10::AutoGradMode enable_grad(true);
    loss = closure();
  }
  register_added_params();
  check_has_params(params_, "step()");
  push_options_to_local();
  local_optimizer().step();
  all_gather();
  ++steps_;
  write_state_entries();
  return loss;
}

void ShardedOptimizer::all_gather() {
  if (group_->getSize() == 1) return;  // every parameter is local
  c10::NoGradGuard no_grad;
  const int rank = group_->getRank();
  const auto n = static_cast<int64_t>(params_.size());
  for (int64_t i = 0; i < n; ++i) {
    if (layout_->owner(i) != rank) continue;
    layout_->in_send(send_, i).copy_(params_[i].detach().reshape(-1));
  }
  detail::start_all_gather(*group_, receive_, send_)->wait();
  for (int64_t i = 0; i < n; ++i) {
    if (layout_->owner(i) == rank) continue;
    params_[i].detach().copy_(layout_->in_receive(receive_, i).view(params_[i].sizes()));
  }
}

void ShardedOptimizer::Phased::set_in_backward(bool in_backward) {
  TORCH_CHECK(!in_backward || !detail::libtorch_optimizer_name(owner_.local_optimizer()).empty(),
              "ShardedOptimizer in backward (apply_optimizer_in_backward): the factory must make "
              "one of LibTorch's SGD, Adam, AdamW, Adagrad or RMSprop, whose per-parameter state "
              "can be copied so that an aborted backward pass is undone");
  in_backward_ = in_backward;
}

void ShardedOptimizer::Phased::begin(bool /*in_pass*/) {  // the same either way
  TORCH_CHECK(!open_, "ShardedOptimizer: a backward step is already open");
  owner_.register_added_params();
  check_has_params(owner_.params_, "step (in backward)");
  owner_.push_options_to_local();
  open_ = true;
  journal_.clear();
}

void ShardedOptimizer::Phased::step_parameters(const std::vector<at::Tensor>& params) {
  TORCH_INTERNAL_ASSERT(open_);
  c10::NoGradGuard no_grad;
  const int rank = owner_.group_->getRank();
  std::vector<at::Tensor> ready;  // this rank's, with a gradient
  for (const auto& p : params) {
    const auto it = owner_.index_of_.find(p.unsafeGetTensorImpl());
    TORCH_CHECK(it != owner_.index_of_.end(),
                "ShardedOptimizer: a parameter given to step_parameters is not one of its own");
    if (owner_.plan_->owner_of(static_cast<int64_t>(it->second)) == rank && p.grad().defined())
      ready.push_back(owner_.params_[it->second]);
  }
  if (ready.empty()) return;
  // Copies of what this call changes, once per pass and parameter.
  for (const auto& p : ready) journal_.save_values(p);
  owner_.local_->step(ready, detail::StepScope::kAlone, &journal_);
}

void ShardedOptimizer::Phased::finish() {
  TORCH_INTERNAL_ASSERT(open_);
  open_ = false;
  journal_.clear();
  owner_.all_gather();
  ++owner_.steps_;
  owner_.write_state_entries();
}

void ShardedOptimizer::Phased::abort() {
  if (!open_) return;
  journal_.undo();
  open_ = false;
}

}  // namespace shampoo
