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
///                     [--cases a,b,...] [--torchrun] [--json PATH] [--label TEXT]
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
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "benchmarks/bench_support.h"

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
};

/// One run of a case.
struct CaseRun {
  std::vector<double> step_ms;  // timed root-free steps, slowest rank
  std::vector<double> root_ms;  // timed steps with a root computation, slowest rank
  std::vector<double> cpu_ms;   // timed root-free steps: CPU time of the busiest rank's thread
  double comm_ms = 0;           // the step's collectives replayed alone (median, slowest rank)
  std::vector<RankStats> ranks;
};

/// The part of a case that one rank runs (group null: the single-process case).
CaseRun run_rank(const CaseSpec& spec, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                 const std::vector<at::Tensor>& init,
                 const std::vector<std::vector<at::Tensor>>& pool, const Args& args) {
  const auto params = clone_params(init);
  const auto options = shampoo_options(args.frequency, args.start);
  auto distributed = shampoo::DistributedOptions().merge_param_groups(spec.merged);
  if (group) distributed.process_group(group);
  shampoo::DistributedShampoo optimizer(lr_param_groups(params, spec.groups, options), options,
                                        distributed);

  int64_t steps = 0;
  auto step = [&]() {
    set_gradients(params, pool[static_cast<size_t>(steps) % pool.size()]);
    if (group) barrier(group);
    const double cpu_begin = thread_cpu_ms();
    const auto begin = Clock::now();
    optimizer.step();
    const double ms = elapsed_ms(begin, Clock::now());
    const double cpu = thread_cpu_ms() - cpu_begin;
    ++steps;
    if (!group) return std::make_pair(ms, cpu);
    return std::make_pair(max_over_ranks(group, ms), max_over_ranks(group, cpu));
  };

  CaseRun run;
  for (int64_t t = 1; t <= args.start; ++t) step();
  for (int64_t w = 0; w < args.window; ++w) {
    const int64_t t = steps + 1;
    const auto [ms, cpu] = step();
    if (is_root_step(t, args.start, args.frequency)) {
      run.root_ms.push_back(ms);
    } else {
      run.step_ms.push_back(ms);
      run.cpu_ms.push_back(cpu);
    }
  }
  const auto s = optimizer.stats();
  if (group && s.collectives_last_step > 0) {
    // Communication model: as many AllGathers as the step issued, together as many bytes, on
    // buffers of their own (the optimizer's buffers are private), timed like the steps.
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
      for (int64_t c = 0; c < count; ++c) {
        backend->_allgather_base(receives[c], sends[c])->wait();
      }
      comm.push_back(max_over_ranks(group, elapsed_ms(begin, Clock::now())));
    }
    run.comm_ms = median(comm);
  }
  const std::vector<int64_t> mine{s.state_bytes,
                                  s.owned_blocks,
                                  s.total_blocks,
                                  s.bytes_sent_per_step,
                                  s.bytes_received_per_step,
                                  s.collectives_last_step,
                                  s.virtual_groups};
  const auto all = group ? gather_from_ranks(group, mine) : std::vector<std::vector<int64_t>>{mine};
  for (const auto& v : all) run.ranks.push_back({v[0], v[1], v[2], v[3], v[4], v[5], v[6]});
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
        throw std::runtime_error("case " + c.name + " needs world " + std::to_string(c.world) +
                                 ", this torchrun launch has " + std::to_string(torchrun_world));
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

}  // namespace

