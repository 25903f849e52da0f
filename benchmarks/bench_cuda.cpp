// GPU benchmarks (issue "GPU path"): on a CUDA device, in one run,
//   1a. eigendecompositions of stacks of SPD blocks (256×16, 64×32, 16×256 and the transformer
//      workload's 78×1024): our path (batched for blocks up to 32, divide and conquer over
//      concurrent lanes above) vs torch::linalg_eigh, and every cuSOLVER method side by side;
//   1b. inverse roots of the same stacks: stacked_inverse_root vs linalg_eigh + bmm;
//   2. the elementwise chain of a virtual group: the multi-tensor kernels (one launch per pass)
//      vs the same math as ATen ops block by block;
//   3. a training step (forward + backward + optimizer) of the CIFAR-10 ConvNet with
//      DistributedShampoo (precondition_frequency 100) vs torch::optim::Adam (issue 13: target ≤ 3×).
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
#include "models.h"
#include "preconditioners/cuda/cuda_eigh.h"
#include "preconditioners/cuda/eigh_lanes.h"
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

}  // namespace

int main(int argc, char** argv) {
  int64_t repetitions = 5, batch = 128, frequency = 100;
  std::string json_path, label, sections = "all";
  shampoo::bench::Flags flags("bench_cuda", "GPU roots, elementwise chain and training step");
  flags.add("repetitions", repetitions, "repetitions (medians are over them)", 1)
      .add("batch", batch, "batch size of the training step", 1)
      .add("frequency", frequency, "Shampoo's precondition_frequency in the training step", 1)
      .add_choice("sections", sections, {"all", "roots", "eigh"},
                  "all sections, only the roots (1a eigendecompositions, 1b inverse roots), or "
                  "only 1a");
  shampoo::bench::add_output_flags(flags, json_path, label);
  shampoo::bench::parse_flags_or_exit(flags, "bench_cuda", argc, argv);
  if (!torch::cuda::is_available()) {
    fmt::print("bench_cuda: no CUDA device, nothing measured\n");
    return 0;
  }
  const double load_before = shampoo::bench::load_average();
  Json json{{"benchmark", "bench_cuda"}, {"label", label}, {"machine", nullptr}};
  torch::manual_seed(0);
  json["eigh"] = eigh_section(repetitions);
  if (sections != "eigh") json["roots"] = roots_section(repetitions);
  if (sections == "all") {
    json["chain"] = chain_section(repetitions);
    json["training"] = training_section(repetitions, batch, frequency);
  }
  json["machine"] = shampoo::bench::machine_json(load_before, shampoo::bench::load_average());
  if (json_path.empty()) return 0;
  return shampoo::bench::write_json(json_path, json, "bench_cuda") ? 0 : 1;
}
