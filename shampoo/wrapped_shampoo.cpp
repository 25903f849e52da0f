// DistributedShampoo inside the wrappers: found through the optimizer the user holds.
#include "shampoo/wrapped_shampoo.h"

#include "parallel/full_sharding/fully_sharded.h"
#include "parallel/in_backward/in_backward.h"
#include "parallel/state_sharding/sharded_optimizer.h"

namespace shampoo {

std::vector<const DistributedShampoo*> shampoo_optimizers(const torch::optim::Optimizer& optimizer) {
  auto& mutable_optimizer = const_cast<torch::optim::Optimizer&>(optimizer);
  if (const auto* shampoo = dynamic_cast<const DistributedShampoo*>(&optimizer)) return {shampoo};
  std::vector<const DistributedShampoo*> out;
  const auto add = [&](const torch::optim::Optimizer& inner) {
    const auto found = shampoo_optimizers(inner);
    out.insert(out.end(), found.begin(), found.end());
  };
  if (auto* full = dynamic_cast<FullyShardedOptimizer*>(&mutable_optimizer)) {
    for (const auto* inner : full->wrapper().optimizers()) add(*inner);
  } else if (auto* in_backward = dynamic_cast<InBackwardOptimizer*>(&mutable_optimizer)) {
    for (size_t i = 0; i < in_backward->num_optimizers(); ++i) add(in_backward->optimizer(i));
  } else if (auto* sharded = dynamic_cast<ShardedOptimizer*>(&mutable_optimizer)) {
    add(sharded->local_optimizer());
  }
  return out;
}

ShampooStats shampoo_stats(const torch::optim::Optimizer& optimizer) {
  ShampooStats total;
  for (const auto* shampoo : shampoo_optimizers(optimizer)) {
    const auto s = shampoo->stats();
    total.virtual_groups += s.virtual_groups;
    total.collectives_last_step += s.collectives_last_step;
    total.amortized_computations += s.amortized_computations;
    total.failed_amortized_computations += s.failed_amortized_computations;
    total.double_precision_retries += s.double_precision_retries;
    total.root_solver_fallbacks += s.root_solver_fallbacks;
    total.amortized_batched_calls += s.amortized_batched_calls;
    total.total_blocks += s.total_blocks;
    total.owned_blocks += s.owned_blocks;
    total.state_bytes += s.state_bytes;
    total.rollback_bytes_last_step += s.rollback_bytes_last_step;
    total.bytes_sent_per_step += s.bytes_sent_per_step;
    total.bytes_received_per_step += s.bytes_received_per_step;
  }
  return total;
}

MemorySummary shampoo_memory_summary(const torch::optim::Optimizer& optimizer) {
  MemorySummary total;
  for (const auto* shampoo : shampoo_optimizers(optimizer)) total += shampoo->memory_summary();
  return total;
}

}  // namespace shampoo
