/// How far float32 rounding carries Shampoo apart from itself: the same training run taken once
/// with each batch's gradient in one backward pass and once accumulated over micro-batches (the
/// gradient differs in its last bits only, as between world sizes, whose all-reduce sums in
/// another order). Reports, per optimizer setting, the relative distance of the final parameters
/// ‖a − b‖ / ‖b‖ (over all parameters and the largest over single parameters) and the final
/// training loss. AdamW is the yardstick: its runs stay within ~1e-6.
///
/// The model is a small next-token model: a [vocab, dim] embedding of a window of tokens drawn
/// from a Zipf distribution (rare tokens' rows see few gradients: a rank-deficient factor along
/// the vocabulary dim, as in a language model), a tanh hidden layer, an output layer.
///
///   bench_rounding [--steps 400] [--micro-batches 4] [--batch 64] [--vocab 1000] [--dim 64]
///                  [--relative-epsilons 0,1e-6,...] [--threads 1] [--json PATH] [--label TEXT]

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <shampoo/shampoo.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "benchmarks/bench_support.h"

namespace {

using shampoo::bench::Json;

struct Setup {
  int64_t steps = 400;
  int64_t micro_batches = 4;
  int64_t batch = 64;
  int64_t vocab = 1000;
  int64_t dim = 64;
  int64_t window = 8;
  int64_t hidden = 256;
};

struct NextTokenModel : torch::nn::Module {
  NextTokenModel(const Setup& s)
      : embedding(register_module("embedding", torch::nn::Embedding(s.vocab, s.dim))),
        hidden(register_module("hidden", torch::nn::Linear(s.window * s.dim, s.hidden))),
        output(register_module("output", torch::nn::Linear(s.hidden, s.vocab))) {}
  at::Tensor forward(const at::Tensor& tokens) {
    auto x = embedding->forward(tokens).flatten(1);
    return output->forward(at::tanh(hidden->forward(x)));
  }
  torch::nn::Embedding embedding;
  torch::nn::Linear hidden, output;
};

/// Batches of (window, next token): tokens Zipf-distributed, the target a fixed function of the
/// window plus noise, so that there is something to learn.
struct Data {
  std::vector<at::Tensor> inputs, targets;
};
Data make_data(const Setup& s) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const auto weights = at::arange(1, s.vocab + 1, at::kDouble).reciprocal();
  Data d;
  for (int64_t i = 0; i < s.steps; ++i) {
    auto tokens = at::multinomial(weights, s.batch * s.window, /*replacement=*/true, gen)
                      .view({s.batch, s.window});
    auto noise = at::randint(0, 3, {s.batch}, gen, at::kLong);
    d.inputs.push_back(tokens);
    d.targets.push_back((tokens.select(1, 0) * 7 + tokens.select(1, 1) + noise).remainder(s.vocab));
  }
  return d;
}

using OptimizerFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;

/// Trains a fresh model (seeded) and returns its parameters and last loss.
std::pair<std::vector<at::Tensor>, double> train(const Setup& s, const Data& data,
                                                 const OptimizerFactory& make, int64_t micro) {
  torch::manual_seed(1);
  auto model = std::make_shared<NextTokenModel>(s);
  auto optimizer = make(model->parameters());
  double loss_value = 0.0;
  for (int64_t i = 0; i < s.steps; ++i) {
    optimizer->zero_grad();
    const auto inputs = data.inputs[i].chunk(micro);
    const auto targets = data.targets[i].chunk(micro);
    double total = 0.0;
    for (int64_t m = 0; m < micro; ++m) {
      auto loss = at::cross_entropy_loss(model->forward(inputs[m]), targets[m]) /
                  static_cast<double>(micro);
      loss.backward();
      total += loss.item<double>();
    }
    optimizer->step();
    loss_value = total;
  }
  std::vector<at::Tensor> params;
  for (const auto& p : model->parameters()) params.push_back(p.detach().clone());
  return {params, loss_value};
}

