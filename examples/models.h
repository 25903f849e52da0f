#pragma once
/// Models of the example programs. Each is a TrainerModel: images [N, C, H, W] float in,
/// logits out: [N, num_classes] for the classifiers, [N, C·H·W] pixel logits for the autoencoder
/// (objective() kReconstruct), whose targets are the images themselves; or, for the language
/// model (examples/language_model.h), token ids [N, T] in and next-token logits [N, T, V] out.

#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace shampoo::examples {

/// What a model's output is trained against; the trainer's loss and metrics follow from it.
///   kClassify:      logits [N, classes] against labels (cross-entropy; test accuracy)
///   kReconstruct:   pixel logits [N, C·H·W] against the input's intensities (binary
///                   cross-entropy summed over an image; no accuracy)
///   kNextToken:     logits [N, T, V] against the next tokens (mean token cross-entropy;
///                   perplexity)
enum class Objective { kClassify, kReconstruct, kNextToken };

/// A module the trainer trains; lets it hold any of the models below.
class TrainerModel : public torch::nn::Module {
 public:
  virtual torch::Tensor forward(const torch::Tensor& input) = 0;
  virtual Objective objective() const { return Objective::kClassify; }
  /// True for a model that reconstructs its input (logits of every pixel) instead of classifying.
  bool reconstructs() const { return objective() == Objective::kReconstruct; }

  /// Runs the forward of one unit of full sharding: (unit name, the unit's forward) -> its output.
  using UnitRunner = std::function<torch::Tensor(const std::string& unit,
                                                 const std::function<torch::Tensor()>& forward)>;
  /// The units of full sharding (shampoo::FullyShardedDataParallel), by name, in forward order,
  /// each with its parameters. Empty (the default): the whole model is one unit.
  virtual std::vector<std::pair<std::string, std::vector<torch::Tensor>>> sharding_units() {
    return {};
  }
  /// From now on forward() runs each of sharding_units() through `runner` (null: directly).
  void set_unit_runner(UnitRunner runner) { unit_runner_ = std::move(runner); }

 protected:
  torch::Tensor run_unit(const std::string& unit, const std::function<torch::Tensor()>& forward) {
    return unit_runner_ ? unit_runner_(unit, forward) : forward();
  }

 private:
  UnitRunner unit_runner_;
};

/// The deep autoencoder of Hinton & Salakhutdinov (Science, 2006), the classic benchmark of
/// second-order optimizers (Martens 2010; K-FAC, Martens & Grosse 2015): fully connected,
/// C·H·W-1000-500-250-30 and mirrored back to C·H·W, logistic (sigmoid) hidden units, a linear
/// 30-unit code layer, and logits of every pixel out (the loss applies the sigmoid). Inputs and
/// targets are the pixel intensities in [0, 1].
class DeepAutoencoderImpl : public TrainerModel {
 public:
  explicit DeepAutoencoderImpl(int64_t pixels);
  torch::Tensor forward(const torch::Tensor& images) override;
  Objective objective() const override { return Objective::kReconstruct; }
  /// One unit per layer: "encoder.<i>", "decoder.<i>".
  std::vector<std::pair<std::string, std::vector<torch::Tensor>>> sharding_units() override;

 private:
  torch::nn::ModuleList encoder_{nullptr};
  torch::nn::ModuleList decoder_{nullptr};
};
TORCH_MODULE(DeepAutoencoder);

/// The reference's ConvNet (facebookresearch/optimizers, distributed_shampoo/examples/convnet.py):
///   conv 3x3 (in_channels → 64, stride 1, padding 1, no bias), ReLU,
///   linear (64·height·width → num_classes)
/// Parameters in order: conv.weight [64, C, 3, 3], linear.weight [classes, 64·H·W], linear.bias.
class ConvNetImpl : public TrainerModel {
 public:
  ConvNetImpl(int64_t in_channels, int64_t num_classes, int64_t height, int64_t width);
  torch::Tensor forward(const torch::Tensor& images) override;
  /// Two units: "conv" and "linear".
  std::vector<std::pair<std::string, std::vector<torch::Tensor>>> sharding_units() override;

 private:
  torch::nn::Conv2d conv_{nullptr};
  torch::nn::Linear linear_{nullptr};
};
TORCH_MODULE(ConvNet);

/// A small CNN for square images:
///   conv 3x3 (in_channels → 16, padding 1), ReLU, max-pool 2
///   conv 3x3 (16 → 32, padding 1), ReLU, max-pool 2
///   linear (32·(image_size/4)² → num_classes)
class SmallCnnImpl : public TrainerModel {
 public:
  explicit SmallCnnImpl(int64_t in_channels = 1, int64_t num_classes = 10, int64_t image_size = 28);
  torch::Tensor forward(const torch::Tensor& images) override;

 private:
  torch::nn::Conv2d conv1_{nullptr};
  torch::nn::Conv2d conv2_{nullptr};
  torch::nn::Linear classifier_{nullptr};
};
TORCH_MODULE(SmallCnn);

/// Residual block of He et al. (2016): conv 3x3, BN, ReLU, conv 3x3, BN, plus the shortcut (a
/// 1x1 conv + BN when the shape changes), ReLU.
class BasicBlockImpl : public torch::nn::Module {
 public:
  BasicBlockImpl(int64_t in_channels, int64_t out_channels, int64_t stride);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  torch::nn::Conv2d conv1_{nullptr};
  torch::nn::BatchNorm2d bn1_{nullptr};
  torch::nn::Conv2d conv2_{nullptr};
  torch::nn::BatchNorm2d bn2_{nullptr};
  torch::nn::Conv2d shortcut_conv_{nullptr};  // null when the shortcut is the identity
  torch::nn::BatchNorm2d shortcut_bn_{nullptr};
};
TORCH_MODULE(BasicBlock);

/// The CIFAR ResNet of He et al. (2016), section 4.2, with `blocks_per_stage` = n basic blocks in
/// each of three stages of 16, 32 and 64 channels (depth 6n + 2: n = 1 is ResNet-8, n = 3
/// ResNet-20): conv 3x3 → 16, BN, ReLU; the stages (stride 1, 2, 2); global average pooling;
/// linear 64 → num_classes. Batch normalization: in data-parallel training each rank
/// normalizes with its own batch and keeps its own running statistics (the trainer averages
/// them across ranks before evaluating).
class ResNetImpl : public TrainerModel {
 public:
  ResNetImpl(int64_t in_channels, int64_t num_classes, int64_t blocks_per_stage = 1);
  torch::Tensor forward(const torch::Tensor& images) override;

 private:
  torch::nn::Conv2d stem_conv_{nullptr};
  torch::nn::BatchNorm2d stem_bn_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};
  torch::nn::Linear classifier_{nullptr};
};
TORCH_MODULE(ResNet);

/// The --model choices: "convnet", "resnet" (ResNet-8), "smallcnn", "autoencoder" (num_classes
/// unused).
std::shared_ptr<TrainerModel> make_image_classifier(const std::string& name, int64_t in_channels,
                                                    int64_t num_classes, int64_t height,
                                                    int64_t width);

}  // namespace shampoo::examples
