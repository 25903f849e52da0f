// The host's share of a launch-bound GPU step, counted on the CPU (issue 46): the ATen operators
// one DistributedShampoo step calls (each one a dispatch and, on CUDA, at least one launch), by
// name, for `make compare`'s Fashion-MNIST ConvNet with the trainer's defaults. On the H200 that
// step is bound by the host (bench_cuda section 4: 0.6 ms of device work in a 3.4 ms iteration),
// so the count is what to cut. The chain reads column blocks of a matrix where they lie only on
// the CPU; by default this benchmark takes CUDA's route (--cuda-route 1: blocks copied in and
// updates staged; set_chain_views(false)), so the counts match the GPU's.
//
// With --device cuda (on a GPU machine) it counts the CUDA path itself, whose preconditioner
// contractions are batched where the CPU's go block by block.
//
//   bench_step_ops [--device cpu|cuda] [--steps N] [--batch B] [--frequency F] [--cuda-route 0|1]
//                  [--top K]
//                  [--profile 1]   (the same steps under the Kineto profiler: host time and
//                                   calls of the outermost ATen ops by shampoo:: scope)
#include <fmt/format.h>
#include <shampoo/shampoo.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "benchmarks/bench_support.h"
#include "benchmarks/kernel_profile.h"
#include "benchmarks/op_observer.h"
#include "models.h"
#include "trainer_config.h"
#include "trainer_optimizer.h"
#include "update/elementwise_chain.h"

int main(int argc, char** argv) {
  int64_t steps = 5, batch = 32, frequency = 50, cuda_route = 1, top = 25, profile = 0;
  std::string device_name = "cpu";
  shampoo::bench::Flags flags("bench_step_ops",
                              "ATen operators per DistributedShampoo step, by name");
  flags.add_choice("device", device_name, {"cpu", "cuda"}, "where the model and the step run")
      .add("steps", steps, "plain steps counted (after the first root computation)", 1)
      .add("batch", batch, "images per batch (the count does not depend on it)", 1)
      .add("frequency", frequency, "precondition_frequency", 2)
      .add("cuda-route", cuda_route, "1: column blocks copied in as on CUDA; 0: the CPU's views", 0)
      .add("top", top, "operators listed", 1)
      .add("profile", profile, "1: also profile the steps (ATen ops by shampoo:: scope)", 0);
  shampoo::bench::parse_flags_or_exit(flags, "bench_step_ops", argc, argv);
  steps = std::min(steps, frequency - 1);
  const at::Device device(device_name == "cuda" ? at::kCUDA : at::kCPU);
  if (device.is_cuda() && !torch::cuda::is_available()) {
    fmt::print("bench_step_ops: no CUDA device, nothing counted\n");
    return 0;
  }

  torch::manual_seed(0);
  shampoo::examples::ConvNet model(1, 10, 28, 28);
  model->to(device);
  shampoo::examples::TrainerConfig config;
  config.dataset = shampoo::examples::DatasetKind::kFashionMnist;
  config.precondition_frequency = frequency;
  const auto plans = shampoo::examples::plan_param_groups(model->named_parameters(), config);
  auto optimizer = shampoo::examples::make_optimizer(config, plans, nullptr);
  auto& shampoo = dynamic_cast<shampoo::DistributedShampoo&>(*optimizer);
  const auto inputs = at::randn({batch, 1, 28, 28}, at::TensorOptions().device(device));
  const auto labels = at::randint(10, {batch}, at::TensorOptions().device(device).dtype(at::kLong));
  shampoo::detail::set_chain_views(cuda_route == 0);
  auto backward = [&] {
    optimizer->zero_grad();
    torch::nn::functional::cross_entropy(model->forward(inputs), labels).backward();
  };
  // Past the first root computation, so that the counted steps are plain ones.
  for (int i = 0; i < 2; ++i) {
    backward();
    optimizer->step();
  }
  int64_t top_level = 0, all = 0;
  std::map<std::string, int64_t> by_name;
  const auto roots_before = shampoo.stats().amortized_computations;
  for (int64_t i = 0; i < steps; ++i) {
    backward();
    shampoo::bench::OpObserver observer(/*by_name=*/true);
    optimizer->step();
    top_level += observer.top_level();
    all += observer.all();
    for (const auto& [name, n] : observer.top_level_by_name()) by_name[name] += n;
  }
  const bool plain = shampoo.stats().amortized_computations == roots_before;
  const double n = static_cast<double>(steps);
  fmt::print(
      "bench_step_ops: make compare's Fashion-MNIST ConvNet, the trainer's Shampoo, {} {} "
      "step(s), on {}{}\n",
      steps, plain ? "plain" : "(one computed roots)", device_name,
      device.is_cuda()  ? ""
      : cuda_route != 0 ? " (column blocks copied in, as on CUDA)"
                        : " (column blocks read where they lie)");
  fmt::print("top-level ATen operators per step: {:.1f} (all, nested included: {:.1f})\n",
             static_cast<double>(top_level) / n, static_cast<double>(all) / n);
  std::vector<std::pair<std::string, int64_t>> sorted(by_name.begin(), by_name.end());
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return a.second > b.second; });
  fmt::print("\n| operator | calls per step |\n|---|---:|\n");
  for (size_t i = 0; i < sorted.size() && i < static_cast<size_t>(top); ++i) {
    fmt::print("| {} | {:.1f} |\n", sorted[i].first, static_cast<double>(sorted[i].second) / n);
  }
  if (profile != 0) {
    const auto result = shampoo::bench::profile_kernels(device, [&] {
      for (int64_t i = 0; i < steps; ++i) {
        backward();
        optimizer->step();
      }
    });
    fmt::print("\nKineto profile of {} iteration(s) (backward included):\n", steps);
    shampoo::bench::print_kernel_profile(result, steps, static_cast<int>(top));
  }
  shampoo::detail::set_chain_views(true);
  return 0;
}
