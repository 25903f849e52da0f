// GPU benchmarks (issue "GPU path"): on a CUDA device, in one run,
//   1. inverse roots of every block of a stack: our cuSOLVER path (batched Jacobi for blocks up
//      to 32, divide and conquer above) vs the same one block at a time vs torch::linalg_eigh;
//   2. the elementwise chain of a virtual group: the multi-tensor kernels (one launch per pass)
//      vs the same math as ATen ops block by block;
//   3. a training step (forward + backward + optimizer) of the CIFAR-10 ConvNet with
//      DistributedShampoo (precondition_frequency 100) vs torch::optim::Adam (target ≤ 1.10×).
// Without a CUDA device it says so and measures nothing.
#include <fmt/format.h>
#include <shampoo/shampoo.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "benchmarks/bench_support.h"
#include "models.h"
#include "preconditioners/matrix_functions.h"
#include "update/elementwise_chain.h"

namespace {

using shampoo::bench::Clock;
using shampoo::bench::elapsed_ms;
using shampoo::bench::Json;
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

Json roots_section(int64_t repetitions) {
  fmt::print(
      "\n1. inverse roots (exponent 1/4) of a stack, median ms\n{:>14}{:>14}{:>16}{:>18}{:>12}"
      "{:>12}\n",
      "stack", "ours batched", "ours per block", "linalg_eigh+bmm", "per/ours", "torch/ours");
  Json json = Json::array();
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
    fmt::print("{:>14}{:>14.6g}{:>16.6g}{:>18.6g}{:>11.6g}x{:>11.6g}x\n",
               fmt::format("{}x{}", n, d), ours, per_block, torch_eigh, per_block / ours,
               torch_eigh / ours);
    json.push_back({{"n", n},
                    {"d", d},
                    {"ours_ms", ours},
                    {"per_block_ms", per_block},
                    {"torch_ms", torch_eigh}});
  }
  return json;
}

/// The chain's math with ATen ops, block by block.
void chain_per_block(shampoo::bench::ChainTensors& t) {
  for (size_t i = 0; i < t.grad.size(); ++i) {
    auto g = t.grad[i];
    t.diagonal[i].mul_(0.999).addcmul_(g, g, 0.001);
    t.filter[i].lerp_(g, 0.1);
    const auto gbar = t.filter[i] / 0.5;
    const auto graft = gbar / ((t.diagonal[i] / 0.01).sqrt() + 1e-8);
    const auto ratio = graft.norm() / (t.pre[i].norm() + 1e-16);
    auto p = t.pre[i] * ratio + 1e-4 * t.param[i];
    t.momentum[i].mul_(0.9).add_(p);
    t.param[i].add_(t.momentum[i], -1e-3);
  }
}

Json chain_section(int64_t repetitions) {
  fmt::print(
      "\n2. elementwise chain of a virtual group (Adam grafting, momentum, weight "
      "decay), median ms\n");
  Json json = Json::array();
  for (const auto& [count, numel] :
       std::vector<std::pair<int64_t, int64_t>>{{256, 16384}, {64, 262144}, {1024, 1024}}) {
    auto chain = shampoo::bench::make_chain(count, {numel}, at::TensorOptions().device(at::kCUDA));
    const double fused = time_ms(repetitions, [&] {
      shampoo::detail::run_chain_pre(chain.blocks);
      shampoo::detail::run_chain_norms(chain.blocks);
      shampoo::detail::run_chain_post(chain.blocks);
    });
    const double per_block = time_ms(repetitions, [&] { chain_per_block(chain); });
    fmt::print("  {} blocks x {}: multi-tensor {:.6g} ms, per-block ATen {:.6g} ms ({:.6g}x)\n",
               count, numel, fused, per_block, per_block / fused);
    json.push_back(
        {{"blocks", count}, {"numel", numel}, {"fused_ms", fused}, {"per_block_ms", per_block}});
  }
  return json;
}

Json training_section(int64_t repetitions, int64_t batch, int64_t frequency) {
  fmt::print(
      "\n3. CIFAR-10 ConvNet training step (forward + backward + optimizer), batch {}, "
      "Shampoo precondition_frequency {}\n",
      batch, frequency);
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
  fmt::print(
      "  Adam {:.6g} ms/step, Shampoo {:.6g} ms/step (amortized over {} steps), ratio "
      "{:.6g}x (target <= 1.10x: {})\n",
      median(adam_ms), median(shampoo_ms), frequency, ratio, ratio <= 1.10 ? "met" : "missed");
  return Json{{"adam_ms", median(adam_ms)},
              {"shampoo_ms", median(shampoo_ms)},
              {"ratio", ratio},
              {"batch", batch},
              {"frequency", frequency}};
}

}  // namespace

int main(int argc, char** argv) {
  int64_t repetitions = 5, batch = 128, frequency = 100;
  std::string json_path, label;
  shampoo::bench::Flags flags("bench_cuda", "GPU roots, elementwise chain and training step");
  flags.add("repetitions", repetitions, "repetitions (medians are over them)", 1)
      .add("batch", batch, "batch size of the training step", 1)
      .add("frequency", frequency, "Shampoo's precondition_frequency in the training step", 1);
  shampoo::bench::add_output_flags(flags, json_path, label);
  shampoo::bench::parse_flags_or_exit(flags, "bench_cuda", argc, argv);
  if (!torch::cuda::is_available()) {
    fmt::print("bench_cuda: no CUDA device, nothing measured\n");
    return 0;
  }
  const double load_before = shampoo::bench::load_average();
  Json json{{"benchmark", "bench_cuda"}, {"label", label}, {"machine", nullptr}};
  json["roots"] = roots_section(repetitions);
  json["chain"] = chain_section(repetitions);
  json["training"] = training_section(repetitions, batch, frequency);
  json["machine"] = shampoo::bench::machine_json(load_before, shampoo::bench::load_average());
  if (json_path.empty()) return 0;
  return shampoo::bench::write_json(json_path, json, "bench_cuda") ? 0 : 1;
}
