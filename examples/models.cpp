#include "examples/models.h"

#include <c10/util/Exception.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/pooling.h>

#include <iterator>
#include <stdexcept>

namespace shampoo::examples {

namespace F = torch::nn::functional;
namespace nn = torch::nn;

namespace {
constexpr int64_t kConvNetChannels = 64;
constexpr int64_t kSmallCnnConv1Channels = 16;
constexpr int64_t kSmallCnnConv2Channels = 32;
constexpr int64_t kResNetStageChannels[] = {16, 32, 64};
constexpr int64_t kAutoencoderWidths[] = {1000, 500, 250, 30};  // the encoder after the input
}  // namespace

ConvNetImpl::ConvNetImpl(int64_t in_channels, int64_t num_classes, int64_t height, int64_t width) {
  TORCH_CHECK(in_channels >= 1, "ConvNet: in_channels: got ", in_channels, ", expected >= 1");
  TORCH_CHECK(num_classes >= 2, "ConvNet: num_classes: got ", num_classes, ", expected >= 2");
  TORCH_CHECK(height >= 1 && width >= 1, "ConvNet: image size: got ", height, "x", width,
              ", expected >= 1x1");
  conv_ = register_module(
      "conv",
      nn::Conv2d(
          nn::Conv2dOptions(in_channels, kConvNetChannels, 3).stride(1).padding(1).bias(false)));
  // A 3x3 convolution with stride 1 and padding 1 keeps the height and width.
  linear_ = register_module("linear", nn::Linear(kConvNetChannels * height * width, num_classes));
}

torch::Tensor ConvNetImpl::forward(const torch::Tensor& images) {
  const auto features = run_unit("conv", [&] { return conv_->forward(images); });
  const auto flat = F::relu(features).flatten(1);
  return run_unit("linear", [&] { return linear_->forward(flat); });
}

std::vector<std::pair<std::string, std::vector<torch::Tensor>>> ConvNetImpl::sharding_units() {
  return {{"conv", conv_->parameters()}, {"linear", linear_->parameters()}};
}

SmallCnnImpl::SmallCnnImpl(int64_t in_channels, int64_t num_classes, int64_t image_size) {
  TORCH_CHECK(in_channels >= 1, "SmallCnn: in_channels: got ", in_channels, ", expected >= 1");
  TORCH_CHECK(num_classes >= 2, "SmallCnn: num_classes: got ", num_classes, ", expected >= 2");
  TORCH_CHECK(image_size >= 4 && image_size % 4 == 0, "SmallCnn: image_size: got ", image_size,
              ", expected a multiple of 4 (two 2x2 poolings)");
  conv1_ = register_module(
      "conv1", nn::Conv2d(nn::Conv2dOptions(in_channels, kSmallCnnConv1Channels, 3).padding(1)));
  conv2_ = register_module(
      "conv2",
      nn::Conv2d(nn::Conv2dOptions(kSmallCnnConv1Channels, kSmallCnnConv2Channels, 3).padding(1)));
  const int64_t pooled = image_size / 4;
  classifier_ = register_module("classifier",
                                nn::Linear(kSmallCnnConv2Channels * pooled * pooled, num_classes));
}

torch::Tensor SmallCnnImpl::forward(const torch::Tensor& images) {
  auto x = F::max_pool2d(F::relu(conv1_->forward(images)), F::MaxPool2dFuncOptions(2));
  x = F::max_pool2d(F::relu(conv2_->forward(x)), F::MaxPool2dFuncOptions(2));
  return classifier_->forward(x.flatten(1));
}

BasicBlockImpl::BasicBlockImpl(int64_t in_channels, int64_t out_channels, int64_t stride) {
  conv1_ = register_module(
      "conv1",
      nn::Conv2d(
          nn::Conv2dOptions(in_channels, out_channels, 3).stride(stride).padding(1).bias(false)));
  bn1_ = register_module("bn1", nn::BatchNorm2d(out_channels));
  conv2_ = register_module(
      "conv2",
      nn::Conv2d(
          nn::Conv2dOptions(out_channels, out_channels, 3).stride(1).padding(1).bias(false)));
  bn2_ = register_module("bn2", nn::BatchNorm2d(out_channels));
  if (stride != 1 || in_channels != out_channels) {
    shortcut_conv_ = register_module(
        "shortcut_conv",
        nn::Conv2d(nn::Conv2dOptions(in_channels, out_channels, 1).stride(stride).bias(false)));
    shortcut_bn_ = register_module("shortcut_bn", nn::BatchNorm2d(out_channels));
  }
}

torch::Tensor BasicBlockImpl::forward(const torch::Tensor& x) {
  auto out = F::relu(bn1_->forward(conv1_->forward(x)));
  out = bn2_->forward(conv2_->forward(out));
  const auto shortcut = shortcut_conv_ ? shortcut_bn_->forward(shortcut_conv_->forward(x)) : x;
  return F::relu(out + shortcut);
}

ResNetImpl::ResNetImpl(int64_t in_channels, int64_t num_classes, int64_t blocks_per_stage) {
  TORCH_CHECK(in_channels >= 1, "ResNet: in_channels: got ", in_channels, ", expected >= 1");
  TORCH_CHECK(num_classes >= 2, "ResNet: num_classes: got ", num_classes, ", expected >= 2");
  TORCH_CHECK(blocks_per_stage >= 1, "ResNet: blocks_per_stage: got ", blocks_per_stage,
              ", expected >= 1");
  stem_conv_ = register_module("stem_conv",
                               nn::Conv2d(nn::Conv2dOptions(in_channels, kResNetStageChannels[0], 3)
                                              .stride(1)
                                              .padding(1)
                                              .bias(false)));
  stem_bn_ = register_module("stem_bn", nn::BatchNorm2d(kResNetStageChannels[0]));
  blocks_ = register_module("blocks", nn::ModuleList());
  int64_t channels = kResNetStageChannels[0];
  for (int64_t stage = 0; stage < 3; ++stage) {
    const int64_t out_channels = kResNetStageChannels[stage];
    for (int64_t b = 0; b < blocks_per_stage; ++b) {
      const int64_t stride = (stage > 0 && b == 0) ? 2 : 1;
      blocks_->push_back(BasicBlock(channels, out_channels, stride));
      channels = out_channels;
    }
  }
  classifier_ = register_module("classifier", nn::Linear(channels, num_classes));
}

torch::Tensor ResNetImpl::forward(const torch::Tensor& images) {
  auto x = F::relu(stem_bn_->forward(stem_conv_->forward(images)));
  for (const auto& block : *blocks_) x = block->as<BasicBlock>()->forward(x);
  x = F::adaptive_avg_pool2d(x, F::AdaptiveAvgPool2dFuncOptions(1)).flatten(1);
  return classifier_->forward(x);
}

DeepAutoencoderImpl::DeepAutoencoderImpl(int64_t pixels) {
  TORCH_CHECK(pixels >= 1, "DeepAutoencoder: pixels: got ", pixels, ", expected >= 1");
  encoder_ = register_module("encoder", nn::ModuleList());
  decoder_ = register_module("decoder", nn::ModuleList());
  int64_t in = pixels;
  for (const int64_t width : kAutoencoderWidths) {
    encoder_->push_back(nn::Linear(in, width));
    in = width;
  }
  // Mirrored: 30 → 250 → 500 → 1000 → pixels.
  const int64_t depth = static_cast<int64_t>(std::size(kAutoencoderWidths));
  for (int64_t i = depth - 2; i >= -1; --i) {
    const int64_t out = i >= 0 ? kAutoencoderWidths[i] : pixels;
    decoder_->push_back(nn::Linear(in, out));
    in = out;
  }
}

torch::Tensor DeepAutoencoderImpl::forward(const torch::Tensor& images) {
  auto x = images.flatten(1);
  const auto encoders = encoder_->size();
  for (size_t i = 0; i < encoders; ++i) {
    x = run_unit("encoder." + std::to_string(i),
                 [&] { return encoder_->ptr(i)->as<nn::Linear>()->forward(x); });
    if (i + 1 < encoders) x = torch::sigmoid(x);  // the 30-unit code is linear
  }
  const auto decoders = decoder_->size();
  for (size_t i = 0; i < decoders; ++i) {
    x = run_unit("decoder." + std::to_string(i),
                 [&] { return decoder_->ptr(i)->as<nn::Linear>()->forward(x); });
    if (i + 1 < decoders) x = torch::sigmoid(x);  // the last layer's logits go to the loss
  }
  return x;
}

std::vector<std::pair<std::string, std::vector<torch::Tensor>>>
DeepAutoencoderImpl::sharding_units() {
  std::vector<std::pair<std::string, std::vector<torch::Tensor>>> units;
  for (size_t i = 0; i < encoder_->size(); ++i) {
    units.emplace_back("encoder." + std::to_string(i), encoder_->ptr(i)->parameters());
  }
  for (size_t i = 0; i < decoder_->size(); ++i) {
    units.emplace_back("decoder." + std::to_string(i), decoder_->ptr(i)->parameters());
  }
  return units;
}

std::shared_ptr<TrainerModel> make_image_classifier(const std::string& name, int64_t in_channels,
                                                       int64_t num_classes, int64_t height,
                                                       int64_t width) {
  if (name == "convnet") return ConvNet(in_channels, num_classes, height, width).ptr();
  if (name == "resnet") return ResNet(in_channels, num_classes, /*blocks_per_stage=*/1).ptr();
  if (name == "smallcnn") {
    TORCH_CHECK(height == width, "SmallCnn: needs square images, got ", height, "x", width);
    return SmallCnn(in_channels, num_classes, height).ptr();
  }
  if (name == "autoencoder") return DeepAutoencoder(in_channels * height * width).ptr();
  throw std::invalid_argument("--model: got '" + name +
                              "', expected convnet, resnet, smallcnn or autoencoder");
}

}  // namespace shampoo::examples
