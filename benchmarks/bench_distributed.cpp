/// The Distributor on CPU/Gloo: step time, bytes communicated per step and optimizer state per
/// rank of DistributedShampoo at world sizes 1, 2 and 4, and 64 param groups merged vs unmerged at
/// world 2 (collectives per step, step time).
///
/// Model: 16 layers [Linear(256, 256), LayerNorm(256), ReLU]: 64 parameter tensors, 1,060,864
/// parameters, 64 blocks (16 of [256, 256], 48 of [256]). Shampoo: Adam grafting,
/// max_preconditioner_dim 1024, precondition_frequency F (100), start_preconditioning_step S (10).
///
/// Cases (each a fresh optimizer on fresh copies of the same initial parameters):
///   single          no process group (the single-process path), 1 param group
///   w1, w2, w4      a Gloo process group of 1, 2, 4 ranks, 1 param group
///   w2_g64_merged   world 2, every tensor its own param group (lr 1e-3·(1 + g/64)), merged
///   w2_g64_unmerged the same with DistributedOptions().merge_param_groups(false)
/// By default the ranks are threads of this process (one Gloo process group over an in-memory
/// store; Gloo still talks over loopback TCP), each with at::set_num_threads(--threads). With
/// --torchrun the program is one rank of a torchrun launch (init_process_group_from_env) and runs
/// the cases whose world size is WORLD_SIZE.
///
/// Timing: gradients come from a pool of real forward/backward passes, copied into .grad()
/// untimed (every rank gets the same gradients, as after a gradient all-reduce). Steps 1 ... S
/// (the first root computation at S) are untimed; then W steps are timed, each after a barrier
/// that lines the ranks up; the time of a step is the slowest rank's. Steps with a root
/// computation are excluded from the medians (none with the defaults: S + W < F). Per repetition
/// every case runs once, the order rotated every repetition; ratios divide by the single case of
/// the same repetition.
///
/// CPU time: the CPU time of each rank's thread during the step (CLOCK_THREAD_CPUTIME_ID; with
/// one intra-op thread the rank's own computation, Gloo's transfers run on Gloo's threads), the
/// busiest rank's, median over steps: the work, as against the wall time on a shared machine.
///
/// Communication model: after the window, every distributed run replays alone what a step
/// communicated: as many Gloo AllGathers as the step issued (collectives_last_step), together
/// carrying its bytes_sent_per_step (split evenly), on buffers of their own; timed like the steps
/// (barrier, slowest rank, median of --comm-repetitions): roughly the communication part of a step.
///
///   bench_distributed [--repetitions 5] [--window 20] [--frequency 100] [--start-step 10]
///                     [--threads 1] [--grad-pool 4] [--batch 64] [--comm-repetitions 10]
///                     [--cases a,b,...] [--torchrun] [--peaks] [--no-agreement]
///                     [--json PATH] [--label TEXT]
/// --peaks: the tracking allocator counts tensor memory; per rank the largest peak of a timed
/// root-free step above what was live before it, with the state, the undo journal and the
/// AllGather buffers (issue 26: the distributed step's peak against the single process's).
/// Results and how to read them: benchmarks/RESULTS.md.

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <shampoo/shampoo.h>
#include <torch/types.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "benchmarks/bench_support.h"
#include "benchmarks/tracking_allocator.h"

