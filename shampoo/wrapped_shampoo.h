#pragma once
/// What DistributedShampoo does inside a wrapper, through the optimizer LibTorch code holds: full
/// sharding's optimizer(), an InBackwardOptimizer, a ShardedOptimizer, or DistributedShampoo
/// itself. For checks a user makes without knowing how the wrapper keeps its optimizers, e.g.
/// that param groups merged into one virtual group on every rank:
///
///   EXPECT_EQ(shampoo::shampoo_stats(fsdp.optimizer()).virtual_groups, 1);
///   std::cout << shampoo::shampoo_memory_summary(fsdp.optimizer()).to_string();

#include <torch/optim/optimizer.h>

#include <vector>

#include "preconditioners/memory_summary.h"
#include "shampoo/distributed_shampoo.h"

namespace shampoo {

/// The DistributedShampoo optimizers that step on this rank inside `optimizer`: itself; full
/// sharding's rank optimizer (none on a rank that steps no parameter); an InBackwardOptimizer's
/// sets (and their ShardedOptimizers' local optimizers); a ShardedOptimizer's local optimizer.
/// Empty when there is none.
std::vector<const DistributedShampoo*> shampoo_optimizers(const torch::optim::Optimizer& optimizer);

/// The stats of shampoo_optimizers(optimizer), summed (all zero when there is none).
ShampooStats shampoo_stats(const torch::optim::Optimizer& optimizer);

/// Their memory summaries, summed: the bytes of Shampoo state this rank holds, by kind, and per
/// parameter (indices are each optimizer's own).
MemorySummary shampoo_memory_summary(const torch::optim::Optimizer& optimizer);

}  // namespace shampoo
