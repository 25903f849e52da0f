// The example models' interface: the deep autoencoder's layers, its forward pass (sigmoid hidden
// units, a linear code, pixel logits out) and the model names.
#include "examples/models.h"

#include <gtest/gtest.h>
#include <torch/nn/functional/linear.h>
#include <torch/types.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace {

using shampoo::examples::make_image_classifier;

TEST(Models, DeepAutoencoderHasTheMirroredLayers) {
  const auto model = make_image_classifier("autoencoder", 1, 10, 28, 28);
  EXPECT_TRUE(model->reconstructs());
  const std::vector<std::vector<int64_t>> expected = {
      {1000, 784}, {1000}, {500, 1000}, {500}, {250, 500},  {250},  {30, 250},   {30},
      {250, 30},   {250},  {500, 250},  {500}, {1000, 500}, {1000}, {784, 1000}, {784}};
  const auto params = model->parameters();
  ASSERT_EQ(params.size(), expected.size());
  int64_t numel = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i].sizes().vec(), expected[i]) << "parameter " << i;
    numel += params[i].numel();
  }
  EXPECT_EQ(numel, 2837314);
}

TEST(Models, DeepAutoencoderForwardIsSigmoidLayersWithALinearCode) {
  torch::manual_seed(5);
  const auto model = make_image_classifier("autoencoder", 1, 10, 28, 28);
  const auto images = torch::rand({3, 1, 28, 28});
  const auto out = model->forward(images);
  ASSERT_EQ(out.sizes().vec(), (std::vector<int64_t>{3, 784}));
  // By hand: sigmoid after every layer but the code (the 4th) and the output (the 8th).
  const auto params = model->parameters();
  auto x = images.flatten(1);
  for (size_t layer = 0; layer < 8; ++layer) {
    x = torch::nn::functional::linear(x, params[2 * layer], params[2 * layer + 1]);
    if (layer != 3 && layer != 7) x = torch::sigmoid(x);
  }
  EXPECT_TRUE(torch::allclose(out, x, 1e-5, 1e-5));
}

TEST(Models, ClassifiersDoNotReconstructAndUnknownNamesAreErrors) {
  EXPECT_FALSE(make_image_classifier("convnet", 1, 10, 28, 28)->reconstructs());
  EXPECT_FALSE(make_image_classifier("smallcnn", 1, 10, 28, 28)->reconstructs());
  try {
    make_image_classifier("vae", 1, 10, 28, 28);
    FAIL() << "an unknown model name should throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("expected convnet, resnet, smallcnn or autoencoder"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
