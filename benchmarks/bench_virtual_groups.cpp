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
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <shampoo/shampoo.h>
#include <torch/types.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
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

Args parse_args(int argc, char** argv) {
  Args args;
  Flags flags("bench_virtual_groups",
              "Step time of DistributedShampoo with 1, 8, 64 or 256 param groups that differ only "
              "in their lr, merged into virtual groups or not (benchmarks/RESULTS.md).");
  flags.add("repetitions", args.repetitions, "repetitions (medians are over them)", 1)
      .add("window", args.window, "rounds (one step of every configuration) per repetition", 1)
      .add("frequency", args.frequency, "precondition_frequency", 2)
      .add("start-step", args.start, "start_preconditioning_step (the first root computation)", 1)
      .add("threads", args.threads, "intra-op threads", 1)
      .add("grad-pool", args.grad_pool, "distinct gradient sets, cycled", 1)
      .add("batch", args.batch, "batch size of the passes that make the gradients", 1)
      .add_bool("ops-detail", args.ops_detail,
                "print the top-level operator histogram of merged N=1 vs N=256")
      .add_bool("verbose", args.verbose,
                "print every timed step with its CLOCK_MONOTONIC start and end (perf_by_step.py)");
  add_output_flags(flags, args.json, args.label);
  parse_flags_or_exit(flags, "bench_virtual_groups", argc, argv);
  return args;
}

/// One round: one step of every configuration, the order rotated by `round`.
void run_round(std::vector<Config>& configs, const std::vector<std::vector<at::Tensor>>& pool,
               const Args& args, int64_t round) {
  const auto n = static_cast<int64_t>(configs.size());
  for (int64_t k = 0; k < n; ++k) {
    auto& c = configs[static_cast<size_t>((k + round) % n)];
    const int64_t t = c.steps_taken + 1;
    const auto time = timed_step(c, pool);
    if (args.verbose) {
      // steady_clock is CLOCK_MONOTONIC, what `perf record -k mono` stamps samples with.
      const double end_s = std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
      fmt::print("    step {} {} start {:.6f} s, end {:.6f} s, {:.2f} ms\n", c.name, t,
                 end_s - time.ms / 1000.0, end_s, time.ms);
    }
    if (is_root_step(t, args.start, args.frequency)) {
      c.root_ms.push_back(time.ms);
    } else {
      c.plain_ms.push_back(time.ms);
      c.plain_cpu.push_back(time.cpu_ms);
    }
  }
}

void run_repetitions(std::vector<Config>& configs, const std::vector<std::vector<at::Tensor>>& pool,
                     const Args& args) {
  int64_t round = 0;
  for (int64_t r = 0; r < args.repetitions; ++r) {
    for (auto& c : configs) {
      c.plain_ms.clear();
      c.plain_cpu.clear();
    }
    for (int64_t w = 0; w < args.window; ++w, ++round) run_round(configs, pool, args, round);
    fmt::print("  repetition {}/{} (ms):", r + 1, args.repetitions);
    for (auto& c : configs) {
      c.rep_median_ms.push_back(median(c.plain_ms));
      c.rep_median_cpu.push_back(median(c.plain_cpu));
      fmt::print(" {} {:.2f};", c.name, c.rep_median_ms.back());
    }
    fmt::print("\n");
    std::fflush(stdout);
  }
}

/// Operator calls and tensor allocations of one root-free step of each configuration.
void count_operators(std::vector<Config>& configs, const std::vector<std::vector<at::Tensor>>& pool,
                     const Args& args) {
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
}

/// Merged and unmerged of the same N saw the same gradients and options: same parameters.
/// identical[i / 2] for the pair configs[i], configs[i + 1].
std::vector<bool> identical_pairs(const std::vector<Config>& configs) {
  std::vector<bool> identical;
  for (size_t i = 0; i + 1 < configs.size(); i += 2) {
    bool same = true;
    for (size_t p = 0; p < configs[i].params.size(); ++p) {
      same &= at::equal(configs[i].params[p], configs[i + 1].params[p]);
    }
    identical.push_back(same);
  }
  return identical;
}

/// Per repetition, a configuration's median over merged N=1's; the median over repetitions. Of
/// the wall times, or (`cpu`) of the CPU times.
double ratio_to_base(const Config& c, const Config& base, bool cpu) {
  const auto& mine = cpu ? c.rep_median_cpu : c.rep_median_ms;
  const auto& theirs = cpu ? base.rep_median_cpu : base.rep_median_ms;
  std::vector<double> ratios;
  for (size_t r = 0; r < mine.size(); ++r) ratios.push_back(mine[r] / theirs[r]);
  return median(ratios);
}

