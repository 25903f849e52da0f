// GPU benchmarks (issue "GPU path"): on a CUDA device, in one run,
//   1. inverse roots of every block of a stack: our cuSOLVER path (batched Jacobi for blocks up
//      to 32, divide and conquer above) vs the same one block at a time vs torch::linalg_eigh;
//   2. the elementwise chain of a virtual group: the multi-tensor kernels (one launch per pass)
//      vs the same math as ATen ops block by block;
//   3. a training step (forward + backward + optimizer) of the CIFAR-10 ConvNet with
//      DistributedShampoo (precondition_frequency 100) vs torch::optim::Adam (target ≤ 1.10×).
// Without a CUDA device it says so and measures nothing.
#include <shampoo/shampoo.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>

#include <cmath>
#include <fstream>
#include <iomanip>
#include <iostream>

#include "benchmarks/bench_support.h"
#include "models.h"
#include "update/elementwise_chain.h"
#include "preconditioners/matrix_functions.h"

namespace {

using shampoo::bench::Clock;
using shampoo::bench::elapsed_ms;
using shampoo::bench::median;

void synchronize() { torch::cuda::synchronize(); }

/// Median over repetitions of fn's wall time, synchronized before and after.
double time_ms(int64_t repetitions, const std::function<void()>& fn) {
  fn();  // warm-up (handles, workspaces, kernels)
  std::vector<double> samples;
  for (int64_t r = 0; r < repetitions; ++r) {
    synchronize();
    const auto begin = Clock::now();
    fn();
    synchronize();
    samples.push_back(elapsed_ms(begin, Clock::now()));
  }
  return median(samples);
}

at::Tensor spd_stack(int64_t n, int64_t d) {
  const auto g = at::randn({n, d, 2 * d}, at::TensorOptions().device(at::kCUDA));
  return at::bmm(g, g.transpose(1, 2)) / (2.0 * static_cast<double>(d));
}

std::string roots_section(int64_t repetitions) {
  std::cout << "\n1. inverse roots (exponent 1/4) of a stack, median ms\n";
  std::cout << std::setw(14) << "stack" << std::setw(14) << "ours batched" << std::setw(16)
            << "ours per block" << std::setw(18) << "linalg_eigh+bmm" << std::setw(12) << "per/ours"
            << std::setw(12) << "torch/ours"
            << "\n";
  std::ostringstream json;
  json << "[";
  bool first = true;
  for (const auto& [n, d] :
       std::vector<std::pair<int64_t, int64_t>>{{256, 16}, {64, 32}, {16, 256}, {4, 1024}}) {
    const auto a = spd_stack(n, d);
    const std::vector<double> eps(n, 1e-6), exps(n, 0.25);
    const double ours =
        time_ms(repetitions, [&] { shampoo::detail::stacked_inverse_root(a, eps, exps, true); });
    const double per_block = time_ms(repetitions, [&] {
      for (int64_t i = 0; i < n; ++i) {
        shampoo::detail::stacked_inverse_root(a.narrow(0, i, 1), {1e-6}, {0.25}, true);
      }
    });
    const double torch_eigh = time_ms(repetitions, [&] {
      const auto regularized = a + 1e-6 * at::eye(d, a.options());
      auto [values, vectors] = at::linalg_eigh(regularized);
      at::bmm(vectors * values.pow(-0.25).unsqueeze(1), vectors.transpose(1, 2));
    });
    std::cout << std::setw(14) << (std::to_string(n) + "x" + std::to_string(d)) << std::setw(14)
              << ours << std::setw(16) << per_block << std::setw(18) << torch_eigh << std::setw(11)
              << per_block / ours << "x" << std::setw(11) << torch_eigh / ours << "x\n";
    json << (first ? "" : ",") << "{\"n\":" << n << ",\"d\":" << d << ",\"ours_ms\":" << ours
         << ",\"per_block_ms\":" << per_block << ",\"torch_ms\":" << torch_eigh << "}";
    first = false;
  }
  json << "]";
  return json.str();
}

std::string chain_section(int64_t repetitions) {
  std::cout << "\n2. elementwise chain of a virtual group (Adam grafting, momentum, weight "
               "decay), median ms\n";
  std::ostringstream json;
  json << "[";
  bool first = true;
  for (const auto& [count, numel] :
       std::vector<std::pair<int64_t, int64_t>>{{256, 16384}, {64, 262144}, {1024, 1024}}) {
    const auto options = at::TensorOptions().device(at::kCUDA);
    std::vector<at::Tensor> grad, param, filter, diagonal, momentum, pre, filtered;
    for (int64_t i = 0; i < count; ++i) {
      grad.push_back(at::randn({numel}, options));
      param.push_back(at::randn({numel}, options));
      filter.push_back(at::zeros({numel}, options));
      diagonal.push_back(at::zeros({numel}, options));
      momentum.push_back(at::zeros({numel}, options));
      pre.push_back(at::randn({numel}, options));
      filtered.push_back(at::empty({numel}, options));
    }
    shampoo::kernels::ChainScalars s;
    s.beta1 = 0.9;
    s.beta3 = 0.9;
    s.filter_bias_correction = 0.5;
    s.diagonal_beta2 = 0.999;
    s.diagonal_weight = 0.001;
    s.diagonal_bias_correction = 0.01;
    s.diagonal_epsilon = 1e-8;
    s.direction_mode = static_cast<int32_t>(shampoo::kernels::DirectionMode::kGraftNorm);
    s.decoupled_weight_decay = 1e-4;
    s.momentum = 0.9;
    s.lr = 1e-3;
    std::vector<shampoo::detail::ChainBlockTensors> chain(count);
    for (int64_t i = 0; i < count; ++i) {
      auto& c = chain[i];
      c.grad = grad[i];
      c.param = param[i];
      c.param_out = param[i];
      c.gradient_out = filtered[i];
      c.filtered_out = filtered[i];
      c.filter_state = filter[i];
      c.diagonal_state = diagonal[i];
      c.momentum_state = momentum[i];
      c.preconditioned = pre[i];
      c.scalars = s;
    }
    const double fused = time_ms(repetitions, [&] {
      shampoo::detail::run_chain_pre(chain);
      shampoo::detail::run_chain_norms(chain);
      shampoo::detail::run_chain_post(chain);
    });
    // The same math with ATen ops, block by block.
    const double per_block = time_ms(repetitions, [&] {
      for (int64_t i = 0; i < count; ++i) {
        auto g = grad[i];
        diagonal[i].mul_(0.999).addcmul_(g, g, 0.001);
        filter[i].lerp_(g, 0.1);
        const auto gbar = filter[i] / 0.5;
        const auto graft = gbar / ((diagonal[i] / 0.01).sqrt() + 1e-8);
        const auto ratio = graft.norm() / (pre[i].norm() + 1e-16);
        auto p = pre[i] * ratio + 1e-4 * param[i];
        momentum[i].mul_(0.9).add_(p);
        param[i].add_(momentum[i], -1e-3);
      }
    });
    std::cout << "  " << count << " blocks x " << numel << ": multi-tensor " << fused
              << " ms, per-block ATen " << per_block << " ms (" << per_block / fused << "x)\n";
    json << (first ? "" : ",") << "{\"blocks\":" << count << ",\"numel\":" << numel
         << ",\"fused_ms\":" << fused << ",\"per_block_ms\":" << per_block << "}";
    first = false;
  }
  json << "]";
  return json.str();
}

std::string training_section(int64_t repetitions, int64_t batch, int64_t frequency) {
  std::cout << "\n3. CIFAR-10 ConvNet training step (forward + backward + optimizer), batch "
            << batch << ", Shampoo precondition_frequency " << frequency << "\n";
  const auto inputs = at::randn({batch, 3, 32, 32}, at::TensorOptions().device(at::kCUDA));
  const auto labels =
      at::randint(10, {batch}, at::TensorOptions().device(at::kCUDA).dtype(at::kLong));
  auto make_model = [] {
    torch::manual_seed(0);
    shampoo::examples::ConvNet model(3, 10, 32, 32);
    model->to(torch::kCUDA);
    return model;
  };
  auto adam_model = make_model();
  auto shampoo_model = make_model();
  torch::optim::Adam adam(adam_model->parameters(), torch::optim::AdamOptions(1e-3));
  shampoo::DistributedShampoo shampoo_opt(
      shampoo_model->parameters(), shampoo::bench::shampoo_options(frequency, /*start=*/frequency));
  auto train_step = [&](auto& model, torch::optim::Optimizer& opt) {
    opt.zero_grad();
    torch::nn::functional::cross_entropy(model->forward(inputs), labels).backward();
    opt.step();
  };
  // Bring Shampoo past its first root computation, then time windows of `frequency` steps
  // (each holding one root computation) against the same number of Adam steps.
  for (int64_t i = 0; i < frequency; ++i) {
    train_step(shampoo_model, shampoo_opt);
    train_step(adam_model, adam);
  }
  std::vector<double> adam_ms, shampoo_ms, ratios;
  for (int64_t r = 0; r < repetitions; ++r) {
    synchronize();
    auto begin = Clock::now();
    for (int64_t i = 0; i < frequency; ++i) train_step(adam_model, adam);
    synchronize();
    const double a = elapsed_ms(begin, Clock::now()) / static_cast<double>(frequency);
    begin = Clock::now();
    for (int64_t i = 0; i < frequency; ++i) train_step(shampoo_model, shampoo_opt);
    synchronize();
    const double s = elapsed_ms(begin, Clock::now()) / static_cast<double>(frequency);
    adam_ms.push_back(a);
    shampoo_ms.push_back(s);
    ratios.push_back(s / a);
  }
  const double ratio = median(ratios);
  std::cout << "  Adam " << median(adam_ms) << " ms/step, Shampoo " << median(shampoo_ms)
            << " ms/step (amortized over " << frequency << " steps), ratio " << ratio
            << "x (target <= 1.10x: " << (ratio <= 1.10 ? "met" : "missed") << ")\n";
  std::ostringstream json;
  json << "{\"adam_ms\":" << median(adam_ms) << ",\"shampoo_ms\":" << median(shampoo_ms)
       << ",\"ratio\":" << ratio << ",\"batch\":" << batch << ",\"frequency\":" << frequency << "}";
  return json.str();
}

}  // namespace

int main(int argc, char** argv) {
  int64_t repetitions = 5, batch = 128, frequency = 100;
  std::string json_path, label;
  shampoo::bench::Flags flags("bench_cuda", "GPU roots, elementwise chain and training step");
  flags.add_int("--repetitions", &repetitions, 1);
  flags.add_int("--batch", &batch, 1);
  flags.add_int("--frequency", &frequency, 1);
  flags.add_string("--json", &json_path);
  flags.add_string("--label", &label);
  flags.parse(argc, argv);
  if (!torch::cuda::is_available()) {
    std::cout << "bench_cuda: no CUDA device, nothing measured\n";
    return 0;
  }
  const double load_before = shampoo::bench::load_average();
  const auto roots = roots_section(repetitions);
  const auto chain = chain_section(repetitions);
  const auto training = training_section(repetitions, batch, frequency);
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << "{\"benchmark\":\"bench_cuda\",\"label\":" << shampoo::bench::json_string(label)
        << ",\"machine\":"
        << shampoo::bench::machine_json(load_before, shampoo::bench::load_average())
        << ",\"roots\":" << roots << ",\"chain\":" << chain << ",\"training\":" << training
        << "}\n";
  }
  return 0;
}
