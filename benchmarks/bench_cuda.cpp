// GPU benchmarks (issue "GPU path"): on a CUDA device, in one run,
//   1a. eigendecompositions of stacks of SPD blocks (256×16, 64×32, 16×256 and the transformer
//      workload's 78×1024): our path (batched for blocks up to 32, divide and conquer over
//      concurrent lanes above) vs torch::linalg_eigh, and every cuSOLVER method side by side;
//   1b. inverse roots of the same stacks: stacked_inverse_root vs linalg_eigh + bmm;
//   2. the elementwise chain of a virtual group: the multi-tensor kernels (one launch per pass)
//      vs the same math as ATen ops block by block;
//   3. a training step (forward + backward + optimizer) of the CIFAR-10 ConvNet with
//      DistributedShampoo (precondition_frequency 100) vs torch::optim::Adam (issue 13: target ≤
//      3×);
//   4. `make compare`'s Fashion-MNIST ConvNet with the trainer's own optimizers (its defaults,
//      Shampoo at lr 0.001 and Adam at 0.009, batch 256): the plain step and the root step timed
//      apart, the amortized step against Adam's, for each factor dtype, and the Kineto profile of
//      plain steps and of one root step (issue 46: where the step's time goes).
// Without a CUDA device it says so and measures nothing.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <fmt/format.h>
#include <shampoo/shampoo.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "benchmarks/bench_support.h"
#include "benchmarks/kernel_profile.h"
#include "models.h"
#include "preconditioners/cuda/cuda_eigh.h"
#include "preconditioners/cuda/eigh_lanes.h"
#include "preconditioners/matrix_functions.h"
#include "trainer_config.h"
#include "trainer_optimizer.h"
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

using shampoo::detail::CudaEighMethod;

/// The stacks of the root sections: small blocks (batched routines), a mid size, and the
/// transformer workload's 78 factors of 1024×1024 (issue 13).
const std::vector<std::pair<int64_t, int64_t>> kRootStacks{
    {256, 16}, {64, 32}, {16, 256}, {78, 1024}};

/// Median ms of cuda_eigh with `method` (its result read back, as a caller would); -1 where the
/// method does not apply.
double eigh_ms(int64_t repetitions, const at::Tensor& a, CudaEighMethod method) {
  if (method == CudaEighMethod::kBatchedJacobi && a.size(1) > 32) return -1.0;
  return time_ms(repetitions, [&] { shampoo::detail::cuda_eigh(a, method); });
}

/// Peak GPU memory allocated while fn runs, above what was allocated before it, in MiB.
double peak_extra_mib(const std::function<void()>& fn) {
  namespace allocator = c10::cuda::CUDACachingAllocator;
  constexpr auto kAll = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  const auto device = c10::cuda::current_device();
  synchronize();
  const int64_t before = allocator::getDeviceStats(device).allocated_bytes[kAll].current;
  allocator::resetPeakStats(device);
  fn();
  synchronize();
  const int64_t peak = allocator::getDeviceStats(device).allocated_bytes[kAll].peak;
  return static_cast<double>(peak - before) / (1024.0 * 1024.0);
}

std::string cell(double ms) { return ms < 0 ? std::string("-") : fmt::format("{:.4g}", ms); }

/// The cuda_eigh methods side by side in section 1a: column title, JSON key, method.
struct MethodColumn {
  const char* title;
  const char* key;
  CudaEighMethod method;
};
const std::vector<MethodColumn> kMethodColumns{
    {"1-by-1", "sequential_ms", CudaEighMethod::kSequential},
    {"threads", "concurrent_threads_ms", CudaEighMethod::kConcurrent},
    {"streams", "concurrent_streams_ms", CudaEighMethod::kConcurrentStreams},
    {"xsyevB", "xsyev_batched_ms", CudaEighMethod::kBatched},
    {"chunks", "xsyev_batched_chunks_ms", CudaEighMethod::kBatchedChunks},
    {"syevjB", "syevj_batched_ms", CudaEighMethod::kBatchedJacobi}};