void print_group_table(const std::vector<Config>& configs, const std::vector<bool>& identical) {
  fmt::print("\n{:<8}{:>12}{:>14}{:>12}{:>12}{:>10}{:>10}{:>10}{:>16}{:>18}{:>11}\n", "groups",
             "merged ms", "unmerged ms", "merged/", "unmerged/", "cpu m/", "cpu u/", "virtual",
             "top-level ops", "all ops", "identical");
  fmt::print("{:<8}{:>12}{:>14}{:>12}{:>12}{:>10}{:>10}{:>10}{:>16}{:>18}\n{:-<133}\n", "", "", "",
             "merged(1)", "merged(1)", "m(1)", "m(1)", "groups", "merged/unm.", "merged/unm.", "");
  const auto& base = configs.front();
  for (size_t i = 0; i + 1 < configs.size(); i += 2) {
    const auto& m = configs[i];
    const auto& u = configs[i + 1];
    fmt::print(
        "{:<8}{:>12.2f}{:>14.2f}{:>11.3f}x{:>11.3f}x{:>9.3f}x{:>9.3f}x{:>10}{:>16}{:>18}{:>11}\n",
        m.groups, median(m.rep_median_ms), median(u.rep_median_ms), ratio_to_base(m, base, false),
        ratio_to_base(u, base, false), ratio_to_base(m, base, true), ratio_to_base(u, base, true),
        fmt::format("{}/{}", m.optimizer->stats().virtual_groups,
                    u.optimizer->stats().virtual_groups),
        fmt::format("{}/{}", m.ops_top_level, u.ops_top_level),
        fmt::format("{}/{}", m.ops_all, u.ops_all), identical[i / 2] ? "yes" : "NO");
  }
}

void print_allocation_table(const std::vector<Config>& configs) {
  fmt::print(
      "\ntensor allocations of one root-free step (tracking allocator):\n"
      "{:<16}{:>13}{:>14}{:>16}{:>14}\n{:-<73}\n",
      "configuration", "allocations", "MiB", ">=128KiB allocs", ">=128KiB MiB", "");
  for (const auto& c : configs) {
    int64_t large_count = 0, large_bytes = 0;
    for (const auto& [op, entry] : c.large_allocations) {
      large_bytes += entry.first;
      large_count += entry.second;
    }
    fmt::print("{:<16}{:>13}{:>14.2f}{:>16}{:>14.2f}\n", c.name, c.allocations,
               c.allocated_bytes / 1048576.0, large_count, large_bytes / 1048576.0);
  }
}

void print_summary(const std::vector<Config>& configs) {
  const auto& base = configs.front();
  const auto stats = base.optimizer->stats();
  const double target = ratio_to_base(configs[6], base, false);
  fmt::print(
      "(ms: median over repetitions of the median root-free step; ratios: median over "
      "repetitions of the same-repetition ratio; cpu m/m(1), cpu u/m(1): the same ratios "
      "of the steps' CPU time (this thread); ops: one root-free step)\n"
      "target merged(256)/merged(1) <= 1.1: {:.3f}x -> {} (CPU time {:.3f}x)\n"
      "blocks {}, state bytes {}\nroot-computation steps (ms, all timed ones):",
      target, target <= 1.1 ? "met" : "MISSED", ratio_to_base(configs[6], base, true),
      stats.total_blocks, format_bytes(stats.state_bytes));
  for (const auto& c : configs) fmt::print(" {} [{:.6g}];", c.name, fmt::join(c.root_ms, ", "));
  fmt::print("\n");
}

void print_ops_detail(const std::vector<Config>& configs) {
  std::map<std::string, std::pair<int64_t, int64_t>> both;
  for (const auto& [name, n] : configs[0].ops_by_name) both[name].first = n;
  for (const auto& [name, n] : configs[6].ops_by_name) both[name].second = n;
  std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>> rows(both.begin(), both.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) {
    return a.second.second - a.second.first > b.second.second - b.second.first;
  });
  fmt::print("\ntop-level operator calls of one step, merged N=1 vs merged N=256:\n");
  for (const auto& [name, counts] : rows) {
    fmt::print("  {:<40}{:>8}{:>8}\n", name, counts.first, counts.second);
  }
  for (const size_t i : {size_t{0}, size_t{7}}) {
    fmt::print("allocations >= 128 KiB of one step of {} by top-level operator (bytes, count):\n",
               configs[i].name);
    for (const auto& [op, entry] : configs[i].large_allocations) {
      fmt::print("  {:<40}{:>12}{:>8}\n", op.empty() ? "(no operator)" : op, entry.first,
                 entry.second);
    }
  }
}

