// The C++ side of "Python ≡ C++" (tests/python/test_optimizer.py, PythonMatchesCpp): the run that
// the Python test repeats through distributed_shampoo_cpp, written with the C++ API.
//   - model Linear(6, 16) -> tanh -> Linear(16, 3), float32, every weight and bias filled from
//     sin(0.37 * i) * 0.5 in row-major order, parameter after parameter (no random generator);
//   - step t = 1..12: x[i, j] = sin(0.1 * (6 * i + j) + 0.01 * t) over a 32 x 6 batch,
//     y[i, k] = cos(0.05 * (3 * i + k) + 0.02 * t), loss = mean((model(x) - y)^2);
//   - DistributedShampoo, the reference's defaults with lr 0.01, Adam grafting (0.999, 1e-8),
//     roots every 4 steps from step 4; two param groups (weights lr 0.01, biases lr 0.02).
// Writes the final parameters, in model order, with torch::pickle_save to argv[1].
#include <shampoo/shampoo.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/activation.h>
#include <torch/serialize.h>

#include <cmath>
#include <fstream>
#include <iostream>

namespace {

void fill_parameters(torch::nn::Sequential& model) {
  torch::NoGradGuard no_grad;
  int64_t i = 0;
  for (auto& p : model->parameters()) {
    auto flat = p.view({-1});
    for (int64_t k = 0; k < flat.numel(); ++k, ++i) {
      flat[k] = static_cast<float>(std::sin(0.37 * static_cast<double>(i)) * 0.5);
    }
  }
}

at::Tensor batch(int64_t rows, int64_t cols, double scale, double shift, bool cosine) {
  auto out = at::empty({rows, cols}, at::kFloat);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const double v = scale * static_cast<double>(cols * r + c) + shift;
      out[r][c] = static_cast<float>(cosine ? std::cos(v) : std::sin(v));
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: cpp_trajectory <output file>\n";
    return 2;
  }
  torch::nn::Sequential model(torch::nn::Linear(6, 16), torch::nn::Tanh(), torch::nn::Linear(16, 3));
  fill_parameters(model);
  const auto params = model->parameters();
  auto options = shampoo::ShampooOptions::reference_defaults(0.01)
                     .grafting(shampoo::AdamGraftingConfig{0.999, 1e-8})
                     .precondition_frequency(4)
                     .start_preconditioning_step(4);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{params[0], params[2]},
                      std::make_unique<shampoo::ShampooOptions>(options));
  groups.emplace_back(std::vector<at::Tensor>{params[1], params[3]},
                      std::make_unique<shampoo::ShampooOptions>(options.lr(0.02)));
  shampoo::DistributedShampoo optimizer(std::move(groups), options);
  for (int t = 1; t <= 12; ++t) {
    optimizer.zero_grad();
    const auto x = batch(32, 6, 0.1, 0.01 * t, false);
    const auto y = batch(32, 3, 0.05, 0.02 * t, true);
    (model->forward(x) - y).pow(2).mean().backward();
    optimizer.step();
  }
  std::vector<at::Tensor> detached;
  for (const auto& p : params) detached.push_back(p.detach().clone());
  const auto bytes = torch::pickle_save(c10::IValue(c10::List<at::Tensor>(detached)));
  std::ofstream(argv[1], std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return 0;
}
