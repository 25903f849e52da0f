/// Virtual parameter groups: step time of DistributedShampoo when the same parameters are split
/// into 1, 8, 64 or 256 param groups that differ only in their learning rate, merged into one
/// virtual group (the default) or kept apart (DistributedOptions().merge_param_groups(false)).
///
/// Model: 64 layers [Linear(128, 128), LayerNorm(128), ReLU]: 256 parameter tensors
/// (weight, bias, LayerNorm weight, LayerNorm bias per layer), 1,073,152 parameters. With N
/// groups, group g holds the 256/N consecutive tensors [g·256/N, (g+1)·256/N) and has
/// lr = 1e-3·(1 + g/N); every other option is the same.
///
/// Only `optimizer.step()` is timed; gradients come from a pool of real forward/backward passes,
/// copied into `.grad()` outside the timed region, the same sequence for every configuration.
/// The 8 configurations (N x merged/unmerged), each with its own copy of the parameters, step in
/// rounds: one step of each per round, the order rotated every round, so every ratio comes from
/// the same stretch of time. precondition_frequency F (100) with start_preconditioning_step S
/// (10): steps are untimed up to and including S (the first root computation); the timed rounds
/// then run steps S+1 ... S + R·W. Steps with a root computation (t = S, or t a multiple of F)
/// are excluded from the per-step medians and reported on their own; every other timed step is
/// a preconditioned step without root computation.
///
/// CPU time: each step's CPU time on this thread (CLOCK_THREAD_CPUTIME_ID) is recorded beside
/// its wall time, with the same medians and ratios: on a shared machine, the work itself.
///
/// Operator calls and allocations: after the timing, one more (preconditioned, root-free) step of
/// every configuration runs with an at::RecordFunction global callback (scope FUNCTION) that counts
/// ATen operator calls: top-level calls (made by the optimizer itself, not from inside another
/// operator) and all calls including nested ones; a tracking CPU allocator installed around
/// LibTorch's for that step only counts its tensor allocations and their bytes, and those of at
/// least 128 KiB (glibc's default mmap threshold) by allocating top-level operator.
///
///   bench_virtual_groups [--repetitions 5] [--window 20] [--frequency 100] [--start-step 10]
///                        [--threads 1] [--grad-pool 4] [--batch 64] [--json PATH] [--label TEXT]
///                        [--ops-detail] [--verbose]
/// --verbose prints every timed step with its CLOCK_MONOTONIC start and end, to attribute the
/// samples of `perf record -k mono` to configurations (perf script gives each sample's time).
/// Results and how to read them: benchmarks/RESULTS.md.

#include <ATen/Parallel.h>
#include <shampoo/shampoo.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "benchmarks/bench_support.h"
#include "benchmarks/op_observer.h"
#include "benchmarks/tracking_allocator.h"