/// One row of section 1a: every way of decomposing the stack, and what the checks saw.
Json eigh_row(int64_t repetitions, int64_t n, int64_t d) {
  const auto a = spd_stack(n, d);
  const double ours = time_ms(repetitions, [&] { shampoo::detail::decompose_cuda(a, true); });
  const double torch_eigh = time_ms(repetitions, [&] { at::linalg_eigh(a); });
  Json json{{"n", n}, {"d", d}, {"ours_ms", ours}, {"torch_eigh_ms", torch_eigh}};
  std::string cells;
  for (const auto& column : kMethodColumns) {
    const double ms = eigh_ms(repetitions, a, column.method);
    json[column.key] = ms;
    cells += fmt::format("{:>9}", cell(ms));
  }
  std::string unconverged = "-";
  if (d <= 32) {
    const auto r = shampoo::detail::cuda_eigh(a, CudaEighMethod::kBatchedJacobi);
    const auto count = std::count(r.converged.begin(), r.converged.end(), false);
    json["syevj_batched_unconverged"] = count;
    unconverged = std::to_string(count);
  }
  const auto retried = shampoo::detail::decompose_cuda(a, true).retried;
  json["ours_retried_in_float64"] = retried;
  fmt::print("{:>10}{:>9}{:>9}{:>8.3g}x{}{:>7}{:>7}\n", fmt::format("{}x{}", n, d), cell(ours),
             cell(torch_eigh), torch_eigh / ours, cells, unconverged, retried);
  return json;
}

/// Peak memory of the ways that matter for the optimizer's memory target (issue 13).
Json eigh_memory_row(int64_t n, int64_t d) {
  const auto a = spd_stack(n, d);
  using shampoo::detail::decompose_cuda;
  Json json{{"n", n}, {"d", d}, {"input_mib", static_cast<double>(a.nbytes()) / (1024.0 * 1024.0)}};
  std::string cells;
  const std::vector<std::pair<const char*, std::function<void()>>> ways{
      {"ours_peak_extra_mib", [&] { decompose_cuda(a, true); }},
      {"torch_peak_extra_mib", [&] { at::linalg_eigh(a); }},
      {"concurrent_threads_peak_extra_mib",
       [&] { decompose_cuda(a, true, CudaEighMethod::kConcurrent); }},
      {"xsyev_batched_peak_extra_mib", [&] { decompose_cuda(a, true, CudaEighMethod::kBatched); }},
      {"xsyev_batched_chunks_peak_extra_mib",
       [&] { decompose_cuda(a, true, CudaEighMethod::kBatchedChunks); }}};
  for (const auto& [key, fn] : ways) {
    const double mib = peak_extra_mib(fn);
    json[key] = mib;
    cells += fmt::format("{:>9.4g}", mib);
  }
  fmt::print("{:>10}{}\n", fmt::format("{}x{}", n, d), cells);
  return json;
}

Json eigh_section(int64_t repetitions) {
  std::string titles;
  for (const auto& column : kMethodColumns) titles += fmt::format("{:>9}", column.title);
  fmt::print(
      "\n1a. eigendecompositions of a stack of SPD matrices (float32), median ms\n"
      "    ours: decompose_cuda as the optimizer runs it (auto method, checks, float64 retry);\n"
      "    torch: at::linalg_eigh; then cuda_eigh by method: syevd one by one, over {} lanes fed\n"
      "    by threads / by the calling thread, XsyevBatched on the whole stack / in chunks of\n"
      "    {}, syevjBatched; unconv: matrices syevjBatched reported not converged; retry:\n"
      "    matrices ours retried in float64\n{:>10}{:>9}{:>9}{:>9}{}{:>7}{:>7}\n",
      shampoo::detail::kMaxEighLanes, shampoo::detail::kBatchedChunk, "stack", "ours", "torch",
      "torch/us", titles, "unconv", "retry");
  Json json{{"time", Json::array()}, {"memory", Json::array()}};
  for (const auto& [n, d] : kRootStacks) json["time"].push_back(eigh_row(repetitions, n, d));
  fmt::print(
      "    peak GPU memory allocated above the input during one decompose_cuda, MiB\n"
      "{:>10}{:>9}{:>9}{:>9}{:>9}{:>9}\n",
      "stack", "ours", "torch", "threads", "xsyevB", "chunks");
  for (const auto& [n, d] : kRootStacks) json["memory"].push_back(eigh_memory_row(n, d));
  return json;
}

