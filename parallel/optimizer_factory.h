#pragma once
/// Factories of optimizers over a parameter set, as optimizer-in-backward and the sharded
/// optimizer take them, and the size of an optimizer's state.

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace shampoo {

/// Makes the optimizer of a parameter set (called once per set, with the whole set).
using OptimizerFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;

/// Bytes of the per-parameter state tensors of LibTorch's SGD, Adam, AdamW, Adagrad and RMSprop
/// (-1 for another optimizer type, whose state this cannot see).
int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer);

}  // namespace shampoo
