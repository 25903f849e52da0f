#pragma once
/// Distributed DistributedShampoo: every rank must register the same parameters with the same
/// structural options, and construct the optimizer with the same DistributedOptions where they
/// decide what a rank sends, or the ranks' collectives would not match. One small AllGather at
/// construction and one at registration check it; a mismatch is an error on every rank (never a
/// hang, a crash inside Gloo or wrong owners later), saying what differs.

#include <torch/optim/optimizer.h>

#include <vector>

#include "distributor/distributor.h"
#include "shampoo/param_registry.h"
#include "shampoo/shampoo_options.h"

namespace shampoo::detail {

/// Every rank of `distributed.process_group()` has the same communication dtype, trainer group
/// size, communicate_params, merge_param_groups, shard_by_parameter and agree_before_update; an
/// error naming the field and the ranks' values otherwise. Nothing without a process group.
/// Collective over the whole process group: call it before anything else communicates.
void check_distributed_options_agree(const DistributedOptions& distributed);

/// What must be equal on every rank of the trainer group at each step, as fingerprints for the
/// agreement before the update (Distributor::agree): the groups' lrs, then their other float
/// options (betas, epsilon, weight decay, momentum, ...): kFloatOptionPrints values.
constexpr size_t kFloatOptionPrints = 2;
std::vector<int64_t> float_option_prints(
    const std::vector<torch::optim::OptimizerParamGroup>& groups);

/// Empty when every rank passed the same float_option_prints to the agreement (`all`, per rank);
/// otherwise the error: which of the two differs, on which ranks, and this rank's lrs (`lrs`,
/// per group).
std::string float_options_disagreement(const std::vector<std::vector<int64_t>>& all,
                                       const std::vector<double>& lrs);

/// Nothing without a process group. Collective otherwise.
void check_ranks_agree(Distributor& distributor,
                       const std::vector<torch::optim::OptimizerParamGroup>& groups,
                       const ParamRegistry& registry);

}  // namespace shampoo::detail