namespace {

using namespace shampoo::bench;

constexpr int64_t kLayers = 16;
constexpr int64_t kWidth = 256;

struct Args {
  int64_t repetitions = 5;
  int64_t window = 20;
  int64_t frequency = 100;
  int64_t start = 10;
  int64_t threads = 1;
  int64_t grad_pool = 4;
  int64_t batch = 64;
  int64_t comm_repetitions = 10;
  std::string cases;  // comma-separated subset; empty = all (torchrun: those of its world size)
  bool torchrun = false;
  bool peaks = false;
  bool no_agreement = false;
  std::string json;
  std::string label;
};

struct CaseSpec {
  std::string name;
  int world = 0;  // 0 = no process group
  int64_t groups = 1;
  bool merged = true;
};

const std::vector<CaseSpec>& all_cases() {
  static const std::vector<CaseSpec> cases{{"single", 0, 1, true},
                                           {"w1", 1, 1, true},
                                           {"w2", 2, 1, true},
                                           {"w4", 4, 1, true},
                                           {"w2_g64_merged", 2, 64, true},
                                           {"w2_g64_unmerged", 2, 64, false}};
  return cases;
}

/// What one rank reports about its optimizer.
struct RankStats {
  int64_t state_bytes = 0;
  int64_t owned_blocks = 0;
  int64_t total_blocks = 0;
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
  int64_t collectives = 0;
  int64_t virtual_groups = 0;
  int64_t step_peak = 0;  // --peaks: largest peak of a timed root-free step above its start
  int64_t journal = 0;    // the last step's undo journal
};

/// One run of a case.
struct CaseRun {
  std::vector<double> step_ms;  // timed root-free steps, slowest rank
  std::vector<double> root_ms;  // timed steps with a root computation, slowest rank
  std::vector<double> cpu_ms;   // timed root-free steps: CPU time of the busiest rank's thread
  double comm_ms = 0;           // the step's collectives replayed alone (median, slowest rank)
  std::vector<RankStats> ranks;
};

/// Communication model: as many AllGathers as the step issued, together as many bytes, on buffers
/// of their own (the optimizer's buffers are private), timed like the steps; the median.
double communication_model_ms(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                              const shampoo::ShampooStats& s, const Args& args) {
  const int64_t count = s.collectives_last_step;
  const int64_t elements = s.bytes_sent_per_step / 4;  // float32 communication
  std::vector<at::Tensor> sends, receives;
  for (int64_t c = 0; c < count; ++c) {
    const int64_t n = elements / count + (c < elements % count ? 1 : 0);
    sends.push_back(at::zeros({n}));
    receives.push_back(at::zeros({n * group->getSize()}));
  }
  auto backend = group->getBackend(c10::DeviceType::CPU);
  std::vector<double> comm;
  for (int64_t i = 0; i < args.comm_repetitions; ++i) {
    barrier(group);
    const auto begin = Clock::now();
    for (int64_t c = 0; c < count; ++c) backend->_allgather_base(receives[c], sends[c])->wait();
    comm.push_back(max_over_ranks(group, elapsed_ms(begin, Clock::now())));
  }
  return median(comm);
}

/// The part of a case that one rank runs (group null: the single-process case).
CaseRun run_rank(const CaseSpec& spec, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                 const std::vector<at::Tensor>& init,
                 const std::vector<std::vector<at::Tensor>>& pool, const Args& args) {
  const auto params = clone_params(init);
  const auto options = shampoo_options(args.frequency, args.start);
  auto distributed = shampoo::DistributedOptions()
                         .merge_param_groups(spec.merged)
                         .agree_before_update(!args.no_agreement);
  if (group) distributed.process_group(group);
  shampoo::DistributedShampoo optimizer(lr_param_groups(params, spec.groups, options), options,
                                        distributed);

  int64_t steps = 0;
  int64_t peak_above = 0;  // of the last step
  auto step = [&]() {
    set_gradients(params, pool[static_cast<size_t>(steps) % pool.size()]);
    if (group) barrier(group);
    int64_t live_before = 0;
    if (args.peaks) {
      auto& tracker = TrackingAllocator::install();
      tracker.reset_peak();
      live_before = tracker.live();
    }
    const double cpu_begin = thread_cpu_ms();
    const auto begin = Clock::now();
    optimizer.step();
    const double ms = elapsed_ms(begin, Clock::now());
    if (args.peaks) peak_above = TrackingAllocator::install().peak() - live_before;
    const double cpu = thread_cpu_ms() - cpu_begin;
    ++steps;
    if (!group) return std::make_pair(ms, cpu);
    return std::make_pair(max_over_ranks(group, ms), max_over_ranks(group, cpu));
  };

  CaseRun run;
  for (int64_t t = 1; t <= args.start; ++t) step();
  int64_t step_peak = 0;
  for (int64_t w = 0; w < args.window; ++w) {
    const int64_t t = steps + 1;
    const auto [ms, cpu] = step();
    if (is_root_step(t, args.start, args.frequency)) {
      run.root_ms.push_back(ms);
    } else {
      run.step_ms.push_back(ms);
      run.cpu_ms.push_back(cpu);
      step_peak = std::max(step_peak, peak_above);
    }
  }
  const auto s = optimizer.stats();
  if (group && s.collectives_last_step > 0) run.comm_ms = communication_model_ms(group, s, args);
  const std::vector<int64_t> mine{s.state_bytes,
                                  s.owned_blocks,
                                  s.total_blocks,
                                  s.bytes_sent_per_step,
                                  s.bytes_received_per_step,
                                  s.collectives_last_step,
                                  s.virtual_groups,
                                  step_peak,
                                  s.rollback_bytes_last_step};
  const auto all = group ? gather_from_ranks(group, mine) : std::vector<std::vector<int64_t>>{mine};
  for (const auto& v : all) {
    run.ranks.push_back({v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8]});
  }
  return run;
}

