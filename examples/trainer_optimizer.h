#pragma once
/// The trainer's param groups and optimizer, built from its flags.
///
/// Param groups: one group holding every parameter, unless --lrs or --bias-weight-decay is
/// given; then every parameter gets a group of its own (in model order), with the --lrs rates
/// assigned round-robin and --bias-weight-decay for 1-D parameters. DistributedShampoo folds
/// groups that differ only in such float hyperparameters into virtual groups (unless
/// --no-merge-groups), so per-parameter groups cost nothing extra.

#include <torch/optim/optimizer.h>
#include <torch/ordered_dict.h>

#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "examples/trainer_config.h"

namespace shampoo::examples {

struct ParamGroupPlan {
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  double lr = 0;
  double weight_decay = 0;
};

std::vector<ParamGroupPlan> plan_param_groups(
    const torch::OrderedDict<std::string, at::Tensor>& named_parameters,
    const TrainerConfig& config);

/// torch::optim::SGD / Adam / AdamW, or shampoo::DistributedShampoo distributed over `group`
/// (null = one process), with one param group per plan. With --sharding gradients on several
/// ranks, the LibTorch optimizers run inside a shampoo::ShardedOptimizer (ZeRO-1, so that each
/// rank needs only its own parameters' gradients) and Shampoo owns whole parameters; the
/// result says which rank steps each parameter, for GradientSynchronizer::shard_gradients. Throws
/// c10::Error naming the option when a value is out of range.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(
    const TrainerConfig& config, const std::vector<ParamGroupPlan>& plans,
    const c10::intrusive_ptr<c10d::ProcessGroup>& group);

/// The plans as param groups, each with the configured optimizer's options (its lr and weight
/// decay): what FullyShardedDataParallel takes for optimizer()'s groups.
std::vector<torch::optim::OptimizerParamGroup> make_param_groups(
    const TrainerConfig& config, const std::vector<ParamGroupPlan>& plans);

/// One line per group ("conv.weight: lr 0.01, weight decay 0.0001") for the log.
std::string describe_param_groups(const std::vector<ParamGroupPlan>& plans);

}  // namespace shampoo::examples
