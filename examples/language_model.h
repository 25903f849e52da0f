#pragma once
/// The word-level language model of the trainer (--model lm), a small LSTM language model in the
/// style of Zaremba et al. (2014) and PyTorch's word_language_model example, with tied input and
/// output embeddings (Press & Wolf 2017; Inan et al. 2017):
///
///   tokens [N, T] → embedding E [V, d] → dropout → 1-layer LSTM (hidden size d)
///     → LayerNorm(d) → dropout → logits = h Eᵀ + b  [N, T, V]
///
/// E is one parameter: the embedding lookup and the output projection use the same tensor, so it
/// gets both gradients and the optimizer sees it once. The LSTM starts every sequence from a
/// zero state (no state is carried between batches). Parameters in order (the module's own, then
/// its submodules'): embedding [V, d], output_bias [V], lstm.weight_ih [4d, d], lstm.weight_hh
/// [4d, d], lstm.bias_ih [4d], lstm.bias_hh [4d] (gates i, f, g, o as in torch.nn.LSTM),
/// norm.weight [d], norm.bias [d].
/// Full sharding runs it as one unit (sharding_units() empty).
/// Initialization: E uniform in ±0.1, the LSTM uniform in ±1/√d (torch.nn.LSTM's), LayerNorm
/// ones and zeros, output bias zeros.

#include <torch/nn/modules/normalization.h>

#include <cstdint>
#include <memory>

#include "examples/models.h"

namespace shampoo::examples {

struct LanguageModelOptions {
  int64_t vocabulary_size = 10000;
  /// d: the embedding width and the LSTM's hidden size (--lm-dim).
  int64_t dim = 128;
  /// Dropout after the embedding and before the output projection (--lm-dropout), in training.
  double dropout = 0.0;
};

class LstmLanguageModelImpl : public TrainerModel {
 public:
  explicit LstmLanguageModelImpl(const LanguageModelOptions& options);
  /// tokens: int64 [N, T] in [0, V) → logits [N, T, V].
  torch::Tensor forward(const torch::Tensor& tokens) override;
  Objective objective() const override { return Objective::kNextToken; }

  const torch::Tensor& embedding() const { return embedding_; }
  const LanguageModelOptions& options() const { return options_; }

 private:
  LanguageModelOptions options_;
  torch::Tensor embedding_;
  torch::Tensor weight_ih_;
  torch::Tensor weight_hh_;
  torch::Tensor bias_ih_;
  torch::Tensor bias_hh_;
  torch::nn::LayerNorm norm_{nullptr};
  torch::Tensor output_bias_;
};
TORCH_MODULE(LstmLanguageModel);

}  // namespace shampoo::examples