Json roots_section(int64_t repetitions) {
  fmt::print(
      "\n1b. inverse roots (exponent 1/4) of a stack, median ms: ours (stacked_inverse_root) vs "
      "linalg_eigh + bmm\n{:>10}{:>10}{:>10}{:>12}\n",
      "stack", "ours", "torch", "torch/ours");
  Json json = Json::array();
  for (const auto& [n, d] : kRootStacks) {
    const auto a = spd_stack(n, d);
    const std::vector<double> eps(n, 1e-6), exps(n, 0.25);
    const double ours =
        time_ms(repetitions, [&] { shampoo::detail::stacked_inverse_root(a, eps, exps, true); });
    const double torch_eigh = time_ms(repetitions, [&] {
      const auto regularized = a + 1e-6 * at::eye(d, a.options());
      auto [values, vectors] = at::linalg_eigh(regularized);
      at::bmm(vectors * values.pow(-0.25).unsqueeze(1), vectors.transpose(1, 2));
    });
    fmt::print("{:>10}{:>10.4g}{:>10.4g}{:>11.3g}x\n", fmt::format("{}x{}", n, d), ours, torch_eigh,
               torch_eigh / ours);
    json.push_back({{"n", n}, {"d", d}, {"ours_ms", ours}, {"torch_ms", torch_eigh}});
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
      "{:.6g}x (target <= 3x: {})\n",
      median(adam_ms), median(shampoo_ms), frequency, ratio, ratio <= 3.0 ? "met" : "missed");
  return Json{{"adam_ms", median(adam_ms)},
              {"shampoo_ms", median(shampoo_ms)},
              {"ratio", ratio},
              {"batch", batch},
              {"frequency", frequency}};
}

/// Section 4: the compare's Fashion-MNIST ConvNet ([64, 1, 3, 3] convolution, [10, 50176] linear
/// layer and its bias) trained by the trainer's optimizers on random batches of `batch` images.
struct CompareStep {
  shampoo::examples::ConvNet model{nullptr};
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  at::Tensor inputs, labels;

  void run() {
    optimizer->zero_grad();
    torch::nn::functional::cross_entropy(model->forward(inputs), labels).backward();
    optimizer->step();
  }
};

CompareStep compare_step(shampoo::examples::OptimizerKind kind, double lr, c10::ScalarType factors,
                         int64_t batch, int64_t frequency) {
  torch::manual_seed(0);
  CompareStep s;
  s.model = shampoo::examples::ConvNet(1, 10, 28, 28);
  s.model->to(torch::kCUDA);
  shampoo::examples::TrainerConfig config;
  config.dataset = shampoo::examples::DatasetKind::kFashionMnist;
  config.optimizer = kind;
  config.lr = lr;
  config.factor_dtype = factors;
  config.precondition_frequency = frequency;
  const auto plans = shampoo::examples::plan_param_groups(s.model->named_parameters(), config);
  s.optimizer = shampoo::examples::make_optimizer(config, plans, nullptr);
  s.inputs = at::randn({batch, 1, 28, 28}, at::TensorOptions().device(at::kCUDA));
  s.labels = at::randint(10, {batch}, at::TensorOptions().device(at::kCUDA).dtype(at::kLong));
  return s;
}

/// Wall time of one training iteration, synchronized before and after, in ms.
double iteration_ms(CompareStep& s) {
  synchronize();
  const auto begin = Clock::now();
  s.run();
  synchronize();
  return elapsed_ms(begin, Clock::now());
}