struct Distance {
  double overall = 0.0;
  double largest = 0.0;
};
Distance distance(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double diff_sq = 0.0, ref_sq = 0.0;
  Distance d;
  for (size_t i = 0; i < a.size(); ++i) {
    const double diff = (a[i] - b[i]).to(at::kDouble).norm().item<double>();
    const double ref = b[i].to(at::kDouble).norm().item<double>();
    diff_sq += diff * diff;
    ref_sq += ref * ref;
    d.largest = std::max(d.largest, diff / std::max(ref, 1e-30));
  }
  d.overall = std::sqrt(diff_sq / std::max(ref_sq, 1e-300));
  return d;
}

/// The comma-separated items of a list flag.
std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(item);
  return out;
}

std::vector<double> parse_doubles(const std::string& text) {
  std::vector<double> out;
  for (const auto& item : split_list(text)) out.push_back(std::stod(item));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Setup s;
  std::string epsilons_text = "0,1e-7,1e-6,1e-5,1e-4";
  std::string dtypes_text = "fp64,fp32";
  int64_t threads = 1;
  std::string json_path, label;
  shampoo::bench::Flags flags("bench_rounding",
                              "Shampoo against itself: one batch against micro-batches");
  flags.add("steps", s.steps, "training steps")
      .add("micro-batches", s.micro_batches, "micro-batches of the accumulated run")
      .add("batch", s.batch, "examples per step")
      .add("vocab", s.vocab, "vocabulary (rows of the embedding and the output)")
      .add("dim", s.dim, "embedding dim")
      .add("relative-epsilons", epsilons_text, "ShampooOptions::relative_epsilon values to run")
      .add("factor-dtypes", dtypes_text,
           "ShampooOptions::factor_matrix_dtype values to run with each (fp64 the default, fp32 "
           "the reference's)")
      .add("threads", threads, "intra-op threads");
  shampoo::bench::add_output_flags(flags, json_path, label);
  shampoo::bench::parse_flags_or_exit(flags, "bench_rounding", argc, argv);
  at::set_num_threads(static_cast<int>(threads));
  const auto data = make_data(s);

  struct Case {
    std::string name;
    OptimizerFactory make;
  };
  std::vector<Case> cases;
  cases.push_back({"adamw lr 1e-3", [](std::vector<at::Tensor> p) {
                     return std::make_unique<torch::optim::AdamW>(
                         std::move(p), torch::optim::AdamWOptions(1e-3).weight_decay(0.0));
                   }});
  const auto epsilons = parse_doubles(epsilons_text);
  for (const auto& dtype_name : split_list(dtypes_text)) {
    if (dtype_name != "fp64" && dtype_name != "fp32") {
      fmt::print(stderr, "bench_rounding: --factor-dtypes: got {}, expected fp64 or fp32\n",
                 dtype_name);
      return 2;
    }
    const auto dtype = dtype_name == "fp64" ? at::kDouble : at::kFloat;
    for (const double rel : epsilons) {
      cases.push_back(
          {fmt::format("shampoo {} factors, relative_epsilon {:g}", dtype_name, rel),
           [rel, dtype](std::vector<at::Tensor> p) {
             return std::make_unique<shampoo::DistributedShampoo>(
                 std::move(p),
                 shampoo::ShampooOptions(1e-3).relative_epsilon(rel).factor_matrix_dtype(dtype));
           }});
    }
  }
  Json results = Json::array();
  fmt::print("{} steps, batch {} against {} micro-batches; vocab {}, dim {}\n", s.steps, s.batch,
             s.micro_batches, s.vocab, s.dim);
  for (const auto& c : cases) {
    const auto [one, loss_one] = train(s, data, c.make, 1);
    const auto [many, loss_many] = train(s, data, c.make, s.micro_batches);
    const auto d = distance(many, one);
    fmt::print("{:<45} distance {:.3e} (largest parameter {:.3e}); loss {:.4f} / {:.4f}\n", c.name,
               d.overall, d.largest, loss_one, loss_many);
    results.push_back({{"case", c.name},
                       {"distance", d.overall},
                       {"largest_param_distance", d.largest},
                       {"loss_one_batch", loss_one},
                       {"loss_micro_batches", loss_many}});
  }
  if (!json_path.empty()) {
    Json out{{"label", label}, {"steps", s.steps}, {"results", results}};
    if (!shampoo::bench::write_json(json_path, out, "bench_rounding")) return 1;
  }
  return 0;
}
