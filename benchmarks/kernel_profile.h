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

/// Idle device time between two consecutive device events: how long, and the kernels around it.
struct DeviceGap {
  double us = 0.0;
  std::string before;
  std::string after;
  uint64_t start_ns = 0;             ///< when the device went idle
  uint64_t after_correlation = 0;    ///< the launch of `after` (its host runtime call)
  std::string host_at_start;         ///< innermost host scope (ours, else an op) at start_ns
  std::string host_launching_after;  ///< innermost host scope around the launch of `after`
};

struct KernelProfile {
  std::vector<KernelTime> kernels;      ///< largest total time first
  std::vector<KernelTime> host_calls;   ///< CUDA runtime and driver calls on the host, by name
  std::vector<DeviceGap> largest_gaps;  ///< the longest idle spans, longest first
  double idle_ms = 0.0;            ///< idle device time between the first and last device events
  int64_t gaps_over_10us = 0;      ///< idle spans longer than 10 µs
  double gaps_over_10us_ms = 0.0;  ///< their sum
  /// Host synchronizations (cudaStreamSynchronize, cudaDeviceSynchronize) by where they happen:
  /// the innermost shampoo:: scope and the innermost ATen op around them.
  std::vector<KernelTime> sync_sites;
  /// Host time inside each shampoo:: scope (inclusive of the scopes within it).
  std::vector<KernelTime> host_scopes;
  /// Host time of the outermost ATen ops (inside no other op), by the innermost shampoo:: scope
  /// around them and the op's name.
  std::vector<KernelTime> host_ops;
  double device_ms = 0.0;  ///< sum of every device event's duration
  int64_t launches = 0;    ///< device events (kernels, copies, sets)
  double wall_ms = 0.0;    ///< host time of the region, synchronized at both ends
  std::string error;       ///< why nothing was recorded ("" = recorded)
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
