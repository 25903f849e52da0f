// The names README.md's marked C++ blocks use without declaring them (see
// ../readme_snippets.cmake): a small model, one batch and a loss, enough to run each block.
#pragma once

#include <shampoo/shampoo.h>
#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

namespace readme_context {

/// One batch, a loss and a step count: what every training-loop snippet uses.
struct batch_and_loss {
  torch::Tensor x = torch::randn({32, 8});
  torch::Tensor y = torch::randn({32, 4});
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> loss_fn =
      [](const torch::Tensor& output, const torch::Tensor& target) {
        return torch::mse_loss(output, target);
      };
  int num_steps = 3;
};

/// The first snippet: the training loop that replaces torch::optim::Adam.
struct quickstart : batch_and_loss {
  torch::nn::Linear model{8, 4};
};

/// The mixed-precision snippet: the same model, batch and loss.
struct mixed_precision : quickstart {};

/// The full-sharding snippet: a Sequential model, the same batch and loss, and a process group of
/// one rank (torchrun's group in a real run).
struct full_sharding : batch_and_loss {
  torch::nn::Sequential model{torch::nn::Linear(8, 16), torch::nn::ReLU(),
                              torch::nn::Linear(16, 4)};
  c10::intrusive_ptr<c10d::ProcessGroup> group = shampoo::detail::make_process_group(
      c10::make_intrusive<c10d::HashStore>(), 0, 1, std::chrono::minutes(1), false);
};

/// The virtual-groups snippet: two parameter lists.
struct virtual_groups {
  std::vector<torch::Tensor> conv_weights{torch::randn({8, 3, 3, 3}).requires_grad_()};
  std::vector<torch::Tensor> biases{torch::randn({8}).requires_grad_()};
};

/// The training-checkpoint snippet: a model, a batch, a loss and a process group of one rank.
struct training_checkpoint : full_sharding {};

/// The gradient-sharding snippet: the same.
struct gradient_sharding : full_sharding {};

/// The learning-rate schedule snippet: the quickstart's model, batch and loss.
struct lr_schedule : quickstart {};

}  // namespace readme_context