int main(int argc, char** argv) {
  Args args;
  Flags flags("bench_distributed",
              "[--repetitions R] [--window W] [--frequency F] [--start-step S] [--threads T]\n"
              "       [--grad-pool K] [--batch B] [--comm-repetitions C] [--cases a,b,...]\n"
              "       [--torchrun] [--json PATH] [--label TEXT]\n"
              "cases: single, w1, w2, w4, w2_g64_merged, w2_g64_unmerged");
  flags.add_int("--repetitions", &args.repetitions, 1);
  flags.add_int("--window", &args.window, 1);
  flags.add_int("--frequency", &args.frequency, 2);
  flags.add_int("--start-step", &args.start, 1);
  flags.add_int("--threads", &args.threads, 1);
  flags.add_int("--grad-pool", &args.grad_pool, 1);
  flags.add_int("--batch", &args.batch, 1);
  flags.add_int("--comm-repetitions", &args.comm_repetitions, 1);
  flags.add_string("--cases", &args.cases);
  flags.add_bool("--torchrun", &args.torchrun);
  flags.add_string("--json", &args.json);
  flags.add_string("--label", &args.label);
  flags.parse(argc, argv);
  at::set_num_threads(static_cast<int>(args.threads));

  try {
    c10::intrusive_ptr<c10d::ProcessGroup> torchrun_group;
    if (args.torchrun) torchrun_group = shampoo::init_process_group_from_env();
    const int rank = torchrun_group ? torchrun_group->getRank() : 0;
    const bool report = rank == 0;
    const auto cases = selected_cases(args, torchrun_group ? torchrun_group->getSize() : 0);

    torch::manual_seed(0);  // every rank builds the same model and gradients
    auto model = make_layered_mlp(kLayers, kWidth);
    const auto init = model->parameters();
    const int64_t num_params = numel_of(init);
    const auto pool = make_gradient_pool(model, args.grad_pool, args.batch, kWidth, kWidth);
    const double load_before = load_average();
    const std::string launcher =
        torchrun_group ? "torchrun (one process per rank)" : "threads of one process";
    if (report) {
      std::cout << "bench_distributed: " << layered_mlp_name(kLayers, kWidth) << " (" << num_params
                << " parameters, " << init.size() << " tensors), LibTorch " << TORCH_VERSION << ", "
                << at::get_num_threads() << " thread(s) per rank, ranks as " << launcher << ", CPU "
                << cpu_model() << "\n"
                << "  repetitions " << args.repetitions << ", window " << args.window
                << " steps, precondition_frequency " << args.frequency
                << ", start_preconditioning_step " << args.start << "\n"
                << std::flush;
    }

    // runs[case][repetition]
    std::vector<std::vector<CaseRun>> runs(cases.size());
    const auto run_begin = Clock::now();
    for (int64_t r = 0; r < args.repetitions; ++r) {
      if (report) std::cout << "  repetition " << r + 1 << "/" << args.repetitions << " (ms):";
      for (size_t k = 0; k < cases.size(); ++k) {
        const size_t c = (k + static_cast<size_t>(r)) % cases.size();
        runs[c].push_back(run_case(cases[c], torchrun_group, init, pool, args));
        if (report) {
          std::cout << " " << cases[c].name << " " << std::fixed << std::setprecision(2)
                    << median(runs[c].back().step_ms) << ";" << std::flush;
        }
      }
      if (report) std::cout << "\n" << std::flush;
    }
    const double run_s = elapsed_ms(run_begin, Clock::now()) / 1000.0;
    const double load_after = load_average();
    if (!report) return 0;

    const auto single =
        std::find_if(cases.begin(), cases.end(), [](const CaseSpec& c) { return c.world == 0; });
    const auto single_index = static_cast<size_t>(single - cases.begin());
    struct Row {
      double median_ms = 0;
      double comm_ms = 0;
      double cpu_ms = 0;
      double ratio = 0;  // vs single, median of same-repetition ratios (0: no single case)
      std::vector<double> per_rep;
    };
    std::vector<Row> rows(cases.size());
    for (size_t c = 0; c < cases.size(); ++c) {
      std::vector<double> ratios;
      for (size_t r = 0; r < runs[c].size(); ++r) {
        rows[c].per_rep.push_back(median(runs[c][r].step_ms));
        if (single != cases.end()) {
          ratios.push_back(rows[c].per_rep.back() / median(runs[single_index][r].step_ms));
        }
      }
      rows[c].median_ms = median(rows[c].per_rep);
      std::vector<double> comm, cpu;
      for (const auto& run : runs[c]) {
        comm.push_back(run.comm_ms);
        cpu.push_back(median(run.cpu_ms));
      }
      rows[c].comm_ms = median(comm);
      rows[c].cpu_ms = median(cpu);
      rows[c].ratio = median(ratios);
    }

    std::cout << "\n"
              << std::left << std::setw(17) << "case" << std::right << std::setw(11) << "step ms"
              << std::setw(11) << "/single" << std::setw(10) << "cpu ms" << std::setw(10)
              << "comm ms" << std::setw(8) << "coll." << std::setw(14) << "sent B/step"
              << std::setw(14) << "recv B/step" << std::setw(14) << "state max" << std::setw(14)
              << "state min" << std::setw(14) << "total/world" << std::setw(14) << "blocks"
              << "\n"
              << std::string(151, '-') << "\n";
    for (size_t c = 0; c < cases.size(); ++c) {
      const auto& last = runs[c].back();
      int64_t state_max = 0, state_min = INT64_MAX, state_total = 0, sent = 0, received = 0;
      std::ostringstream owned;
      for (size_t r = 0; r < last.ranks.size(); ++r) {
        const auto& s = last.ranks[r];
        state_max = std::max(state_max, s.state_bytes);
        state_min = std::min(state_min, s.state_bytes);
        state_total += s.state_bytes;
        sent = std::max(sent, s.bytes_sent);
        received = std::max(received, s.bytes_received);
        owned << (r ? "+" : "") << s.owned_blocks;
      }
      std::ostringstream ratio;
      if (single != cases.end())
        ratio << std::fixed << std::setprecision(3) << rows[c].ratio << "x";
      std::cout << std::left << std::setw(17) << cases[c].name << std::right << std::fixed
                << std::setprecision(2) << std::setw(11) << rows[c].median_ms << std::setw(11)
                << ratio.str() << std::setw(10) << rows[c].cpu_ms << std::setw(10)
                << rows[c].comm_ms << std::setw(8) << last.ranks[0].collectives << std::setw(14)
                << sent << std::setw(14) << received << std::setw(14) << state_max << std::setw(14)
                << state_min << std::setw(14)
                << state_total / static_cast<int64_t>(last.ranks.size()) << std::setw(14)
                << owned.str() << "\n";
    }
    std::cout
        << "(step ms: median over repetitions of the median timed step, each step the "
           "slowest rank's; cpu ms: CPU time of the busiest rank's thread in the step (median); "
           "comm ms: the step's AllGathers replayed alone; coll.: "
           "collectives in the last step on rank 0; blocks: owned per rank; virtual groups:";
    for (size_t c = 0; c < cases.size(); ++c) {
      std::cout << " " << cases[c].name << " " << runs[c].back().ranks[0].virtual_groups;
    }
    std::cout << ")\nroot-computation steps timed: ";
    size_t roots = 0;
    for (const auto& case_runs : runs) {
      for (const auto& run : case_runs) roots += run.root_ms.size();
    }
    std::cout << roots << "\n";
    print_timed_section(std::cout, run_s, load_before, load_after);

    if (!args.json.empty()) {
      std::ofstream out(args.json);
      if (!out) {
        std::cerr << "bench_distributed: cannot write " << args.json << "\n";
        return 1;
      }
      out << std::setprecision(6);
      out << "{\n"
          << "  \"benchmark\": \"distributed\",\n"
          << "  \"label\": " << json_string(args.label) << ",\n"
          << "  \"launcher\": " << json_string(launcher) << ",\n"
          << "  \"model\": " << json_string(layered_mlp_name(kLayers, kWidth)) << ",\n"
          << "  \"parameters\": " << num_params << ",\n"
          << "  \"parameter_tensors\": " << init.size() << ",\n"
          << "  \"machine\": " << machine_json(load_before, load_after) << ",\n"
          << "  \"settings\": {\"repetitions\": " << args.repetitions
          << ", \"window\": " << args.window << ", \"precondition_frequency\": " << args.frequency
          << ", \"start_preconditioning_step\": " << args.start
          << ", \"grad_pool\": " << args.grad_pool << ", \"batch\": " << args.batch
          << ", \"comm_repetitions\": " << args.comm_repetitions
          << ", \"shampoo\": {\"lr\": 1e-3, \"betas\": [0.9, 0.999], \"epsilon\": 1e-12, "
             "\"max_preconditioner_dim\": 1024, \"grafting\": \"adam(0.999, 1e-8)\"}},\n"
          << "  \"timed_section_s\": " << run_s << ",\n"
          << "  \"cases\": [";
      for (size_t c = 0; c < cases.size(); ++c) {
        const auto& last = runs[c].back();
        std::vector<int64_t> state, owned, sent, received, collectives;
        for (const auto& s : last.ranks) {
          state.push_back(s.state_bytes);
          owned.push_back(s.owned_blocks);
          sent.push_back(s.bytes_sent);
          received.push_back(s.bytes_received);
          collectives.push_back(s.collectives);
        }
        out << (c ? "," : "") << "\n    {\"name\": " << json_string(cases[c].name)
            << ", \"world\": " << cases[c].world << ", \"param_groups\": " << cases[c].groups
            << ", \"merged\": " << (cases[c].merged ? "true" : "false")
            << ", \"median_ms\": " << rows[c].median_ms
            << ", \"communication_model_ms\": " << rows[c].comm_ms
            << ", \"busiest_rank_thread_cpu_ms\": " << rows[c].cpu_ms;
        if (single != cases.end()) out << ", \"ratio_vs_single\": " << rows[c].ratio;
        out << ", \"per_repetition_ms\": " << json_array(rows[c].per_rep)
            << ", \"virtual_groups\": " << last.ranks[0].virtual_groups
            << ", \"total_blocks\": " << last.ranks[0].total_blocks
            << ", \"collectives_last_step\": " << json_array(collectives)
            << ", \"state_bytes\": " << json_array(state)
            << ", \"owned_blocks\": " << json_array(owned)
            << ", \"bytes_sent_per_step\": " << json_array(sent)
            << ", \"bytes_received_per_step\": " << json_array(received) << "}";
      }
      out << "\n  ]\n}\n";
      std::cout << "\nwrote " << args.json << "\n";
    }
  } catch (const std::exception& e) {
    std::cerr << "bench_distributed: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
