#include "parallel/optimizers/local_optimizer.h"

#include <c10/util/Exception.h>
#include <c10/util/TypeIndex.h>

#include <typeinfo>
#include <utility>

#include "parallel/optimizers/block_states.h"
#include "parallel/optimizers/libtorch_optimizers.h"
#include "parallel/optimizers/portable_checkpoint.h"

namespace shampoo::detail {
LocalOptimizer::LocalOptimizer(GroupOptimizerFactory factory, std::string who)
    : factory_(std::move(factory)), who_(std::move(who)) {}

void LocalOptimizer::make(torch::optim::OptimizerParamGroup first) {
  TORCH_INTERNAL_ASSERT(!optimizer_);
  auto made = factory_(std::move(first));
  TORCH_CHECK(made != nullptr, who_, "the optimizer factory returned null");
  check_factory_optimizer(*made, who_);
  capabilities_ = capabilities_of(*made);
  optimizer_ = std::move(made);
}

void LocalOptimizer::add(size_t group, const std::vector<at::Tensor>& params,
                         const GroupOptions& options_of) {
  if (!optimizer_) {
    if (params.empty()) return;
    make(torch::optim::OptimizerParamGroup(group == 0 ? params : std::vector<at::Tensor>{},
                                           options_of(0).clone()));
    set_options(0, options_of(0));
    if (group == 0) return;
  }
  auto& groups = optimizer_->param_groups();
  if (group < groups.size()) {
    auto& list = groups[group].params();
    list.insert(list.end(), params.begin(), params.end());
  }
  while (groups.size() <= group) {
    const size_t k = groups.size();
    // The base class's add_param_group: DistributedShampoo registers it below.
    optimizer_->torch::optim::Optimizer::add_param_group(torch::optim::OptimizerParamGroup(
        k == group ? params : std::vector<at::Tensor>{}, options_of(k).clone()));
  }
  if (capabilities_.blocks != nullptr) capabilities_.blocks->register_appended();
}

void LocalOptimizer::make_empty(size_t groups, const GroupOptions& options_of) {
  if (optimizer_ || groups == 0) return;
  make(torch::optim::OptimizerParamGroup(std::vector<at::Tensor>{}, options_of(0).clone()));
  set_options(0, options_of(0));
  if (groups > 1) add(groups - 1, {}, options_of);
}

void LocalOptimizer::set_options(size_t group, const torch::optim::OptimizerOptions& options) {
  if (!optimizer_ || group >= optimizer_->param_groups().size()) return;
  auto& target = optimizer_->param_groups()[group];
  TORCH_CHECK(typeid(options) == typeid(target.options()), who_, "param group ", group,
              ": its options are a ", c10::demangle(typeid(options).name()),
              ", but the factory's optimizer takes ",
              c10::demangle(typeid(target.options()).name()),
              " (give the group options of that type, or none for the factory's)");
  target.set_options(options.clone());
}

void LocalOptimizer::step(const std::vector<at::Tensor>& params, StepScope scope,
                          UndoRecord* undo) {
  if (params.empty()) return;
  TORCH_INTERNAL_ASSERT(optimizer_ != nullptr);
  step_optimizer(*optimizer_, capabilities_, params, scope, undo);
}

void LocalOptimizer::finish() { finish_open_step(capabilities_); }

void LocalOptimizer::abort() { abort_open_step(capabilities_); }

void LocalOptimizer::save_pieces(PieceWriter& pieces, const ParamNames& name_of) const {
  if (!optimizer_) return;
  std::vector<at::Tensor> params;
  for (const auto& group : optimizer_->param_groups()) {
    params.insert(params.end(), group.params().begin(), group.params().end());
  }
  save_param_states(*optimizer_, params, pieces, name_of, who_);
}

std::function<void()> LocalOptimizer::prepare_load(PieceReader& pieces, const ParamNames& name_of) {
  if (!optimizer_) return [] {};
  return prepare_param_states(*optimizer_, pieces, name_of, who_);
}

}  // namespace shampoo::detail