/// Runs a case on `world` threads (or, with `torchrun_group`, as this process's rank).
CaseRun run_case(const CaseSpec& spec, const c10::intrusive_ptr<c10d::ProcessGroup>& torchrun_group,
                 const std::vector<at::Tensor>& init,
                 const std::vector<std::vector<at::Tensor>>& pool, const Args& args) {
  if (torchrun_group) return run_rank(spec, torchrun_group, init, pool, args);
  if (spec.world == 0) return run_rank(spec, {}, init, pool, args);
  std::vector<CaseRun> runs(static_cast<size_t>(spec.world));
  run_ranks_as_threads(spec.world, static_cast<int>(args.threads),
                       [&](int rank, const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
                         runs[static_cast<size_t>(rank)] = run_rank(spec, group, init, pool, args);
                       });
  return runs.front();
}

std::vector<CaseSpec> selected_cases(const Args& args, int torchrun_world) {
  std::vector<std::string> names;
  std::stringstream list(args.cases);
  for (std::string name; std::getline(list, name, ',');) {
    if (!name.empty()) names.push_back(name);
  }
  std::vector<CaseSpec> out;
  for (const auto& c : all_cases()) {
    const bool named = std::find(names.begin(), names.end(), c.name) != names.end();
    if (torchrun_world > 0 && c.world != torchrun_world) {
      if (named) {
        throw std::runtime_error(fmt::format("case {} needs world {}, this torchrun launch has {}",
                                             c.name, c.world, torchrun_world));
      }
      continue;
    }
    if (names.empty() || named) out.push_back(c);
  }
  for (const auto& n : names) {
    if (std::none_of(all_cases().begin(), all_cases().end(),
                     [&](const CaseSpec& c) { return c.name == n; })) {
      throw std::runtime_error("unknown case '" + n + "'");
    }
  }
  if (out.empty()) throw std::runtime_error("no case selected");
  return out;
}

Args parse_args(int argc, char** argv) {
  Args args;
  Flags flags("bench_distributed",
              "The Distributor on CPU/Gloo: step time, bytes communicated and state per rank at "
              "world 1, 2, 4, and 64 param groups merged vs unmerged (benchmarks/RESULTS.md).");
  flags.add("repetitions", args.repetitions, "repetitions (medians are over them)", 1)
      .add("window", args.window, "timed steps per case and repetition", 1)
      .add("frequency", args.frequency, "precondition_frequency", 2)
      .add("start-step", args.start, "start_preconditioning_step (the first root computation)", 1)
      .add("threads", args.threads, "intra-op threads per rank", 1)
      .add("grad-pool", args.grad_pool, "distinct gradient sets, cycled", 1)
      .add("batch", args.batch, "batch size of the passes that make the gradients", 1)
      .add("comm-repetitions", args.comm_repetitions,
           "repetitions of the communication model (the step's AllGathers replayed alone)", 1)
      .add("cases", args.cases,
           "comma-separated cases among single, w1, w2, w4, w2_g64_merged, w2_g64_unmerged "
           "(none: all; with --torchrun those of its world size)")
      .add_bool("torchrun", args.torchrun,
                "run as one rank of a torchrun launch (init_process_group_from_env)")
      .add_bool("peaks", args.peaks,
                "count tensor memory (tracking allocator): per rank, the largest peak of a timed "
                "root-free step above what was live before it, the step's undo journal and "
                "AllGather buffers (per rank only for the single case and under --torchrun)")
      .add_bool("no-agreement", args.no_agreement,
                "DistributedOptions::agree_before_update(false): no agreement before a step "
                "changes state, and an undo journal in every distributed step instead");
  add_output_flags(flags, args.json, args.label);
  parse_flags_or_exit(flags, "bench_distributed", argc, argv);
  return args;
}

