// Must not compile: optimizer factories written for the per-parameter contract of full and state
// sharding (a std::vector<torch::Tensor> per call). The test old_factory_contract_refused builds
// this file and expects the compiler to print GroupOptimizerFactory's message for each wrapper:
// such a factory used to pick options by looking at its parameter, and since the wrappers call it
// once per rank it would silently give every parameter the first one's options.
#include <shampoo/shampoo.h>
#include <torch/optim/adam.h>

#include <memory>
#include <vector>

void full_sharding_with_a_per_parameter_factory(std::vector<shampoo::ShardedUnit> units,
                                                c10::intrusive_ptr<c10d::ProcessGroup> group) {
  shampoo::FullyShardedDataParallel fsdp(
      std::move(units),
      [](std::vector<torch::Tensor> params) -> std::unique_ptr<torch::optim::Optimizer> {
        const double lr = params.at(0).dim() == 1 ? 3e-3 : 1e-3;
        return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(lr));
      },
      std::move(group));
}

void state_sharding_with_an_optimizer_factory(std::vector<torch::Tensor> params,
                                              c10::intrusive_ptr<c10d::ProcessGroup> group) {
  const shampoo::OptimizerFactory factory = [](std::vector<torch::Tensor> p) {
    return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-3));
  };
  shampoo::ShardedOptimizer sharded(std::move(params), factory, std::move(group));
}