namespace {

using namespace shampoo::bench;

constexpr int64_t kLayers = 64;
constexpr int64_t kWidth = 128;
constexpr int64_t kGroupCounts[] = {1, 8, 64, 256};
/// glibc's initial mmap threshold (M_MMAP_THRESHOLD, 128 KiB): larger blocks may be mapped fresh
/// (and page-faulted in) at every allocation.
constexpr int64_t kLargeAllocation = 128 * 1024;

struct Args {
  int64_t repetitions = 5;
  int64_t window = 20;  // rounds per repetition
  int64_t frequency = 100;
  int64_t start = 10;
  int64_t threads = 1;
  int64_t grad_pool = 4;
  int64_t batch = 64;
  bool ops_detail = false;  // print the top-level operator histogram of merged N=1 vs N=256
  bool verbose = false;     // print every timed step with its CLOCK_MONOTONIC start and end
  std::string json;
  std::string label;
};

// ---- configurations -----------------------------------------------------------------------------

struct Config {
  int64_t groups = 1;
  bool merged = true;
  std::string name;
  std::vector<at::Tensor> params;
  std::unique_ptr<shampoo::DistributedShampoo> optimizer;
  int64_t steps_taken = 0;
  std::vector<double> plain_ms;   // this repetition's root-free steps
  std::vector<double> plain_cpu;  // their CPU time (this thread)
  std::vector<double> root_ms;    // every timed step with a root computation
  // Per repetition: median of the root-free steps, wall and CPU time.
  std::vector<double> rep_median_ms;
  std::vector<double> rep_median_cpu;
  int64_t ops_top_level = 0;
  int64_t ops_all = 0;
  std::map<std::string, int64_t> ops_by_name;
  int64_t allocations = 0;                                    // tensor allocations of one step
  int64_t allocated_bytes = 0;                                // their bytes
  shampoo::bench::TrackingAllocator::ByOp large_allocations;  // >= kLargeAllocation, by op
};

Config make_config(const std::vector<at::Tensor>& init, int64_t groups, bool merged,
                   const Args& args) {
  Config c;
  c.groups = groups;
  c.merged = merged;
  c.name = std::string(merged ? "merged" : "unmerged") + " N=" + std::to_string(groups);
  c.params = clone_params(init);
  const auto options = shampoo_options(args.frequency, args.start);
  c.optimizer = std::make_unique<shampoo::DistributedShampoo>(
      lr_param_groups(c.params, groups, options), options,
      shampoo::DistributedOptions().merge_param_groups(merged));
  return c;
}

struct StepTime {
  double ms = 0;
  double cpu_ms = 0;
};

/// Copies gradient set (steps_taken mod pool) into .grad() (untimed), then times step(): wall
/// time and the CPU time of this thread.
StepTime timed_step(Config& c, const std::vector<std::vector<at::Tensor>>& pool) {
  set_gradients(c.params, pool[static_cast<size_t>(c.steps_taken) % pool.size()]);
  const double cpu_begin = thread_cpu_ms();
  const auto begin = Clock::now();
  c.optimizer->step();
  const auto end = Clock::now();
  const double cpu = thread_cpu_ms() - cpu_begin;
  ++c.steps_taken;
  return {elapsed_ms(begin, end), cpu};
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  Flags flags("bench_virtual_groups",
              "[--repetitions R] [--window W] [--frequency F] [--start-step S] [--threads T]\n"
              "       [--grad-pool K] [--batch B] [--json PATH] [--label TEXT] [--ops-detail]\n"
              "       [--verbose]");
  flags.add_int("--repetitions", &args.repetitions, 1);
  flags.add_int("--window", &args.window, 1);
  flags.add_int("--frequency", &args.frequency, 2);
  flags.add_int("--start-step", &args.start, 1);
  flags.add_int("--threads", &args.threads, 1);
  flags.add_int("--grad-pool", &args.grad_pool, 1);
  flags.add_int("--batch", &args.batch, 1);
  flags.add_string("--json", &args.json);
  flags.add_string("--label", &args.label);
  flags.add_bool("--ops-detail", &args.ops_detail);
  flags.add_bool("--verbose", &args.verbose);
  flags.parse(argc, argv);
  at::set_num_threads(static_cast<int>(args.threads));
  torch::manual_seed(0);

  auto model = make_layered_mlp(kLayers, kWidth);
  const auto init = model->parameters();
  const int64_t num_params = numel_of(init);
  const auto pool = make_gradient_pool(model, args.grad_pool, args.batch, kWidth, kWidth);
  const double load_before = load_average();

  std::vector<Config> configs;
  for (const int64_t n : kGroupCounts) {
    for (const bool merged : {true, false}) configs.push_back(make_config(init, n, merged, args));
  }
  std::cout << "bench_virtual_groups: " << layered_mlp_name(kLayers, kWidth) << " (" << num_params
            << " parameters, " << init.size() << " tensors), LibTorch " << TORCH_VERSION << ", "
            << at::get_num_threads() << " thread(s), CPU " << cpu_model() << "\n"
            << "  " << configs.size() << " configurations, repetitions " << args.repetitions
            << " x " << args.window << " rounds, precondition_frequency " << args.frequency
            << ", start_preconditioning_step " << args.start << "\n"
            << std::flush;

  // Warm-up: steps 1 ... S (the first root computation at S), untimed.
  const auto warm_begin = Clock::now();
  for (int64_t t = 1; t <= args.start; ++t) {
    for (auto& c : configs) timed_step(c, pool);
  }
  std::cout << "  warm-up " << std::fixed << std::setprecision(1)
            << elapsed_ms(warm_begin, Clock::now()) / 1000.0 << " s (" << args.start
            << " steps each)\n"
            << std::flush;

  const auto run_begin = Clock::now();
  int64_t round = 0;
  for (int64_t r = 0; r < args.repetitions; ++r) {
    for (auto& c : configs) {
      c.plain_ms.clear();
      c.plain_cpu.clear();
    }
    for (int64_t w = 0; w < args.window; ++w, ++round) {
      const auto n = static_cast<int64_t>(configs.size());
      for (int64_t k = 0; k < n; ++k) {
        auto& c = configs[static_cast<size_t>((k + round) % n)];
        const int64_t t = c.steps_taken + 1;
        const auto time = timed_step(c, pool);
        if (args.verbose) {
          // steady_clock is CLOCK_MONOTONIC, what `perf record -k mono` stamps samples with.
          const double end_s =
              std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
          std::cout << "    step " << c.name << " " << t << " start " << std::setprecision(6)
                    << end_s - time.ms / 1000.0 << " s, end " << end_s << " s, "
                    << std::setprecision(2) << time.ms << " ms\n";
        }
        if (is_root_step(t, args.start, args.frequency)) {
          c.root_ms.push_back(time.ms);
        } else {
          c.plain_ms.push_back(time.ms);
          c.plain_cpu.push_back(time.cpu_ms);
        }
      }
    }
    std::cout << "  repetition " << r + 1 << "/" << args.repetitions << " (ms):";
    for (auto& c : configs) {
      c.rep_median_ms.push_back(median(c.plain_ms));
      c.rep_median_cpu.push_back(median(c.plain_cpu));
      std::cout << " " << c.name << " " << std::setprecision(2) << c.rep_median_ms.back() << ";";
    }
    std::cout << "\n" << std::flush;
  }
  const double run_s = elapsed_ms(run_begin, Clock::now()) / 1000.0;
  const double load_after = load_average();

  // Operator calls of one root-free step of each configuration.
  while (is_root_step(configs.front().steps_taken + 1, args.start, args.frequency)) {
    for (auto& c : configs) timed_step(c, pool);
  }
  auto& tracker = TrackingAllocator::install();
  for (auto& c : configs) {
    const bool detail = c.merged && (c.groups == 1 || c.groups == 256);
    // Gradients copied before the counter starts: only step() is counted.
    set_gradients(c.params, pool[static_cast<size_t>(c.steps_taken) % pool.size()]);
    tracker.reset_counters(kLargeAllocation);
    OpObserver counter(detail);
    c.optimizer->step();
    ++c.steps_taken;
    c.ops_top_level = counter.top_level();
    c.ops_all = counter.all();
    c.ops_by_name = counter.top_level_by_name();
    c.allocations = tracker.allocations();
    c.allocated_bytes = tracker.allocated_bytes();
    c.large_allocations = tracker.large_allocations_by_op();
  }
  TrackingAllocator::uninstall();

  // Merged and unmerged of the same N saw the same gradients and options: same parameters.
  std::vector<std::string> identical;
  for (size_t i = 0; i + 1 < configs.size(); i += 2) {
    bool same = true;
    for (size_t p = 0; p < configs[i].params.size(); ++p) {
      same &= at::equal(configs[i].params[p], configs[i + 1].params[p]);
    }
    identical.push_back(same ? "yes" : "NO");
  }

  // Ratios: per repetition, config median / merged N=1 median; then the median over repetitions.
  const auto& base = configs.front();
  auto ratio_of = [&](const Config& c) {
    std::vector<double> ratios;
    for (size_t r = 0; r < c.rep_median_ms.size(); ++r) {
      ratios.push_back(c.rep_median_ms[r] / base.rep_median_ms[r]);
    }
    return median(ratios);
  };
  auto cpu_ratio_of = [&](const Config& c) {
    std::vector<double> ratios;
    for (size_t r = 0; r < c.rep_median_cpu.size(); ++r) {
      ratios.push_back(c.rep_median_cpu[r] / base.rep_median_cpu[r]);
    }
    return median(ratios);
  };

  std::cout << "\n"
            << std::left << std::setw(8) << "groups" << std::right << std::setw(12) << "merged ms"
            << std::setw(14) << "unmerged ms" << std::setw(12) << "merged/" << std::setw(12)
            << "unmerged/" << std::setw(10) << "cpu m/" << std::setw(10) << "cpu u/"
            << std::setw(10) << "virtual" << std::setw(16) << "top-level ops" << std::setw(18)
            << "all ops" << std::setw(11) << "identical"
            << "\n"
            << std::left << std::setw(8) << "" << std::right << std::setw(12) << "" << std::setw(14)
            << "" << std::setw(12) << "merged(1)" << std::setw(12) << "merged(1)" << std::setw(10)
            << "m(1)" << std::setw(10) << "m(1)" << std::setw(10) << "groups" << std::setw(16)
            << "merged/unm." << std::setw(18) << "merged/unm."
            << "\n"
            << std::string(133, '-') << "\n";
  for (size_t i = 0; i + 1 < configs.size(); i += 2) {
    const auto& m = configs[i];
    const auto& u = configs[i + 1];
    std::ostringstream vg, top, all;
    vg << m.optimizer->stats().virtual_groups << "/" << u.optimizer->stats().virtual_groups;
    top << m.ops_top_level << "/" << u.ops_top_level;
    all << m.ops_all << "/" << u.ops_all;
    std::cout << std::left << std::setw(8) << m.groups << std::right << std::fixed
              << std::setprecision(2) << std::setw(12) << median(m.rep_median_ms) << std::setw(14)
              << median(u.rep_median_ms) << std::setprecision(3) << std::setw(11) << ratio_of(m)
              << "x" << std::setw(11) << ratio_of(u) << "x" << std::setw(9) << cpu_ratio_of(m)
              << "x" << std::setw(9) << cpu_ratio_of(u) << "x" << std::setw(10) << vg.str()
              << std::setw(16) << top.str() << std::setw(18) << all.str() << std::setw(11)
              << identical[i / 2] << "\n";
  }
  std::cout << "\ntensor allocations of one root-free step (tracking allocator):\n"
            << std::left << std::setw(16) << "configuration" << std::right << std::setw(13)
            << "allocations" << std::setw(14) << "MiB" << std::setw(16) << ">=128KiB allocs"
            << std::setw(14) << ">=128KiB MiB"
            << "\n"
            << std::string(73, '-') << "\n";
  for (const auto& c : configs) {
    int64_t large_count = 0, large_bytes = 0;
    for (const auto& [op, entry] : c.large_allocations) {
      large_bytes += entry.first;
      large_count += entry.second;
    }
    std::cout << std::left << std::setw(16) << c.name << std::right << std::setw(13)
              << c.allocations << std::setw(14) << std::setprecision(2)
              << c.allocated_bytes / 1048576.0 << std::setw(16) << large_count << std::setw(14)
              << large_bytes / 1048576.0 << "\n";
  }
  const auto stats = base.optimizer->stats();
  std::cout << "(ms: median over repetitions of the median root-free step; ratios: median over "
               "repetitions of the same-repetition ratio; cpu m/m(1), cpu u/m(1): the same "
               "ratios of the steps' CPU time (this thread); ops: one root-free step)\n"
            << "target merged(256)/merged(1) <= 1.1: " << std::setprecision(3)
            << ratio_of(configs[6]) << "x -> " << (ratio_of(configs[6]) <= 1.1 ? "met" : "MISSED")
            << " (CPU time " << cpu_ratio_of(configs[6]) << "x)"
            << "\n"
            << "blocks " << stats.total_blocks << ", state bytes "
            << format_bytes(stats.state_bytes) << "\nroot-computation steps (ms, all timed ones):";
  for (const auto& c : configs) std::cout << " " << c.name << " " << json_array(c.root_ms) << ";";
  std::cout << "\n";
  print_timed_section(std::cout, run_s, load_before, load_after);

  if (args.ops_detail) {
    const auto& one = configs[0].ops_by_name;
    const auto& many = configs[6].ops_by_name;
    std::map<std::string, std::pair<int64_t, int64_t>> both;
    for (const auto& [name, n] : one) both[name].first = n;
    for (const auto& [name, n] : many) both[name].second = n;
    std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>> rows(both.begin(), both.end());
    std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) {
      return a.second.second - a.second.first > b.second.second - b.second.first;
    });
    std::cout << "\ntop-level operator calls of one step, merged N=1 vs merged N=256:\n";
    for (const auto& [name, counts] : rows) {
      std::cout << "  " << std::left << std::setw(40) << name << std::right << std::setw(8)
                << counts.first << std::setw(8) << counts.second << "\n";
    }
    for (const size_t i : {size_t{0}, size_t{7}}) {
      std::cout << "allocations >= 128 KiB of one step of " << configs[i].name
                << " by top-level operator (bytes, count):\n";
      for (const auto& [op, entry] : configs[i].large_allocations) {
        std::cout << "  " << std::left << std::setw(40) << (op.empty() ? "(no operator)" : op)
                  << std::right << std::setw(12) << entry.first << std::setw(8) << entry.second
                  << "\n";
      }
    }
  }

  if (!args.json.empty()) {
    std::ofstream out(args.json);
    if (!out) {
      std::cerr << "bench_virtual_groups: cannot write " << args.json << "\n";
      return 1;
    }
    out << std::setprecision(6);
    out << "{\n"
        << "  \"benchmark\": \"virtual_groups\",\n"
        << "  \"label\": " << json_string(args.label) << ",\n"
        << "  \"model\": " << json_string(layered_mlp_name(kLayers, kWidth)) << ",\n"
        << "  \"parameters\": " << num_params << ",\n"
        << "  \"parameter_tensors\": " << init.size() << ",\n"
        << "  \"machine\": " << machine_json(load_before, load_after) << ",\n"
        << "  \"settings\": {\"repetitions\": " << args.repetitions
        << ", \"window\": " << args.window << ", \"precondition_frequency\": " << args.frequency
        << ", \"start_preconditioning_step\": " << args.start
        << ", \"grad_pool\": " << args.grad_pool << ", \"batch\": " << args.batch
        << ", \"shampoo\": {\"lr\": \"1e-3 * (1 + g / N)\", \"betas\": [0.9, 0.999], "
           "\"epsilon\": 1e-12, \"max_preconditioner_dim\": 1024, \"grafting\": "
           "\"adam(0.999, 1e-8)\"}},\n"
        << "  \"total_blocks\": " << stats.total_blocks << ",\n"
        << "  \"state_bytes\": " << stats.state_bytes << ",\n"
        << "  \"timed_section_s\": " << run_s << ",\n"
        << "  \"configurations\": [";
    for (size_t i = 0; i < configs.size(); ++i) {
      const auto& c = configs[i];
      out << (i ? "," : "") << "\n    {\"groups\": " << c.groups
          << ", \"merged\": " << (c.merged ? "true" : "false")
          << ", \"virtual_groups\": " << c.optimizer->stats().virtual_groups
          << ", \"median_ms\": " << median(c.rep_median_ms)
          << ", \"ratio_vs_merged_1\": " << ratio_of(c)
          << ", \"median_cpu_ms\": " << median(c.rep_median_cpu)
          << ", \"cpu_ratio_vs_merged_1\": " << cpu_ratio_of(c)
          << ", \"per_repetition_ms\": " << json_array(c.rep_median_ms)
          << ", \"root_step_ms\": " << json_array(c.root_ms)
          << ", \"top_level_ops_per_step\": " << c.ops_top_level
          << ", \"all_ops_per_step\": " << c.ops_all
          << ", \"allocations_per_step\": " << c.allocations
          << ", \"allocated_bytes_per_step\": " << c.allocated_bytes
          << ", \"identical_to_other_mode\": " << (identical[i / 2] == "yes" ? "true" : "false")
          << "}";
    }
    out << "\n  ]\n}\n";
    std::cout << "\nwrote " << args.json << "\n";
  }
  return 0;
}
