#include "benchmarks/kernel_profile.h"

#include <fmt/format.h>
#include <kineto/ActivityType.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>

#include <algorithm>
#include <exception>
#include <map>
#include <set>
#include <tuple>
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

bool is_host_runtime_call(uint8_t activity) {
  using libkineto::ActivityType;
  return activity == static_cast<uint8_t>(ActivityType::CUDA_RUNTIME) ||
         activity == static_cast<uint8_t>(ActivityType::CUDA_DRIVER);
}

std::vector<KernelTime> sorted_by_time(std::map<std::string, KernelTime>& by_name) {
  std::vector<KernelTime> out;
  for (auto& [name, k] : by_name) {
    k.name = name;
    k.kind = kernel_kind(name);
    out.push_back(std::move(k));
  }
  std::sort(out.begin(), out.end(),
            [](const KernelTime& a, const KernelTime& b) { return a.ms > b.ms; });
  return out;
}

/// A device event: its span, name and the correlation id of the host call that launched it.
struct DeviceSpan {
  uint64_t start;
  uint64_t end;
  std::string name;
  uint64_t correlation;
  bool operator<(const DeviceSpan& o) const { return start < o.start; }
};

/// A host-side span: a CPU op, a user scope (RECORD_USER_SCOPE) or a CUDA runtime call.
struct HostSpan {
  uint64_t start;
  uint64_t end;
  uint64_t thread;
  std::string name;
};

/// The innermost span of `scopes` around [start, end] on `thread` ("" when none), preferring our
/// own shampoo:: scopes when `ours` and ATen's ops otherwise.
std::string innermost(const std::vector<HostSpan>& scopes, uint64_t start, uint64_t end,
                      uint64_t thread, bool ours) {
  const HostSpan* best = nullptr;
  for (const auto& s : scopes) {
    if (s.thread != thread || s.start > start || s.end < end) continue;
    if ((s.name.rfind("shampoo::", 0) == 0) != ours) continue;
    if (best == nullptr || s.end - s.start < best->end - best->start) best = &s;
  }
  return best == nullptr ? std::string(ours ? "(outside shampoo)" : "") : best->name;
}

/// Idle spans between consecutive device events (sorted by start; overlapping events merge).
void find_gaps(std::vector<DeviceSpan> spans, KernelProfile& profile) {
  std::sort(spans.begin(), spans.end());
  uint64_t busy_until = 0;
  std::string last;
  for (const auto& span : spans) {
    if (busy_until != 0 && span.start > busy_until) {
      const double us = static_cast<double>(span.start - busy_until) / 1e3;
      profile.idle_ms += us / 1e3;
      if (us > 10.0) {
        profile.gaps_over_10us += 1;
        profile.gaps_over_10us_ms += us / 1e3;
      }
      DeviceGap gap;
      gap.us = us;
      gap.before = last;
      gap.after = span.name;
      gap.start_ns = busy_until;
      gap.after_correlation = span.correlation;
      profile.largest_gaps.push_back(std::move(gap));
    }
    if (span.end >= busy_until) {
      busy_until = span.end;
      last = span.name;
    }
  }
  std::sort(profile.largest_gaps.begin(), profile.largest_gaps.end(),
            [](const DeviceGap& a, const DeviceGap& b) { return a.us > b.us; });
  if (profile.largest_gaps.size() > 12) profile.largest_gaps.resize(12);
}

/// Names the host's activity around each large gap and each synchronization.
void attribute_to_host(const std::vector<HostSpan>& scopes, const std::vector<HostSpan>& calls,
                       const std::vector<uint64_t>& call_correlations, KernelProfile& profile) {
  std::map<std::string, KernelTime> sites;
  for (size_t i = 0; i < calls.size(); ++i) {
    const auto& c = calls[i];
    if (c.name != "cudaStreamSynchronize" && c.name != "cudaDeviceSynchronize") continue;
    const auto op = innermost(scopes, c.start, c.end, c.thread, /*ours=*/false);
    auto& site = sites[fmt::format("{} / {} / {}",
                                   innermost(scopes, c.start, c.end, c.thread, /*ours=*/true),
                                   op.empty() ? "-" : op, c.name)];
    site.calls += 1;
    site.ms += static_cast<double>(c.end - c.start) / 1e6;
  }
  profile.sync_sites = sorted_by_time(sites);
  std::map<std::string, KernelTime> by_scope;
  for (const auto& s : scopes) {
    if (s.name.rfind("shampoo::", 0) != 0) continue;
    auto& k = by_scope[s.name];
    k.calls += 1;
    k.ms += static_cast<double>(s.end - s.start) / 1e6;
  }
  profile.host_scopes = sorted_by_time(by_scope);
  for (auto& gap : profile.largest_gaps) {
    for (size_t i = 0; i < calls.size(); ++i) {
      if (call_correlations[i] != gap.after_correlation || gap.after_correlation == 0) continue;
      const auto& c = calls[i];
      gap.host_launching_after = innermost(scopes, c.start, c.end, c.thread, /*ours=*/true);
      gap.host_at_start = innermost(scopes, gap.start_ns, gap.start_ns, c.thread, /*ours=*/true);
      const auto op = innermost(scopes, gap.start_ns, gap.start_ns, c.thread, /*ours=*/false);
      if (!op.empty()) gap.host_at_start += " / " + op;
      break;
    }
  }
}