Json results_json(const std::vector<Config>& configs, const std::vector<bool>& identical,
                  const std::vector<at::Tensor>& init, const Args& args) {
  const auto& base = configs.front();
  const auto stats = base.optimizer->stats();
  Json settings{{"repetitions", args.repetitions},
                {"window", args.window},
                {"precondition_frequency", args.frequency},
                {"start_preconditioning_step", args.start},
                {"grad_pool", args.grad_pool},
                {"batch", args.batch}};
  settings["shampoo"] = {{"lr", "1e-3 * (1 + g / N)"},
                         {"betas", {0.9, 0.999}},
                         {"epsilon", 1e-12},
                         {"max_preconditioner_dim", 1024},
                         {"grafting", "adam(0.999, 1e-8)"}};
  Json rows = Json::array();
  for (size_t i = 0; i < configs.size(); ++i) {
    const auto& c = configs[i];
    rows.push_back({{"groups", c.groups},
                    {"merged", c.merged},
                    {"virtual_groups", c.optimizer->stats().virtual_groups},
                    {"median_ms", median(c.rep_median_ms)},
                    {"ratio_vs_merged_1", ratio_to_base(c, base, false)},
                    {"median_cpu_ms", median(c.rep_median_cpu)},
                    {"cpu_ratio_vs_merged_1", ratio_to_base(c, base, true)},
                    {"per_repetition_ms", c.rep_median_ms},
                    {"root_step_ms", c.root_ms},
                    {"top_level_ops_per_step", c.ops_top_level},
                    {"all_ops_per_step", c.ops_all},
                    {"allocations_per_step", c.allocations},
                    {"allocated_bytes_per_step", c.allocated_bytes},
                    {"identical_to_other_mode", static_cast<bool>(identical[i / 2])}});
  }
  return Json{{"benchmark", "virtual_groups"},
              {"label", args.label},
              {"model", layered_mlp_name(kLayers, kWidth)},
              {"parameters", numel_of(init)},
              {"parameter_tensors", init.size()},
              {"machine", nullptr},  // set by the caller
              {"settings", settings},
              {"total_blocks", stats.total_blocks},
              {"state_bytes", stats.state_bytes},
              {"timed_section_s", nullptr},  // set by the caller
              {"configurations", rows}};
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse_args(argc, argv);
  at::set_num_threads(static_cast<int>(args.threads));
  torch::manual_seed(0);

  auto model = make_layered_mlp(kLayers, kWidth);
  const auto init = model->parameters();
  const auto pool = make_gradient_pool(model, args.grad_pool, args.batch, kWidth, kWidth);
  const double load_before = load_average();
  std::vector<Config> configs;
  for (const int64_t n : kGroupCounts) {
    for (const bool merged : {true, false}) configs.push_back(make_config(init, n, merged, args));
  }
  fmt::print(
      "bench_virtual_groups: {} ({} parameters, {} tensors), LibTorch {}, {} thread(s), CPU "
      "{}\n  {} configurations, repetitions {} x {} rounds, precondition_frequency {}, "
      "start_preconditioning_step {}\n",
      layered_mlp_name(kLayers, kWidth), numel_of(init), init.size(), TORCH_VERSION,
      at::get_num_threads(), cpu_model(), configs.size(), args.repetitions, args.window,
      args.frequency, args.start);
  std::fflush(stdout);

  // Warm-up: steps 1 ... S (the first root computation at S), untimed.
  const auto warm_begin = Clock::now();
  for (int64_t t = 1; t <= args.start; ++t) {
    for (auto& c : configs) timed_step(c, pool);
  }
  fmt::print("  warm-up {:.1f} s ({} steps each)\n", elapsed_ms(warm_begin, Clock::now()) / 1000.0,
             args.start);
  std::fflush(stdout);

  const auto run_begin = Clock::now();
  run_repetitions(configs, pool, args);
  const double run_s = elapsed_ms(run_begin, Clock::now()) / 1000.0;
  const double load_after = load_average();
  count_operators(configs, pool, args);
  const auto identical = identical_pairs(configs);

  print_group_table(configs, identical);
  print_allocation_table(configs);
  print_summary(configs);
  print_timed_section(run_s, load_before, load_after);
  if (args.ops_detail) print_ops_detail(configs);
  if (args.json.empty()) return 0;
  Json json = results_json(configs, identical, init, args);
  json["machine"] = machine_json(load_before, load_after);
  json["timed_section_s"] = run_s;
  return write_json(args.json, json, "bench_virtual_groups") ? 0 : 1;
}
