#include "examples/models.h"

#include <c10/util/Exception.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/pooling.h>

namespace shampoo::examples {

namespace {
constexpr int64_t kConv1Channels = 16;
constexpr int64_t kConv2Channels = 32;
}  // namespace

SmallCnnImpl::SmallCnnImpl(int64_t in_channels, int64_t num_classes, int64_t image_size) {
  TORCH_CHECK(in_channels >= 1, "SmallCnn: in_channels: got ", in_channels, ", expected >= 1");
  TORCH_CHECK(num_classes >= 2, "SmallCnn: num_classes: got ", num_classes, ", expected >= 2");
  TORCH_CHECK(image_size >= 4 && image_size % 4 == 0, "SmallCnn: image_size: got ", image_size,
              ", expected a multiple of 4 (two 2x2 poolings)");
  namespace nn = torch::nn;
  conv1_ = register_module(
      "conv1", nn::Conv2d(nn::Conv2dOptions(in_channels, kConv1Channels, 3).padding(1)));
  conv2_ = register_module(
      "conv2", nn::Conv2d(nn::Conv2dOptions(kConv1Channels, kConv2Channels, 3).padding(1)));
  const int64_t pooled = image_size / 4;
  classifier_ =
      register_module("classifier", nn::Linear(kConv2Channels * pooled * pooled, num_classes));
}

torch::Tensor SmallCnnImpl::forward(const torch::Tensor& images) {
  namespace F = torch::nn::functional;
  auto x = F::max_pool2d(F::relu(conv1_->forward(images)), F::MaxPool2dFuncOptions(2));
  x = F::max_pool2d(F::relu(conv2_->forward(x)), F::MaxPool2dFuncOptions(2));
  return classifier_->forward(x.flatten(1));
}

}  // namespace shampoo::examples
