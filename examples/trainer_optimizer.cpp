#include "examples/trainer_optimizer.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <utility>

#include "shampoo/shampoo.h"

namespace shampoo::examples {

namespace {

GraftingConfig make_grafting(const TrainerConfig& config) {
  switch (config.grafting) {
    case GraftingKind::kNone:
      return std::monostate{};
    case GraftingKind::kSgd:
      return SGDGraftingConfig{};
    case GraftingKind::kAdaGrad:
      return AdaGradGraftingConfig{config.grafting_epsilon};
    case GraftingKind::kRmsProp:
      return RMSpropGraftingConfig{config.grafting_beta2, config.grafting_epsilon};
    case GraftingKind::kAdam:
      return AdamGraftingConfig{config.grafting_beta2, config.grafting_epsilon};
  }
  return std::monostate{};
}

// --weight-decay-type names WeightDecayType's values in its order.
static_assert(static_cast<int>(WeightDecayChoice::kL2) == static_cast<int>(WeightDecayType::kL2) &&
              static_cast<int>(WeightDecayChoice::kIndependent) ==
                  static_cast<int>(WeightDecayType::kIndependent));

ShampooOptions make_shampoo_options(const TrainerConfig& config) {
  return ShampooOptions(config.lr)
      .betas({config.beta1, config.beta2})
      .beta3(config.beta3)
      .epsilon(config.epsilon)
      .weight_decay(config.weight_decay)
      .weight_decay_type(static_cast<WeightDecayType>(config.weight_decay_type))
      .momentum(config.momentum)
      .dampening(config.dampening)
      .use_nesterov(config.use_nesterov)
      .max_preconditioner_dim(config.max_preconditioner_dim)
      .use_merge_dims(config.use_merge_dims)
      .precondition_1d(config.precondition_1d)
      .factored_grafting(config.factored_grafting)
      .max_factored_dim(config.max_factored_dim)
      .relative_epsilon(config.relative_epsilon)
      .use_trace_scaling(config.trace_scaling != 0.0)
      .trace_scaling_exponent(config.trace_scaling != 0.0 ? config.trace_scaling : 0.5)
      .factor_matrix_dtype(config.factor_dtype)
      .precondition_frequency(config.precondition_frequency)
      .start_preconditioning_step(config.start_preconditioning_step)
      .use_bias_correction(config.use_bias_correction)
      .compact_state(config.compact_state == CompactChoice::kInt8 ? shampoo::CompactState::kInt8
                     : config.compact_state == CompactChoice::kBf16
                         ? shampoo::CompactState::kBfloat16
                         : shampoo::CompactState::kNone)
      .grafting(make_grafting(config));
}

/// Param groups of a torch::optim optimizer: each plan with `defaults` changed to its lr and
/// weight decay.
template <typename Options>
std::vector<torch::optim::OptimizerParamGroup> make_groups(const std::vector<ParamGroupPlan>& plans,
                                                           const Options& defaults) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.reserve(plans.size());
  for (const auto& plan : plans) {
    auto options = std::make_unique<Options>(defaults);
    options->lr(plan.lr);
    options->weight_decay(plan.weight_decay);
    groups.emplace_back(plan.params, std::move(options));
  }
  return groups;
}

/// Whether this run shards gradients across ranks (--sharding gradients with several ranks).
bool shards_gradients(const TrainerConfig& config,
                      const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  return config.sharding == ShardingMode::kGradients && group && group->getSize() > 1;
}

/// Whether LibTorch's optimizers run as a ShardedOptimizer (--sharding state or gradients with
/// several ranks).
bool shards_state(const TrainerConfig& config,
                  const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  return (config.sharding == ShardingMode::kState || config.sharding == ShardingMode::kGradients) &&
         group && group->getSize() > 1;
}

/// A torch::optim optimizer over the plans; with state or gradient sharding a ShardedOptimizer over
/// the same param groups, whose local optimizer (made by the factory over this rank's share of each
/// group) gets the groups' options before each step.
template <typename Optimizer, typename Options>
std::unique_ptr<torch::optim::Optimizer> make_libtorch_optimizer(
    const TrainerConfig& config, const std::vector<ParamGroupPlan>& plans, const Options& defaults,
    const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  if (!shards_state(config, group)) {
    return std::make_unique<Optimizer>(make_groups(plans, defaults), defaults);
  }
  return std::make_unique<ShardedOptimizer>(make_groups(plans, defaults),
                                            group_optimizer_factory<Optimizer>(defaults), group);
}

}  // namespace

