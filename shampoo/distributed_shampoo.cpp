#include "shampoo/distributed_shampoo.h"

#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>

#include "shampoo/shampoo_engine.h"
#include "shampoo/state_size.h"

namespace shampoo {

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
      engine_(std::make_unique<detail::ShampooEngine>(defaults, std::move(distributed))) {
  // Once per optimizer, over all groups (a group of biases alone has a large ratio), before the
  // groups are registered and their state allocated.
  size_t num_params = 0;
  for (const auto& group : param_groups) num_params += group.params().size();
  TORCH_CHECK(num_params > 0, "DistributedShampoo: got an empty parameter list (",
              param_groups.size(),
              " param groups, no parameters), so nothing would be trained; pass the model's "
              "parameters (model->parameters())");
  detail::warn_if_state_is_large(param_groups, defaults);
  for (const auto& group : param_groups) add_param_group(group);
}

DistributedShampoo::~DistributedShampoo() = default;
DistributedShampoo::DistributedShampoo(DistributedShampoo&&) noexcept = default;
DistributedShampoo& DistributedShampoo::operator=(DistributedShampoo&&) noexcept = default;

void DistributedShampoo::add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
  TORCH_CHECK(!engine_->step_open(),
              "DistributedShampoo::add_param_group: a step is in progress (optimizer-in-backward "
              "during loss.backward()); add groups between steps");
  engine_->add_group(param_group, param_groups_);
}

torch::Tensor DistributedShampoo::step(LossClosure closure) {
  TORCH_CHECK(!in_backward_,
              "DistributedShampoo::step(): this optimizer runs in backward "
              "(apply_optimizer_in_backward); its steps happen during loss.backward()");
  torch::Tensor loss;
  if (closure) {
    c10::AutoGradMode enable_grad(true);
    loss = closure();
  }
  c10::NoGradGuard no_grad;
  RECORD_USER_SCOPE("shampoo::step");
  engine_->step(param_groups_);
  return loss;
}

bool DistributedShampoo::backward_step_open() const { return engine_->step_open(); }

void DistributedShampoo::begin_backward_step() {
  c10::NoGradGuard no_grad;
  engine_->begin_step(param_groups_, /*incremental=*/true);
}

void DistributedShampoo::step_parameters(const std::vector<torch::Tensor>& params) {
  c10::NoGradGuard no_grad;
  std::vector<int64_t> indices;
  for (const auto& p : params) {
    const int64_t index = engine_->param_index(p);
    TORCH_CHECK(index >= 0,
                "DistributedShampoo: a parameter given to step_parameters is not "
                "registered with this optimizer");
    indices.push_back(index);
  }
  engine_->compute_params(param_groups_, indices);
}

void DistributedShampoo::finish_backward_step() {
  c10::NoGradGuard no_grad;
  engine_->finish_step();
}

void DistributedShampoo::abort_backward_step() {
  c10::NoGradGuard no_grad;
  engine_->abort_step();
}

void DistributedShampoo::save(torch::serialize::OutputArchive& archive) const {
  engine_->save(archive, param_groups_);
}

void DistributedShampoo::load(torch::serialize::InputArchive& archive) {
  engine_->load(archive, param_groups_);
}

c10::intrusive_ptr<c10d::ProcessGroup> DistributedShampoo::checkpoint_group() const {
  return engine_->distributed_options().process_group();
}

void DistributedShampoo::save_common(torch::serialize::OutputArchive& common) const {
  engine_->save_common(common, param_groups_);
}

void DistributedShampoo::save_pieces(PieceWriter& pieces) const { engine_->save_pieces(pieces); }

std::function<void()> DistributedShampoo::prepare_load(torch::serialize::InputArchive& common,
                                                       PieceReader& pieces) {
  return engine_->prepare_load(common, pieces, param_groups_);
}

void DistributedShampoo::train() {
  c10::NoGradGuard no_grad;
  engine_->set_eval_mode(false, param_groups_);
}

void DistributedShampoo::eval() {
  c10::NoGradGuard no_grad;
  engine_->set_eval_mode(true, param_groups_);
}

bool DistributedShampoo::is_training() const { return !engine_->eval_mode(); }

ShampooStats DistributedShampoo::stats() const { return engine_->stats(); }

MemorySummary DistributedShampoo::memory_summary() const { return engine_->memory_summary(); }

c10::intrusive_ptr<c10d::ProcessGroup> DistributedShampoo::owners_group() const {
  return engine_->distributed_options().process_group();
}

std::optional<int> DistributedShampoo::owner_of(const at::Tensor& param) const {
  return engine_->param_owner(param);
}

ShampooOptions& DistributedShampoo::group_options(size_t group) {
  TORCH_CHECK(group < param_groups_.size(), "group_options: group ", group, " out of range (",
              param_groups_.size(), " groups)");
  return detail::options_of(param_groups_[group], group);
}

int64_t DistributedShampoo::group_step(size_t group) const {
  TORCH_CHECK(group < param_groups_.size(), "group_step: group ", group, " out of range (",
              param_groups_.size(), " groups)");
  return engine_->group_step(group);
}

const DistributedOptions& DistributedShampoo::distributed_options() const {
  return engine_->distributed_options();
}

void DistributedShampoo::set_failure_injector_for_testing(
    std::function<bool(const std::string&, int64_t)> fn) {
  engine_->set_failure_injector(std::move(fn), param_groups_);
}

void DistributedShampoo::set_fault_injector_for_testing(StepFaultInjector fn, bool journal) {
  engine_->set_fault_injector(std::move(fn), journal);
}

}  // namespace shampoo
