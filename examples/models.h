#pragma once
/// Models of the example programs.

#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>

namespace shampoo::examples {

/// A small CNN for square images:
///   conv 3x3 (in_channels → 16, padding 1), ReLU, max-pool 2
///   conv 3x3 (16 → 32, padding 1), ReLU, max-pool 2
///   linear (32·(image_size/4)² → num_classes)
/// Input [N, in_channels, image_size, image_size] float; output logits [N, num_classes].
class SmallCnnImpl : public torch::nn::Module {
 public:
  explicit SmallCnnImpl(int64_t in_channels = 1, int64_t num_classes = 10, int64_t image_size = 28);

  torch::Tensor forward(const torch::Tensor& images);

 private:
  torch::nn::Conv2d conv1_{nullptr};
  torch::nn::Conv2d conv2_{nullptr};
  torch::nn::Linear classifier_{nullptr};
};
TORCH_MODULE(SmallCnn);

}  // namespace shampoo::examples
