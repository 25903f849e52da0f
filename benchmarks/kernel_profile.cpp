#include "benchmarks/kernel_profile.h"

#include <fmt/format.h>
#include <kineto/ActivityType.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>

#include <algorithm>
#include <exception>
#include <map>
#include <set>
#include <utility>

#include "benchmarks/bench_support.h"

namespace shampoo::bench {

namespace {

bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

/// Device-side activities: kernels, copies and sets. GPU user annotations span kernels already
/// counted, so they are left out.
bool is_device_work(uint8_t activity) {
  using libkineto::ActivityType;
  return activity == static_cast<uint8_t>(ActivityType::CONCURRENT_KERNEL) ||
         activity == static_cast<uint8_t>(ActivityType::GPU_MEMCPY) ||
         activity == static_cast<uint8_t>(ActivityType::GPU_MEMSET);
}

void synchronize(const at::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize();
}

}  // namespace

std::string kernel_kind(const std::string& name) {
  std::string lower = name;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (contains(lower, "memcpy")) return "copy";
  if (contains(lower, "memset")) return "memset";
  if (contains(lower, "gemm") || contains(lower, "cutlass") || contains(lower, "xmma") ||
      contains(lower, "gemv")) {
    return "GEMM";
  }
  if (contains(lower, "syevd") || contains(lower, "syevj") || contains(lower, "sytrd") ||
      contains(lower, "ormtr") || contains(lower, "stedc") || contains(lower, "potrf")) {
    return "eigh";
  }
  if (contains(lower, "multi_tensor_apply")) return "foreach";
  if (contains(lower, "reduce_kernel") || contains(lower, "reduction")) return "reduction";
  if (contains(lower, "copy")) return "copy";
  if (contains(lower, "elementwise")) return "elementwise";
  return "other";
}

KernelProfile profile_kernels(const at::Device& device, const std::function<void()>& region) {
  KernelProfile profile;
  namespace prof = torch::profiler::impl;
  const prof::ProfilerConfig config(prof::ProfilerState::KINETO);
  std::set<prof::ActivityType> activities{prof::ActivityType::CPU};
  if (device.is_cuda()) activities.insert(prof::ActivityType::CUDA);
  std::unique_ptr<torch::autograd::profiler::ProfilerResult> result;
  try {
    torch::autograd::profiler::prepareProfiler(config, activities);
    synchronize(device);
    torch::autograd::profiler::enableProfiler(config, activities);
    const auto begin = Clock::now();
    region();
    synchronize(device);
    profile.wall_ms = elapsed_ms(begin, Clock::now());
    result = torch::autograd::profiler::disableProfiler();
  } catch (const std::exception& e) {
    profile.error = std::string("the profiler failed: ") + e.what();
    return profile;
  }
  std::map<std::string, KernelTime> by_name;
  for (const auto& event : result->events()) {
    if (event.deviceType() == c10::DeviceType::CPU || !is_device_work(event.activityType())) {
      continue;
    }
    auto& k = by_name[event.name()];
    k.calls += 1;
    k.ms += static_cast<double>(event.durationNs()) / 1e6;
  }
  for (auto& [name, k] : by_name) {
    k.name = name;
    k.kind = kernel_kind(name);
    profile.device_ms += k.ms;
    profile.launches += k.calls;
    profile.kernels.push_back(std::move(k));
  }
  std::sort(profile.kernels.begin(), profile.kernels.end(),
            [](const KernelTime& a, const KernelTime& b) { return a.ms > b.ms; });
  if (profile.kernels.empty()) {
    profile.error = device.is_cuda() ? "the profiler recorded no device events (no CUPTI?)"
                                     : "a CPU device has no device kernels";
  }
  return profile;
}

void print_kernel_profile(const KernelProfile& profile, int64_t steps, int top) {
  const double n = static_cast<double>(std::max<int64_t>(steps, 1));
  fmt::print(
      "    wall {:.2f} ms per step under the profiler; device busy {:.2f} ms ({:.0f}%), "
      "{:.0f} device launches per step\n",
      profile.wall_ms / n, profile.device_ms / n,
      profile.wall_ms > 0 ? 100.0 * profile.device_ms / profile.wall_ms : 0.0,
      static_cast<double>(profile.launches) / n);
  if (!profile.error.empty()) {
    fmt::print("    ({})\n", profile.error);
    return;
  }
  std::map<std::string, std::pair<int64_t, double>> kinds;
  for (const auto& k : profile.kernels) {
    kinds[k.kind].first += k.calls;
    kinds[k.kind].second += k.ms;
  }
  std::vector<std::pair<std::string, std::pair<int64_t, double>>> sorted(kinds.begin(),
                                                                         kinds.end());
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return a.second.second > b.second.second; });
  fmt::print(
      "\n    | kind | launches per step | ms per step | share of device time |\n"
      "    |---|---:|---:|---:|\n");
  for (const auto& [kind, v] : sorted) {
    fmt::print("    | {} | {:.0f} | {:.3f} | {:.1f}% |\n", kind, v.first / n, v.second / n,
               100.0 * v.second / profile.device_ms);
  }
  fmt::print(
      "\n    | kernel (first 110 characters) | kind | launches per step | ms per step | "
      "share |\n    |---|---|---:|---:|---:|\n");
  const auto shown = std::min<size_t>(profile.kernels.size(), static_cast<size_t>(top));
  for (size_t i = 0; i < shown; ++i) {
    const auto& k = profile.kernels[i];
    fmt::print("    | `{}` | {} | {:.1f} | {:.3f} | {:.1f}% |\n", k.name.substr(0, 110), k.kind,
               k.calls / n, k.ms / n, 100.0 * k.ms / profile.device_ms);
  }
  std::fflush(stdout);
}

}  // namespace shampoo::bench