/// What every rank shares: the torchrun group (if any), the cases, the model's parameters and
/// gradients.
struct Setup {
  c10::intrusive_ptr<c10d::ProcessGroup> torchrun_group;
  bool report = true;  // rank 0 prints and writes
  std::vector<CaseSpec> cases;
  std::vector<at::Tensor> init;
  std::vector<std::vector<at::Tensor>> pool;
  std::string launcher;
};

Setup make_setup(const Args& args) {
  Setup s;
  if (args.torchrun) s.torchrun_group = shampoo::init_process_group_from_env();
  s.report = !s.torchrun_group || s.torchrun_group->getRank() == 0;
  s.cases = selected_cases(args, s.torchrun_group ? s.torchrun_group->getSize() : 0);
  torch::manual_seed(0);  // every rank builds the same model and gradients
  auto model = make_layered_mlp(kLayers, kWidth);
  s.init = model->parameters();
  s.pool = make_gradient_pool(model, args.grad_pool, args.batch, kWidth, kWidth);
  s.launcher = s.torchrun_group ? "torchrun (one process per rank)" : "threads of one process";
  return s;
}

/// runs[case][repetition]: every case once per repetition, the order rotated every repetition.
std::vector<std::vector<CaseRun>> run_all(const Setup& s, const Args& args) {
  std::vector<std::vector<CaseRun>> runs(s.cases.size());
  for (int64_t r = 0; r < args.repetitions; ++r) {
    if (s.report) fmt::print("  repetition {}/{} (ms):", r + 1, args.repetitions);
    for (size_t k = 0; k < s.cases.size(); ++k) {
      const size_t c = (k + static_cast<size_t>(r)) % s.cases.size();
      runs[c].push_back(run_case(s.cases[c], s.torchrun_group, s.init, s.pool, args));
      if (s.report) fmt::print(" {} {:.2f};", s.cases[c].name, median(runs[c].back().step_ms));
      std::fflush(stdout);
    }
    if (s.report) fmt::print("\n");
    std::fflush(stdout);
  }
  return runs;
}

/// The medians of one case over the repetitions.
struct Row {
  double median_ms = 0;
  double comm_ms = 0;
  double cpu_ms = 0;
  std::optional<double> ratio;  // vs single, median of same-repetition ratios (no single case: -)
  std::vector<double> per_rep;
};

std::vector<Row> summarize(const std::vector<CaseSpec>& cases,
                           const std::vector<std::vector<CaseRun>>& runs) {
  const auto single =
      std::find_if(cases.begin(), cases.end(), [](const CaseSpec& c) { return c.world == 0; });
  const auto single_index = static_cast<size_t>(single - cases.begin());
  std::vector<Row> rows(cases.size());
  for (size_t c = 0; c < cases.size(); ++c) {
    std::vector<double> ratios, comm, cpu;
    for (size_t r = 0; r < runs[c].size(); ++r) {
      rows[c].per_rep.push_back(median(runs[c][r].step_ms));
      if (single != cases.end()) {
        ratios.push_back(rows[c].per_rep.back() / median(runs[single_index][r].step_ms));
      }
      comm.push_back(runs[c][r].comm_ms);
      cpu.push_back(median(runs[c][r].cpu_ms));
    }
    rows[c].median_ms = median(rows[c].per_rep);
    rows[c].comm_ms = median(comm);
    rows[c].cpu_ms = median(cpu);
    if (single != cases.end()) rows[c].ratio = median(ratios);
  }
  return rows;
}

