// The names README.md's marked C++ blocks use without declaring them (see
// ../readme_snippets.cmake): a small model, one batch and a loss, enough to run each block.
#pragma once

#include <torch/torch.h>

#include <functional>

namespace readme_context {

/// The first snippet: the training loop that replaces torch::optim::Adam.
struct quickstart {
  torch::nn::Linear model{8, 4};
  torch::Tensor x = torch::randn({32, 8});
  torch::Tensor y = torch::randn({32, 4});
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)> loss_fn =
      [](const torch::Tensor& output, const torch::Tensor& target) {
        return torch::mse_loss(output, target);
      };
  int num_steps = 3;
};

/// The mixed-precision snippet: the same model, batch and loss.
struct mixed_precision : quickstart {};

}  // namespace readme_context
