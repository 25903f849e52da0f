#include "shampoo/distributed_shampoo.h"

#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>

#include "parallel/optimizers/internal_interfaces.h"
#include "shampoo/shampoo_engine.h"
#include "shampoo/state_size.h"

namespace shampoo {

struct DistributedShampoo::Interfaces
    : detail::AdaptersOf<DistributedShampoo, detail::PhasedStepOf, detail::BlockStatesOf,
                         detail::ParameterOwnersOf> {};

bool DistributedShampoo::internal_interfaces(torch::optim::Optimizer& optimizer,
                                             detail::Capabilities& found) {
  auto* shampoo = dynamic_cast<DistributedShampoo*>(&optimizer);
  if (shampoo != nullptr && shampoo->interfaces_) shampoo->interfaces_->bind(shampoo, found);
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
      interfaces_(std::make_unique<Interfaces>()) {
  detail::register_internal_interfaces(&DistributedShampoo::internal_interfaces);
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
  engine_->register_added_params(param_groups_);
  write_state_entries();
}

void DistributedShampoo::write_state_entries() {
  for (const auto& summary : engine_->param_summaries()) {
    auto& entry = state_[summary.param.unsafeGetTensorImpl()];
    auto* mine = dynamic_cast<ShampooParamState*>(entry.get());
    if (mine == nullptr) {
      entry = std::make_unique<ShampooParamState>();
      mine = static_cast<ShampooParamState*>(entry.get());
    }
    mine->step(engine_->group_step(static_cast<size_t>(summary.group)))
        .param_group(summary.group)
        .num_blocks(summary.num_blocks);
  }
}

DistributedShampoo::~DistributedShampoo() = default;
DistributedShampoo::DistributedShampoo(DistributedShampoo&&) noexcept = default;
DistributedShampoo& DistributedShampoo::operator=(DistributedShampoo&&) noexcept = default;

void DistributedShampoo::add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
  TORCH_CHECK(!engine_->step_open(),
              "DistributedShampoo::add_param_group: a step is in progress (optimizer-in-backward "
              "during loss.backward()); add groups between steps");
  engine_->add_group(param_group, param_groups_);
  write_state_entries();
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
  sync_groups_and_state();
  try {
    engine_->step(param_groups_);
  } catch (...) {
    write_state_entries();
    throw;
  }
  write_state_entries();
  return loss;
}

bool DistributedShampoo::phased_step_open() const { return engine_->step_open(); }

void DistributedShampoo::begin_phased_step(bool in_pass) {
  TORCH_CHECK(in_pass || !in_backward_,
              "DistributedShampoo: a step of some parameters outside a pass, but this optimizer "
              "runs in backward (apply_optimizer_in_backward); its steps happen during "
              "loss.backward()");
  c10::NoGradGuard no_grad;
  sync_groups_and_state();
  // In a pass, compute_params runs more than once (incremental); alone, once.
  engine_->begin_step(param_groups_, /*incremental=*/in_pass);
}

std::vector<int64_t> DistributedShampoo::indices_of(const std::vector<torch::Tensor>& params,
                                                    const char* what) const {
  std::vector<int64_t> indices;
  for (const auto& p : params) {
    const int64_t index = engine_->param_index(p);
    TORCH_CHECK(index >= 0, "DistributedShampoo: a parameter given to ", what,
                " is not registered with this optimizer");
    indices.push_back(index);
  }
  return indices;
}

void DistributedShampoo::step_parameters(const std::vector<torch::Tensor>& params) {
  c10::NoGradGuard no_grad;
  try {
    engine_->compute_params(param_groups_, indices_of(params, "step_parameters"));
  } catch (...) {
    if (!engine_->step_open()) write_state_entries();  // undone by the engine
    throw;
  }
}

void DistributedShampoo::save_block_pieces(PieceWriter& pieces,
                                           const BlockPieceName& name_of) const {
  const auto summaries = engine_->param_summaries();
  engine_->save_block_pieces(pieces, [&](const BlockId& id) {
    return name_of(summaries.at(static_cast<size_t>(id.param)).param, id.block);
  });
}

std::function<void()> DistributedShampoo::prepare_block_load(PieceReader& pieces,
                                                             const BlockPieceName& name_of,
                                                             std::vector<int64_t> group_steps,
                                                             std::vector<double> group_lr_sums,
                                                             std::optional<bool> eval_mode) {
  sync_groups_and_state();
  const auto summaries = engine_->param_summaries();
  auto install = engine_->prepare_block_load(
      pieces,
      [&](const BlockId& id) {
        return name_of(summaries.at(static_cast<size_t>(id.param)).param, id.block);
      },
      std::move(group_steps), std::move(group_lr_sums), eval_mode, param_groups_);
  return [this, install] {
    install();
    write_state_entries();
  };
}

std::vector<const torch::optim::OptimizerParamGroup*> DistributedShampoo::portable_groups() const {
  const_cast<DistributedShampoo&>(*this).sync_groups_and_state();
  return detail::groups_of(*this);
}

int64_t DistributedShampoo::portable_param_step(const at::Tensor& param) const {
  const auto index = engine_->param_index(param);
  if (index < 0) return -1;
  const auto summaries = engine_->param_summaries();
  return engine_->group_step(static_cast<size_t>(summaries.at(static_cast<size_t>(index)).group));
}

void DistributedShampoo::save_portable_pieces(PieceWriter& pieces, const PortableSave& save) const {
  if (!engine_->writes_pieces()) return;
  // Every rank knows the groups' step counts: rank 0 writes them, each owner its blocks.
  std::vector<at::Tensor> heads;
  if (engine_->rank() == 0) {
    for (const auto& group : param_groups_) {
      heads.insert(heads.end(), group.params().begin(), group.params().end());
    }
  }
  detail::save_param_states(*this, heads, pieces, save.names, "DistributedShampoo: ");
}

std::function<void()> DistributedShampoo::prepare_portable_load(const PortableLoad& load) {
  sync_groups_and_state();
  auto install_options = engine_->prepare_saved_options(load.group_options, param_groups_);
  auto install_states =
      detail::prepare_param_states(*this, *load.pieces, load.names, "DistributedShampoo: ");
  return [this, install_options, install_states] {
    install_states();
    install_options();
    write_state_entries();
  };
}

void DistributedShampoo::finish_phased_step() {
  c10::NoGradGuard no_grad;
  try {
    engine_->finish_step();
  } catch (...) {
    write_state_entries();
    throw;
  }
  write_state_entries();
}

void DistributedShampoo::abort_phased_step() {
  c10::NoGradGuard no_grad;
  engine_->abort_step();  // nothing when no step is open
  write_state_entries();
}

// Saving registers what the base class appended first (a collective in distributed mode, as the
// save itself is), so that the checkpoint holds every group; state() is the optimizer's own
// bookkeeping, written through the one place that writes it.
void DistributedShampoo::save(torch::serialize::OutputArchive& archive) const {
  const_cast<DistributedShampoo&>(*this).sync_groups_and_state();
  engine_->save(archive, param_groups_);
}

void DistributedShampoo::load(torch::serialize::InputArchive& archive) {
  sync_groups_and_state();
  engine_->load(archive, param_groups_);
  write_state_entries();
}

c10::intrusive_ptr<c10d::ProcessGroup> DistributedShampoo::checkpoint_group() const {
  return engine_->distributed_options().process_group();
}

void DistributedShampoo::sync_for_checkpoint() const {
  const_cast<DistributedShampoo&>(*this).sync_groups_and_state();
}

void DistributedShampoo::save_common(torch::serialize::OutputArchive& common) const {
  engine_->save_common(common, param_groups_);
}

void DistributedShampoo::save_pieces(PieceWriter& pieces) const { engine_->save_pieces(pieces); }

std::function<void()> DistributedShampoo::prepare_load(torch::serialize::InputArchive& common,
                                                       PieceReader& pieces) {
  auto install = engine_->prepare_load(common, pieces, param_groups_);
  return [this, install = std::move(install)] {
    install();
    write_state_entries();
  };
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
  return engine_->param_owner(param);
}

ShampooOptions& DistributedShampoo::group_options(size_t group) {
  TORCH_CHECK(group < param_groups_.size(), "group_options: group ", group, " out of range (",
              param_groups_.size(), " groups)");
  return detail::options_of(param_groups_[group], group);
}

double DistributedShampoo::group_lr_sum(size_t group) const {
  TORCH_CHECK(group < param_groups_.size(), "group_lr_sum: group ", group, " out of range (",
              param_groups_.size(), " groups)");
  return engine_->group_lr_sum(group);
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