void print_table(const std::vector<CaseSpec>& cases, const std::vector<std::vector<CaseRun>>& runs,
                 const std::vector<Row>& rows) {
  fmt::print(
      "\n{:<17}{:>11}{:>11}{:>10}{:>10}{:>8}{:>14}{:>14}{:>14}{:>14}{:>14}{:>14}\n{:-<151}\n",
      "case", "step ms", "/single", "cpu ms", "comm ms", "coll.", "sent B/step", "recv B/step",
      "state max", "state min", "total/world", "blocks", "");
  for (size_t c = 0; c < cases.size(); ++c) {
    const auto& ranks = runs[c].back().ranks;
    int64_t state_max = 0, state_min = INT64_MAX, state_total = 0, sent = 0, received = 0;
    std::vector<int64_t> owned;
    for (const auto& s : ranks) {
      state_max = std::max(state_max, s.state_bytes);
      state_min = std::min(state_min, s.state_bytes);
      state_total += s.state_bytes;
      sent = std::max(sent, s.bytes_sent);
      received = std::max(received, s.bytes_received);
      owned.push_back(s.owned_blocks);
    }
    const std::string ratio = rows[c].ratio ? fmt::format("{:.3f}x", *rows[c].ratio) : "";
    fmt::print("{:<17}{:>11.2f}{:>11}{:>10.2f}{:>10.2f}{:>8}{:>14}{:>14}{:>14}{:>14}{:>14}{:>14}\n",
               cases[c].name, rows[c].median_ms, ratio, rows[c].cpu_ms, rows[c].comm_ms,
               ranks[0].collectives, sent, received, state_max, state_min,
               state_total / static_cast<int64_t>(ranks.size()),
               fmt::format("{}", fmt::join(owned, "+")));
  }
  fmt::print(
      "(step ms: median over repetitions of the median timed step, each step the slowest "
      "rank's; cpu ms: CPU time of the busiest rank's thread in the step (median); comm ms: "
      "the step's AllGathers replayed alone; coll.: collectives in the last step on rank 0; "
      "blocks: owned per rank; virtual groups:");
  size_t roots = 0;
  for (size_t c = 0; c < cases.size(); ++c) {
    fmt::print(" {} {}", cases[c].name, runs[c].back().ranks[0].virtual_groups);
    for (const auto& run : runs[c]) roots += run.root_ms.size();
  }
  fmt::print(")\nroot-computation steps timed: {}\n", roots);
}

/// --peaks: per case and rank, the step's peak above what was live before it, against the
/// state, the undo journal and the AllGather buffers (MB).
void print_peaks(const std::vector<CaseSpec>& cases, const std::vector<std::vector<CaseRun>>& runs,
                 bool per_rank) {
  fmt::print("\nstep peaks (MB; tracking allocator; largest over the timed root-free steps):\n");
  for (size_t c = 0; c < cases.size(); ++c) {
    if (cases[c].world > 1 && !per_rank) {
      fmt::print("  {}: ranks are threads sharing one allocator; run it under --torchrun\n",
                 cases[c].name);
      continue;
    }
    const auto& ranks = runs[c].back().ranks;
    for (size_t r = 0; r < ranks.size(); ++r) {
      const auto& s = ranks[r];
      fmt::print(
          "  {} rank {}: step peak above its start {:.2f}; state {:.2f}; undo journal {:.2f}; "
          "AllGather buffers {:.2f}\n",
          cases[c].name, r, s.step_peak / 1e6, s.state_bytes / 1e6, s.journal / 1e6,
          (s.bytes_sent + s.bytes_received) / 1e6);
    }
  }
}