std::vector<ParamGroupPlan> plan_param_groups(
    const torch::OrderedDict<std::string, at::Tensor>& named_parameters,
    const TrainerConfig& config) {
  std::vector<ParamGroupPlan> plans;
  if (config.lrs.empty() && !config.bias_weight_decay) {
    ParamGroupPlan all;
    all.lr = config.lr;
    all.weight_decay = config.weight_decay;
    for (const auto& item : named_parameters) {
      all.names.push_back(item.key());
      all.params.push_back(item.value());
    }
    plans.push_back(std::move(all));
    return plans;
  }
  size_t index = 0;
  for (const auto& item : named_parameters) {
    ParamGroupPlan plan;
    plan.names = {item.key()};
    plan.params = {item.value()};
    plan.lr = config.lrs.empty() ? config.lr : config.lrs[index % config.lrs.size()];
    plan.weight_decay = item.value().dim() == 1 && config.bias_weight_decay
                            ? *config.bias_weight_decay
                            : config.weight_decay;
    plans.push_back(std::move(plan));
    ++index;
  }
  return plans;
}

namespace {

torch::optim::SGDOptions sgd_defaults(const TrainerConfig& config) {
  return torch::optim::SGDOptions(config.lr)
      .momentum(config.momentum)
      .dampening(config.dampening)
      .weight_decay(config.weight_decay)
      .nesterov(config.use_nesterov);
}

torch::optim::AdamOptions adam_defaults(const TrainerConfig& config) {
  return torch::optim::AdamOptions(config.lr)
      .betas({config.beta1, config.beta2})
      .eps(config.epsilon)
      .weight_decay(config.weight_decay);
}

torch::optim::AdamWOptions adamw_defaults(const TrainerConfig& config) {
  return torch::optim::AdamWOptions(config.lr)
      .betas({config.beta1, config.beta2})
      .eps(config.epsilon)
      .weight_decay(config.weight_decay);
}

}  // namespace

std::unique_ptr<torch::optim::Optimizer> make_optimizer(
    const TrainerConfig& config, const std::vector<ParamGroupPlan>& plans,
    const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  switch (config.optimizer) {
    case OptimizerKind::kSgd:
      return make_libtorch_optimizer<torch::optim::SGD>(config, plans, sgd_defaults(config), group);
    case OptimizerKind::kAdam:
      return make_libtorch_optimizer<torch::optim::Adam>(config, plans, adam_defaults(config),
                                                         group);
    case OptimizerKind::kAdamW:
      return make_libtorch_optimizer<torch::optim::AdamW>(config, plans, adamw_defaults(config),
                                                          group);
    case OptimizerKind::kShampoo: {
      const ShampooOptions defaults = make_shampoo_options(config);
      auto distributed = DistributedOptions()
                             .process_group(group)
                             .communication_dtype(config.communication_dtype)
                             .num_trainers_per_group(config.num_trainers_per_group)
                             .communicate_params(config.communicate_params)
                             .merge_param_groups(config.merge_groups)
                             .shard_by_parameter(shards_gradients(config, group));
      return std::make_unique<DistributedShampoo>(make_groups(plans, defaults), defaults,
                                                  std::move(distributed));
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unknown optimizer kind");
}

std::vector<torch::optim::OptimizerParamGroup> make_param_groups(
    const TrainerConfig& config, const std::vector<ParamGroupPlan>& plans) {
  switch (config.optimizer) {
    case OptimizerKind::kSgd:
      return make_groups(plans, sgd_defaults(config));
    case OptimizerKind::kAdam:
      return make_groups(plans, adam_defaults(config));
    case OptimizerKind::kAdamW:
      return make_groups(plans, adamw_defaults(config));
    case OptimizerKind::kShampoo:
      return make_groups(plans, make_shampoo_options(config));
  }
  TORCH_INTERNAL_ASSERT(false, "unknown optimizer kind");
}

std::string describe_param_groups(const std::vector<ParamGroupPlan>& plans) {
  std::string out;
  for (size_t g = 0; g < plans.size(); ++g) {
    const auto& plan = plans[g];
    const std::string members =
        plan.names.size() == 1
            ? fmt::format("{} [{}]", plan.names[0], fmt::join(plan.params[0].sizes(), ", "))
            : fmt::format("{} parameters", plan.names.size());
    // {:g}: the lr and weight decay as a stream prints them (6 significant digits).
    out += fmt::format("  group {}: {}, lr {:g}, weight decay {:g}\n", g, members, plan.lr,
                       plan.weight_decay);
  }
  return out;
}

}  // namespace shampoo::examples