/// Host time of each outermost ATen op (one inside no other op on its thread), by the innermost
/// shampoo:: scope around it and the op's name: on the CPU, where each phase's time goes.
void attribute_outermost_ops(const std::vector<HostSpan>& scopes, KernelProfile& profile) {
  std::vector<const HostSpan*> ops;
  std::vector<HostSpan> ours;  // the few shampoo:: scopes, searched once per outermost op
  for (const auto& s : scopes) {
    if (s.name.rfind("shampoo::", 0) != 0) {
      ops.push_back(&s);
    } else {
      ours.push_back(s);
    }
  }
  std::sort(ops.begin(), ops.end(), [](const HostSpan* a, const HostSpan* b) {
    if (a->thread != b->thread) return a->thread < b->thread;
    if (a->start != b->start) return a->start < b->start;
    return a->end > b->end;  // the enclosing op first
  });
  std::map<std::string, KernelTime> by_site;
  uint64_t thread = 0;
  uint64_t covered_until = 0;
  for (const auto* op : ops) {
    if (op->thread == thread && op->start < covered_until) continue;  // inside an earlier op
    thread = op->thread;
    covered_until = op->end;
    auto& site = by_site[fmt::format(
        "{} / {}", innermost(ours, op->start, op->end, op->thread, /*ours=*/true), op->name)];
    site.calls += 1;
    site.ms += static_cast<double>(op->end - op->start) / 1e6;
  }
  profile.host_ops = sorted_by_time(by_site);
}

/// Sums the profiler's events into `profile`: device work by kernel name, host runtime calls by
/// name, idle spans and where the host was.
void summarize_events(const std::vector<torch::autograd::profiler::KinetoEvent>& events,
                      KernelProfile& profile) {
  std::map<std::string, KernelTime> by_name;
  std::map<std::string, KernelTime> host_by_name;
  std::vector<DeviceSpan> spans;
  std::vector<HostSpan> scopes;
  std::vector<HostSpan> calls;
  std::vector<uint64_t> call_correlations;
  const auto add = [](std::map<std::string, KernelTime>& to, const auto& event) {
    auto& k = to[event.name()];
    k.calls += 1;
    k.ms += static_cast<double>(event.durationNs()) / 1e6;
  };
  for (const auto& event : events) {
    const auto activity = event.activityType();
    if (is_host_runtime_call(activity)) {
      add(host_by_name, event);
      calls.push_back({event.startNs(), event.endNs(), event.startThreadId(), event.name()});
      call_correlations.push_back(event.correlationId());
    } else if (event.deviceType() == c10::DeviceType::CPU) {
      if (activity == static_cast<uint8_t>(libkineto::ActivityType::CPU_OP) ||
          activity == static_cast<uint8_t>(libkineto::ActivityType::USER_ANNOTATION)) {
        scopes.push_back({event.startNs(), event.endNs(), event.startThreadId(), event.name()});
      }
    } else if (is_device_work(activity)) {
      add(by_name, event);
      spans.push_back({event.startNs(), event.endNs(), event.name(), event.correlationId()});
    }
  }
  profile.kernels = sorted_by_time(by_name);
  for (const auto& k : profile.kernels) {
    profile.device_ms += k.ms;
    profile.launches += k.calls;
  }
  profile.host_calls = sorted_by_time(host_by_name);
  find_gaps(std::move(spans), profile);
  attribute_to_host(scopes, calls, call_correlations, profile);
  attribute_outermost_ops(scopes, profile);
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
  summarize_events(result->events(), profile);
  if (profile.kernels.empty()) {
    profile.error = device.is_cuda() ? "the profiler recorded no device events (no CUPTI?)"
                                     : "a CPU device has no device kernels";
  }
  return profile;
}

namespace {

/// Device time by kind, then the `top` largest kernels.
void print_device_time(const KernelProfile& profile, double n, int top) {
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
}

/// A table of name, calls per step and ms per step (at most `rows` rows).
void print_per_step(const char* header, const std::vector<KernelTime>& entries, double n,
                    size_t rows) {
  fmt::print("\n    | {} | calls per step | ms per step |\n    |---|---:|---:|\n", header);
  for (size_t i = 0; i < std::min(entries.size(), rows); ++i) {
    fmt::print("    | {} | {:.1f} | {:.3f} |\n", entries[i].name.substr(0, 80),
               entries[i].calls / n, entries[i].ms / n);
  }
}

/// The idle spans and the host's side: synchronizations, time per scope, runtime calls.
void print_host_side(const KernelProfile& profile, double n) {
  fmt::print(
      "\n    idle device time between the region's first and last device events: {:.3f} ms per "
      "step; {:.1f} spans over 10 us per step, {:.3f} ms per step\n",
      profile.idle_ms / n, profile.gaps_over_10us / n, profile.gaps_over_10us_ms / n);
  fmt::print(
      "\n    | longest idle spans (us) | after | before | host at its start | host launching "
      "'before' |\n    |---:|---|---|---|---|\n");
  for (const auto& g : profile.largest_gaps) {
    fmt::print("    | {:.1f} | `{}` | `{}` | {} | {} |\n", g.us, g.before.substr(0, 50),
               g.after.substr(0, 50), g.host_at_start, g.host_launching_after);
  }
  print_per_step("host synchronization (shampoo scope / ATen op / call)", profile.sync_sites, n,
                 profile.sync_sites.size());
  print_per_step("host time in shampoo scope (inclusive)", profile.host_scopes, n,
                 profile.host_scopes.size());
  print_per_step("host CUDA runtime call", profile.host_calls, n, 10);
}

}  // namespace

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
    // On the CPU the scopes are the step's phases, computation included.
    if (!profile.host_scopes.empty()) {
      print_per_step("host time in shampoo scope (inclusive)", profile.host_scopes, n,
                     profile.host_scopes.size());
      print_per_step("host time of outermost ATen ops (shampoo scope / op)", profile.host_ops, n,
                     static_cast<size_t>(top));
    }
    return;
  }
  print_device_time(profile, n, top);
  print_host_side(profile, n);
  std::fflush(stdout);
}

}  // namespace shampoo::bench