Json case_json(const CaseSpec& spec, const std::vector<CaseRun>& runs, const Row& row) {
  const auto& ranks = runs.back().ranks;
  auto per_rank = [&](int64_t RankStats::*field) {
    std::vector<int64_t> v;
    for (const auto& s : ranks) v.push_back(s.*field);
    return v;
  };
  Json json{{"name", spec.name},
            {"world", spec.world},
            {"param_groups", spec.groups},
            {"merged", spec.merged},
            {"median_ms", row.median_ms},
            {"communication_model_ms", row.comm_ms},
            {"busiest_rank_thread_cpu_ms", row.cpu_ms}};
  if (row.ratio) json["ratio_vs_single"] = *row.ratio;
  json["per_repetition_ms"] = row.per_rep;
  json["virtual_groups"] = ranks[0].virtual_groups;
  json["total_blocks"] = ranks[0].total_blocks;
  json["collectives_last_step"] = per_rank(&RankStats::collectives);
  json["state_bytes"] = per_rank(&RankStats::state_bytes);
  json["owned_blocks"] = per_rank(&RankStats::owned_blocks);
  json["bytes_sent_per_step"] = per_rank(&RankStats::bytes_sent);
  json["bytes_received_per_step"] = per_rank(&RankStats::bytes_received);
  return json;
}

Json results_json(const Setup& s, const std::vector<std::vector<CaseRun>>& runs,
                  const std::vector<Row>& rows, const Args& args) {
  Json settings{{"repetitions", args.repetitions},
                {"window", args.window},
                {"precondition_frequency", args.frequency},
                {"start_preconditioning_step", args.start},
                {"grad_pool", args.grad_pool},
                {"batch", args.batch},
                {"comm_repetitions", args.comm_repetitions}};
  settings["shampoo"] = {{"lr", 1e-3},
                         {"betas", {0.9, 0.999}},
                         {"epsilon", 1e-12},
                         {"max_preconditioner_dim", 1024},
                         {"grafting", "adam(0.999, 1e-8)"}};
  Json cases = Json::array();
  for (size_t c = 0; c < s.cases.size(); ++c)
    cases.push_back(case_json(s.cases[c], runs[c], rows[c]));
  return Json{{"benchmark", "distributed"},
              {"label", args.label},
              {"launcher", s.launcher},
              {"model", layered_mlp_name(kLayers, kWidth)},
              {"parameters", numel_of(s.init)},
              {"parameter_tensors", s.init.size()},
              {"machine", nullptr},  // set by the caller
              {"settings", settings},
              {"timed_section_s", nullptr},  // set by the caller
              {"cases", cases}};
}

int run(const Args& args) {
  const Setup s = make_setup(args);
  const double load_before = load_average();
  if (s.report) {
    fmt::print(
        "bench_distributed: {} ({} parameters, {} tensors), LibTorch {}, {} thread(s) per "
        "rank, ranks as {}, CPU {}\n  repetitions {}, window {} steps, "
        "precondition_frequency {}, start_preconditioning_step {}\n",
        layered_mlp_name(kLayers, kWidth), numel_of(s.init), s.init.size(), TORCH_VERSION,
        at::get_num_threads(), s.launcher, cpu_model(), args.repetitions, args.window,
        args.frequency, args.start);
    std::fflush(stdout);
  }
  const auto run_begin = Clock::now();
  const auto runs = run_all(s, args);
  const double run_s = elapsed_ms(run_begin, Clock::now()) / 1000.0;
  const double load_after = load_average();
  if (!s.report) return 0;

  const auto rows = summarize(s.cases, runs);
  print_table(s.cases, runs, rows);
  if (args.peaks) print_peaks(s.cases, runs, static_cast<bool>(s.torchrun_group));
  print_timed_section(run_s, load_before, load_after);
  if (args.json.empty()) return 0;
  Json json = results_json(s, runs, rows, args);
  json["machine"] = machine_json(load_before, load_after);
  json["timed_section_s"] = run_s;
  return write_json(args.json, json, "bench_distributed") ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse_args(argc, argv);
  at::set_num_threads(static_cast<int>(args.threads));
  try {
    return run(args);
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_distributed: {}\n", e.what());
    return 1;
  }
}
