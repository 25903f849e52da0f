#pragma once
/// Distributed DistributedShampoo: every rank must register the same parameters with the same
/// structural options, or the ranks' AllGathers would not match. One small AllGather of a
/// fingerprint at registration checks it; a mismatch is an error on every rank (never a hang
/// later), saying what differs.

#include <torch/optim/optimizer.h>

#include <vector>

#include "distributor/distributor.h"
#include "shampoo/param_registry.h"

namespace shampoo::detail {

/// Nothing without a process group. Collective otherwise.
void check_ranks_agree(Distributor& distributor,
                       const std::vector<torch::optim::OptimizerParamGroup>& groups,
                       const ParamRegistry& registry);

}  // namespace shampoo::detail
