// The word-level language model: shapes, the tied embedding (one tensor, both gradients) and the
// forward pass against one written out by hand.
#include "examples/language_model.h"

#include <gtest/gtest.h>
#include <torch/nn/functional/embedding.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/functional/normalization.h>
#include <torch/types.h>

#include <string>
#include <vector>

namespace {

using shampoo::examples::LanguageModelOptions;
using shampoo::examples::LstmLanguageModel;
using shampoo::examples::Objective;

TEST(LanguageModel, ParametersHaveTheDocumentedNamesAndShapes) {
  LstmLanguageModel model(LanguageModelOptions{50, 8, 0.0});
  EXPECT_EQ(model->objective(), Objective::kNextToken);
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& item : model->named_parameters()) {
    names.push_back(item.key());
    shapes.push_back(item.value().sizes().vec());
  }
  EXPECT_EQ(names, (std::vector<std::string>{"embedding", "output_bias", "lstm.weight_ih",
                                             "lstm.weight_hh", "lstm.bias_ih", "lstm.bias_hh",
                                             "norm.weight", "norm.bias"}));
  EXPECT_EQ(shapes, (std::vector<std::vector<int64_t>>{
                        {50, 8}, {50}, {32, 8}, {32, 8}, {32}, {32}, {8}, {8}}));
}

TEST(LanguageModel, TheOutputProjectionIsTheEmbeddingItself) {
  torch::manual_seed(3);
  LstmLanguageModel model(LanguageModelOptions{20, 6, 0.0});
  // One [V, d] tensor among the parameters, the one the module uses for both.
  int64_t embeddings = 0;
  for (const auto& p : model->parameters()) embeddings += p.sizes() == at::IntArrayRef{20, 6};
  EXPECT_EQ(embeddings, 1);
  EXPECT_TRUE(model->parameters()[0].is_same(model->embedding()));
  // Its gradient has both parts: the rows of the tokens read (lookup) and every row (the
  // projection); a token that is never read still gets a gradient through the projection.
  const auto tokens = torch::tensor({{1, 2, 3}}, torch::kLong);
  model->forward(tokens).logsumexp(-1).sum().backward();
  const auto grad = model->embedding().grad();
  ASSERT_TRUE(grad.defined());
  EXPECT_GT(grad[19].abs().sum().item<double>(), 0.0);
  // Changing the embedding changes the logits of a token it does not read: it is the
  // projection too.
  const auto before = model->forward(tokens).detach();
  {
    torch::NoGradGuard no_grad;
    // Not a constant: LayerNorm's output sums to zero, so a constant shift would not show.
    model->embedding()[19].add_(torch::linspace(-1.0, 1.0, 6));
  }
  const auto after = model->forward(tokens).detach();
  EXPECT_GT((after.select(-1, 19) - before.select(-1, 19)).abs().max().item<double>(), 1e-3);
  EXPECT_TRUE(torch::equal(after.select(-1, 0), before.select(-1, 0)));
}

TEST(LanguageModel, ForwardIsEmbeddingLstmLayerNormAndTheTiedProjection) {
  torch::manual_seed(5);
  const int64_t v = 30;
  const int64_t d = 4;
  LstmLanguageModel model(LanguageModelOptions{v, d, 0.0});
  const auto tokens = torch::randint(0, v, {2, 5}, torch::kLong);
  const auto logits = model->forward(tokens);
  ASSERT_EQ(logits.sizes().vec(), (std::vector<int64_t>{2, 5, v}));
  // By hand: torch.nn.LSTM's gates (i, f, g, o) from a zero state, step by step.
  const auto p = model->named_parameters();
  auto x = torch::nn::functional::embedding(tokens, p["embedding"]);
  auto h = torch::zeros({2, d});
  auto c = torch::zeros({2, d});
  std::vector<torch::Tensor> outputs;
  for (int64_t t = 0; t < 5; ++t) {
    const auto gates =
        torch::nn::functional::linear(x.select(1, t), p["lstm.weight_ih"], p["lstm.bias_ih"]) +
        torch::nn::functional::linear(h, p["lstm.weight_hh"], p["lstm.bias_hh"]);
    const auto chunks = gates.chunk(4, 1);
    c = torch::sigmoid(chunks[1]) * c + torch::sigmoid(chunks[0]) * torch::tanh(chunks[2]);
    h = torch::sigmoid(chunks[3]) * torch::tanh(c);
    outputs.push_back(h);
  }
  auto out = torch::stack(outputs, 1);
  out = torch::nn::functional::layer_norm(out, torch::nn::functional::LayerNormFuncOptions({d})
                                                   .weight(p["norm.weight"])
                                                   .bias(p["norm.bias"]));
  const auto expected = torch::nn::functional::linear(out, p["embedding"], p["output_bias"]);
  EXPECT_TRUE(torch::allclose(logits, expected, 1e-5, 1e-5))
      << "max abs error " << (logits - expected).abs().max().item<double>();
}

TEST(LanguageModel, DropoutActsInTrainingOnly) {
  torch::manual_seed(9);
  LstmLanguageModel model(LanguageModelOptions{30, 16, 0.5});
  const auto tokens = torch::randint(0, 30, {3, 7}, torch::kLong);
  model->eval();
  EXPECT_TRUE(torch::equal(model->forward(tokens), model->forward(tokens)));
  model->train();
  EXPECT_FALSE(torch::equal(model->forward(tokens), model->forward(tokens)));
}

}  // namespace