Json compare_convnet_section(int64_t repetitions, int64_t batch, int64_t frequency,
                             int64_t profile_steps) {
  using shampoo::examples::OptimizerKind;
  fmt::print(
      "\n4. make compare's Fashion-MNIST ConvNet (trainer defaults, batch {}, "
      "precondition_frequency {}): Adam lr 0.009 against Shampoo lr 0.001\n",
      batch, frequency);
  auto adam = compare_step(OptimizerKind::kAdam, 0.009, at::kDouble, batch, frequency);
  for (int64_t i = 0; i < 20; ++i) adam.run();
  std::vector<double> adam_samples;
  for (int64_t i = 0; i < 10 * repetitions; ++i) adam_samples.push_back(iteration_ms(adam));
  const double adam_ms = median(adam_samples);
  fmt::print("  Adam: {:.4g} ms per iteration (median of {})\n", adam_ms, adam_samples.size());
  Json json{{"batch", batch}, {"frequency", frequency}, {"adam_ms", adam_ms}};
  for (const auto factors : {at::kDouble, at::kFloat}) {
    const std::string dtype = factors == at::kDouble ? "fp64" : "fp32";
    auto shampoo = compare_step(OptimizerKind::kShampoo, 0.001, factors, batch, frequency);
    auto* opt = dynamic_cast<shampoo::DistributedShampoo*>(shampoo.optimizer.get());
    TORCH_CHECK(opt != nullptr, "bench_cuda: the trainer's Shampoo is not a DistributedShampoo");
    // Past the first root computation (the default start is the first step).
    for (int64_t i = 0; i < frequency + 2; ++i) shampoo.run();
    std::vector<double> plain, root;
    for (int64_t i = 0; i < repetitions * frequency; ++i) {
      const auto before = opt->stats().amortized_computations;
      const double ms = iteration_ms(shampoo);
      (opt->stats().amortized_computations == before ? plain : root).push_back(ms);
    }
    const double plain_ms = median(plain);
    const double root_ms = root.empty() ? 0.0 : median(root);
    const double amortized =
        (plain_ms * static_cast<double>(frequency - 1) + root_ms) / static_cast<double>(frequency);
    fmt::print(
        "  Shampoo, {} factors: plain iteration {:.4g} ms ({:.3g}x Adam), root iteration {:.4g} "
        "ms ({} of them), amortized {:.4g} ms ({:.3g}x Adam)\n",
        dtype, plain_ms, plain_ms / adam_ms, root_ms, root.size(), amortized, amortized / adam_ms);
    json[dtype] = Json{{"plain_ms", plain_ms},
                       {"root_ms", root_ms},
                       {"amortized_ms", amortized},
                       {"ratio", amortized / adam_ms}};
    if (profile_steps <= 0) continue;
    // Profile plain steps only: stop before the next root step.
    while (true) {
      const auto before = opt->stats().amortized_computations;
      shampoo.run();
      if (opt->stats().amortized_computations != before) break;
    }
    const int64_t steps = std::min(profile_steps, frequency - 1);
    const auto profile = shampoo::bench::profile_kernels(at::Device(at::kCUDA), [&] {
      for (int64_t i = 0; i < steps; ++i) shampoo.run();
    });
    fmt::print("  Shampoo, {} factors: kernel profile of {} plain iteration(s):\n", dtype, steps);
    shampoo::bench::print_kernel_profile(profile, steps, 12);
    while (true) {
      const auto before = opt->stats().amortized_computations;
      auto root_profile =
          shampoo::bench::profile_kernels(at::Device(at::kCUDA), [&] { shampoo.run(); });
      if (opt->stats().amortized_computations != before) {
        fmt::print("  Shampoo, {} factors: kernel profile of one root iteration:\n", dtype);
        shampoo::bench::print_kernel_profile(root_profile, 1, 12);
        break;
      }
    }
  }
  if (profile_steps > 0) {
    const auto profile = shampoo::bench::profile_kernels(at::Device(at::kCUDA), [&] {
      for (int64_t i = 0; i < profile_steps; ++i) adam.run();
    });
    fmt::print("  Adam: kernel profile of {} iteration(s):\n", profile_steps);
    shampoo::bench::print_kernel_profile(profile, profile_steps, 8);
  }
  return json;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t repetitions = 5, batch = 128, frequency = 100, compare_batch = 256,
          compare_frequency = 50, profile_steps = 5;
  std::string json_path, label, sections = "all";
  shampoo::bench::Flags flags("bench_cuda", "GPU roots, elementwise chain and training step");
  flags.add("repetitions", repetitions, "repetitions (medians are over them)", 1)
      .add("batch", batch, "batch size of the training step", 1)
      .add("frequency", frequency, "Shampoo's precondition_frequency in the training step", 1)
      .add("compare-batch", compare_batch, "batch size of section 4 (make compare's)", 1)
      .add("compare-frequency", compare_frequency,
           "Shampoo's precondition_frequency in section 4 (the trainer's default)", 2)
      .add("profile-steps", profile_steps,
           "section 4: Kineto profiles of this many plain iterations and of one root iteration "
           "(0 = none)",
           0)
      .add_choice("sections", sections, {"all", "roots", "eigh", "training"},
                  "all sections, only the roots (1a eigendecompositions, 1b inverse roots), "
                  "only 1a, or only the training steps (3 and 4)");
  shampoo::bench::add_output_flags(flags, json_path, label);
  shampoo::bench::parse_flags_or_exit(flags, "bench_cuda", argc, argv);
  if (!torch::cuda::is_available()) {
    fmt::print("bench_cuda: no CUDA device, nothing measured\n");
    return 0;
  }
  const double load_before = shampoo::bench::load_average();
  Json json{{"benchmark", "bench_cuda"}, {"label", label}, {"machine", nullptr}};
  torch::manual_seed(0);
  if (sections != "training") json["eigh"] = eigh_section(repetitions);
  if (sections == "all" || sections == "roots") json["roots"] = roots_section(repetitions);
  if (sections == "all") json["chain"] = chain_section(repetitions);
  if (sections == "all" || sections == "training") {
    json["training"] = training_section(repetitions, batch, frequency);
    json["compare_convnet"] =
        compare_convnet_section(repetitions, compare_batch, compare_frequency, profile_steps);
  }
  json["machine"] = shampoo::bench::machine_json(load_before, shampoo::bench::load_average());
  if (json_path.empty()) return 0;
  return shampoo::bench::write_json(json_path, json, "bench_cuda") ? 0 : 1;
}
