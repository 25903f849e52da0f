#pragma once
/// Device time by kernel of a region of code, from LibTorch's Kineto profiler (CUPTI underneath):
/// where a GPU step's time goes when no Nsight Systems is at hand (the device machine has none).
/// bench_transformer --profile-steps uses it for the plain step (issue 30).

#include <ATen/Device.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace shampoo::bench {

/// One kernel (or memcpy / memset) name: how often it ran in the region and its device time.
struct KernelTime {
  std::string name;
  std::string kind;  ///< kernel_kind(name)
  int64_t calls = 0;
  double ms = 0.0;
};

struct KernelProfile {
  std::vector<KernelTime> kernels;  ///< largest total time first
  double device_ms = 0.0;           ///< sum of every device event's duration
  int64_t launches = 0;             ///< device events (kernels, copies, sets)
  double wall_ms = 0.0;             ///< host time of the region, synchronized at both ends
  std::string error;                ///< why nothing was recorded ("" = recorded)
};

/// A coarse class of a kernel name: "GEMM" (cuBLAS/CUTLASS matrix products), "elementwise"
/// (ATen's elementwise loops), "foreach" (multi-tensor apply), "reduction", "copy" (memcpy and
/// ATen's copy kernels), "memset", "eigh" (cuSOLVER), or "other".
std::string kernel_kind(const std::string& name);

/// Runs `region` once under the profiler (CPU and CUDA activities), synchronizing `device` before
/// and after, and sums the durations of the device events by name. On a CPU device, or where the
/// profiler cannot record device events, `kernels` stays empty and `error` says why.
KernelProfile profile_kernels(const at::Device& device, const std::function<void()>& region);

/// Prints a profile as a table per `steps` (the region's repetitions): by kind, then the `top`
/// largest kernels.
void print_kernel_profile(const KernelProfile& profile, int64_t steps, int top);

}  // namespace shampoo::bench
