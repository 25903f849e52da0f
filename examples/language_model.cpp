#include "examples/language_model.h"

#include <ATen/ops/lstm.h>
#include <c10/util/Exception.h>
#include <torch/nn/functional/dropout.h>
#include <torch/nn/functional/embedding.h>
#include <torch/nn/functional/linear.h>
#include <torch/nn/init.h>

#include <cmath>
#include <memory>
#include <tuple>
#include <vector>

namespace shampoo::examples {

namespace F = torch::nn::functional;
namespace nn = torch::nn;

namespace {
constexpr double kEmbeddingInitRange = 0.1;
}  // namespace

LstmLanguageModelImpl::LstmLanguageModelImpl(const LanguageModelOptions& options)
    : options_(options) {
  TORCH_CHECK(options.vocabulary_size >= 2, "LstmLanguageModel: vocabulary_size: got ",
              options.vocabulary_size, ", expected >= 2");
  TORCH_CHECK(options.dim >= 1, "--lm-dim: got ", options.dim, ", expected >= 1");
  TORCH_CHECK(options.dropout >= 0 && options.dropout < 1, "--lm-dropout: got ", options.dropout,
              ", expected a probability in [0, 1)");
  const int64_t v = options.vocabulary_size;
  const int64_t d = options.dim;
  torch::NoGradGuard no_grad;
  embedding_ = register_parameter("embedding", torch::empty({v, d}));
  nn::init::uniform_(embedding_, -kEmbeddingInitRange, kEmbeddingInitRange);
  const double bound = 1.0 / std::sqrt(static_cast<double>(d));
  // A plain submodule holds the LSTM's tensors, so that they are named lstm.weight_ih etc.
  const auto lstm = register_module("lstm", std::make_shared<nn::Module>("LSTM"));
  weight_ih_ = lstm->register_parameter("weight_ih", torch::empty({4 * d, d}));
  weight_hh_ = lstm->register_parameter("weight_hh", torch::empty({4 * d, d}));
  bias_ih_ = lstm->register_parameter("bias_ih", torch::empty({4 * d}));
  bias_hh_ = lstm->register_parameter("bias_hh", torch::empty({4 * d}));
  for (auto* p : {&weight_ih_, &weight_hh_, &bias_ih_, &bias_hh_}) {
    nn::init::uniform_(*p, -bound, bound);
  }
  norm_ = register_module("norm", nn::LayerNorm(nn::LayerNormOptions({d})));
  output_bias_ = register_parameter("output_bias", torch::zeros({v}));
}

torch::Tensor LstmLanguageModelImpl::forward(const torch::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == at::kLong,
              "LstmLanguageModel: tokens: got ", tokens.sizes(), " ", tokens.scalar_type(),
              ", expected int64 [N, T]");
  const auto dropout = F::DropoutFuncOptions().p(options_.dropout).training(is_training());
  auto x = F::embedding(tokens, embedding_);
  if (options_.dropout > 0) x = F::dropout(x, dropout);
  // A zero initial state for every sequence, in the input's dtype and device.
  const auto zero = x.new_zeros({1, x.size(0), options_.dim});
  // at::lstm on the registered tensors themselves (not torch::nn::LSTM's flattened copy), so that
  // whatever holds the parameters (full sharding gathers them in place) is what the LSTM uses.
  auto out = std::get<0>(at::lstm(x, {zero, zero}, {weight_ih_, weight_hh_, bias_ih_, bias_hh_},
                                  /*has_biases=*/true, /*num_layers=*/1, /*dropout=*/0.0,
                                  /*train=*/is_training(), /*bidirectional=*/false,
                                  /*batch_first=*/true));
  out = norm_->forward(out);
  if (options_.dropout > 0) out = F::dropout(out, dropout);
  // The output projection is the embedding itself (tied).
  return F::linear(out, embedding_, output_bias_);
}

}  // namespace shampoo::examples
