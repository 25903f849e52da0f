/// Full sharding (FullyShardedDataParallel, ZeRO-3) against data parallelism (none), optimizer-
/// state sharding (zero1) and gradient sharding (zero2): what each rank holds between steps, its
/// peak during a training iteration, and the time from the end of backward to the end of the step
/// with the step overlapped in backward and without.
///
/// Workload: the transformer-like parameters of issue 13 (transformer_workload_shapes, 29.4M
/// parameters in 21 tensors, float32; --small divides every dim by 8) in three units: the
/// embedding, then each block's ten tensors. Unit u computes h_u = h_{u-1} + Σ_i sum(W_i ⊙ X_i)
/// with a fixed X_i per rank (the chain makes backward visit the units one after another, as in
/// a deep model); the loss is h_2. Optimizer: torch::optim::Adam (lr 1e-3), or with
/// --optimizer shampoo the benchmarks' Shampoo (roots every 10 steps from step 1).
///   none:  GradientSynchronizer (all-reduce) + the optimizer over every parameter on every rank;
///   zero1: ShardedOptimizer (whole parameters owned by ranks) + the all-reducing synchronizer;
///   zero2: zero1 + sync.shard_gradients(optimizer);
///   full:  FullyShardedDataParallel, lossless, the step overlapped in backward (every step has
///          ended when backward() returns, so the time after backward is ~0: compare whole
///          iterations), each unit's step kept undoable until backward ends (undo_failed_steps);
///   full_no_undo: full without those copies (undo_failed_steps(false));
///   full_after_backward: the same with overlap_step(false): fsdp.step() after backward;
///   distributor: (Shampoo only) the all-reducing synchronizer + one DistributedShampoo over
///          every parameter with the process group (DistributedOptions): blocks owned by ranks,
///          one AllGather per step. The step full sharding's is compared with (issue 45).
///   hybrid: full (overlapped) within shard groups of --shard-group-size consecutive ranks,
///          replicated across them (make_hybrid_groups, FullyShardedOptions::replica_group);
///   hybrid_split: hybrid with each parameter stepped (its state kept) by one replica
///          (FullyShardedOptions::split_across_replicas).
/// Roots: with Shampoo, the amortized computations (one per block and dim) of the warm-up
/// iteration, a precondition step, and the batched calls that made them (ShampooStats), summed
/// over this rank's optimizers: one call per stack of equal block shapes and dim when one
/// optimizer holds the blocks, one per parameter and dim with an optimizer per parameter.
/// Per mode, alone in the process: one warm-up iteration, then --steps measured ones. Per rank:
/// "held": the tracking allocator's live bytes after the iteration (parameters, gradients, state,
/// buffers: everything the mode keeps between steps) above what the process held before the mode
/// was built, the least over the measured iterations (Gloo's threads drop their references to a
/// collective's tensors a little after wait() returns, so one reading may still count one); "peak":
/// its peak during the iteration, same base; the median ms from the end of backward to the end of
/// the step, and of the whole iteration.
///
/// The bounds of issue 27, printed per rank for full: held ≤ none's held / world × 1.1 (none's
/// held is the world-1 figure: every rank of plain data parallelism holds the same), and
/// peak ≤ held + 2 × (largest unit's parameters + gradients); for hybrid (issue 45) held ≤
/// none's held / shard group size × 1.1.
///
/// Ranks: one rank of a torchrun launch (--torchrun: every rank's own allocator; rank 0 prints
/// every rank's figures), or threads of this process (--world N; the allocator is then shared,
/// so its figures are the process's).
///
///   bench_fully_sharded [--torchrun | --world 2] [--steps 3] [--optimizer adam|shampoo]
///                       [--modes none,zero1,zero2,full,full_no_undo,full_after_backward,
///                                distributor,hybrid,hybrid_split] [--shard-group-size 2]
///                       [--small]
///                       [--threads 1] [--json PATH] [--label TEXT]
/// Results and how to read them: benchmarks/RESULTS.md ("Full sharding").

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <shampoo/shampoo.h>
#include <torch/optim/adam.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "benchmarks/bench_support.h"
#include "benchmarks/tracking_allocator.h"

namespace {

using namespace shampoo::bench;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

const std::vector<std::string> kModes{"none",        "zero1",        "zero2",
                                      "full",        "full_no_undo", "full_after_backward",
                                      "distributor", "hybrid",       "hybrid_split"};

struct Args {
  int64_t world = 2;
  bool torchrun = false;
  int64_t steps = 3;
  std::string optimizer = "adam";
  std::string modes = "none,zero1,zero2,full,full_no_undo,full_after_backward";
  bool small = false;
  int64_t threads = 1;
  int64_t shard_group_size = 2;
  std::string json;
  std::string label;
};

/// One rank's figures of one mode.
struct Figures {
  int64_t held = 0;
  int64_t peak = 0;
  double after_backward_ms = 0;  // end of backward to end of step
  double iteration_ms = 0;
  int64_t root_computations = 0;  // in the warm-up iteration (a precondition step)
  int64_t root_calls = 0;         // the batched calls that made them
};

shampoo::GroupOptimizerFactory factory_of(const Args& args) {
  if (args.optimizer == "adam") {
    return shampoo::group_optimizer_factory<torch::optim::Adam>(torch::optim::AdamOptions(1e-3));
  }
  return shampoo::group_optimizer_factory<shampoo::DistributedShampoo>(shampoo_options(10, 1));
}

/// The workload's units: the embedding, then each block's ten tensors.
std::vector<std::vector<size_t>> unit_members(size_t count) {
  std::vector<std::vector<size_t>> units{{0}};
  for (size_t first = 1; first < count; first += 10) {
    std::vector<size_t> unit;
    for (size_t i = first; i < std::min(count, first + 10); ++i) unit.push_back(i);
    units.push_back(unit);
  }
  return units;
}

/// The mode's training iteration over `params`, and the optimizer bookkeeping it needs.
struct ModeRun {
  std::unique_ptr<shampoo::GradientSynchronizer> sync;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::unique_ptr<shampoo::FullyShardedDataParallel> fsdp;
  bool overlap = false;
};

ModeRun make_mode(const std::string& mode, const std::vector<at::Tensor>& params,
                  const std::vector<std::vector<size_t>>& members, const Group& group,
                  const Args& args) {
  ModeRun run;
  const auto factory = factory_of(args);
  if (mode == "full" || mode == "full_no_undo" || mode == "full_after_backward" ||
      mode == "hybrid" || mode == "hybrid_split") {
    std::vector<shampoo::ShardedUnit> units;
    for (size_t u = 0; u < members.size(); ++u) {
      shampoo::ShardedUnit unit{std::to_string(u), {}};
      for (const auto i : members[u]) unit.params.push_back(params[i]);
      units.push_back(unit);
    }
    run.overlap = mode != "full_after_backward";
    auto options = shampoo::FullyShardedOptions()
                       .overlap_step(run.overlap)
                       .undo_failed_steps(mode != "full_no_undo");
    auto shard_group = group;
    if (mode == "hybrid" || mode == "hybrid_split") {
      const auto hybrid = shampoo::make_hybrid_groups(group, args.shard_group_size);
      shard_group = hybrid.shard;
      options.replica_group(hybrid.replica).split_across_replicas(mode == "hybrid_split");
    }
    run.fsdp =
        std::make_unique<shampoo::FullyShardedDataParallel>(units, factory, shard_group, options);
    return run;
  }
  run.sync = std::make_unique<shampoo::GradientSynchronizer>(params, group);
  if (mode == "distributor") {
    run.optimizer = std::make_unique<shampoo::DistributedShampoo>(
        params, shampoo_options(10, 1), shampoo::DistributedOptions().process_group(group));
  } else if (mode == "none") {
    run.optimizer = factory(torch::optim::OptimizerParamGroup(params));
  } else {
    auto sharded = std::make_unique<shampoo::ShardedOptimizer>(params, factory, group);
    if (mode == "zero2") run.sync->shard_gradients(*sharded);
    run.optimizer = std::move(sharded);
  }
  return run;
}

/// This rank's Shampoo counters (amortized computations, batched calls), over its optimizers.
std::pair<int64_t, int64_t> root_counters(ModeRun& run) {
  std::vector<torch::optim::Optimizer*> optimizers;
  if (run.fsdp) {
    optimizers = run.fsdp->optimizers();
  } else if (auto* sharded = dynamic_cast<shampoo::ShardedOptimizer*>(run.optimizer.get())) {
    optimizers.push_back(&sharded->local_optimizer());
  } else {
    optimizers.push_back(run.optimizer.get());
  }
  std::pair<int64_t, int64_t> sum{0, 0};
  for (auto* optimizer : optimizers) {
    if (const auto* shampoo = dynamic_cast<const shampoo::DistributedShampoo*>(optimizer)) {
      sum.first += shampoo->stats().amortized_computations;
      sum.second += shampoo->stats().amortized_batched_calls;
    }
  }
  return sum;
}

/// One iteration; returns the ms from the end of backward to the end of the step.
double iterate(ModeRun& run, const std::vector<at::Tensor>& params,
               const std::vector<at::Tensor>& inputs,
               const std::vector<std::vector<size_t>>& members) {
  if (run.optimizer) run.optimizer->zero_grad();
  at::Tensor h = at::zeros({});
  for (size_t u = 0; u < members.size(); ++u) {
    const auto unit_forward = [&] {
      at::Tensor out = h;
      for (const auto i : members[u]) out = out + (params[i] * inputs[i]).sum();
      return out;
    };
    h = run.fsdp ? run.fsdp->forward(u, unit_forward) : unit_forward();
  }
  h.backward();
  const auto end_of_backward = Clock::now();
  if (run.fsdp && run.overlap) {
    run.fsdp->wait();  // the steps ran on the worker during backward (ended with it)
  } else if (run.fsdp) {
    run.fsdp->step();
  } else {
    run.sync->synchronize();
    run.optimizer->step();
  }
  return elapsed_ms(end_of_backward, Clock::now());
}

Figures run_mode(const std::string& mode, int rank, const Group& group, const Args& args,
                 TrackingAllocator* tracker) {
  const auto shapes = transformer_workload_shapes(args.small ? 8 : 1);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + rank);
  std::vector<at::Tensor> inputs;
  for (const auto& s : shapes) inputs.push_back(at::randn(s, gen));
  const auto members = unit_members(shapes.size());
  barrier(group);
  const int64_t baseline = tracker != nullptr ? tracker->live() : 0;
  Figures f;
  {
    auto weights = at::make_generator<at::CPUGeneratorImpl>(7);
    std::vector<at::Tensor> params;
    for (const auto& s : shapes) params.push_back((at::randn(s, weights) * 0.02).requires_grad_());
    auto run = make_mode(mode, params, members, group, args);
    std::vector<double> after_backward, iteration;
    for (int64_t s = 0; s <= args.steps; ++s) {
      barrier(group);
      if (tracker != nullptr) tracker->reset_peak();
      const auto start = Clock::now();
      const double tail = iterate(run, params, inputs, members);
      const double total = elapsed_ms(start, Clock::now());
      if (s == 0) {  // warm-up: creates the optimizer's state, computes the first roots
        std::tie(f.root_computations, f.root_calls) = root_counters(run);
        continue;
      }
      after_backward.push_back(tail);
      iteration.push_back(total);
      if (tracker != nullptr) {
        const int64_t held = tracker->live() - baseline;
        f.held = iteration.size() == 1 ? held : std::min(f.held, held);
        f.peak = std::max(f.peak, tracker->peak() - baseline);
      }
    }
    f.after_backward_ms = median(after_backward);
    f.iteration_ms = median(iteration);
  }
  return f;
}

std::vector<std::string> selected_modes(const Args& args) {
  std::vector<std::string> out;
  std::stringstream list(args.modes);
  std::string mode;
  while (std::getline(list, mode, ',')) {
    if (std::find(kModes.begin(), kModes.end(), mode) == kModes.end()) {
      fmt::print(stderr, "bench_fully_sharded: --modes: unknown mode '{}'; the modes are {}\n",
                 mode, fmt::join(kModes, ", "));
      std::exit(2);
    }
    out.push_back(mode);
  }
  return out;
}

std::string mb(int64_t bytes) { return fmt::format("{:.1f}", static_cast<double>(bytes) / 1e6); }

/// Bytes of the largest unit's parameters.
int64_t largest_unit_bytes(const Args& args) {
  const auto shapes = transformer_workload_shapes(args.small ? 8 : 1);
  int64_t largest = 0;
  for (const auto& unit : unit_members(shapes.size())) {
    int64_t bytes = 0;
    for (const auto i : unit) bytes += c10::multiply_integers(shapes[i]) * 4;
    largest = std::max(largest, bytes);
  }
  return largest;
}

/// results[mode][rank]
using Results = std::vector<std::vector<Figures>>;

void print_results(const Results& results, const std::vector<std::string>& modes, int world,
                   const Args& args, bool per_rank_allocator) {
  const int64_t unit_bytes = largest_unit_bytes(args);
  fmt::print(
      "bench_fully_sharded: transformer-like workload{} in 3 units (largest {} MB), {}, world {} "
      "as {}, {} step(s) per mode\n",
      args.small ? " (small)" : "", mb(unit_bytes), args.optimizer, world,
      args.torchrun ? "torchrun processes" : "threads", args.steps);
  fmt::print(
      "| mode | rank | held MB | peak MB | end of backward to end of step ms | iteration ms | "
      "roots (batched calls) |\n");
  fmt::print("|---|---:|---:|---:|---:|---:|---:|\n");
  const auto none = std::find(modes.begin(), modes.end(), "none");
  for (size_t m = 0; m < modes.size(); ++m) {
    for (int rank = 0; rank < world; ++rank) {
      const auto& f = results[m][rank];
      std::string verdict;
      const bool hybrid = modes[m].rfind("hybrid", 0) == 0;
      const bool sharded = modes[m].rfind("full", 0) == 0 || hybrid;
      if (per_rank_allocator && sharded && none != modes.end()) {
        const auto& plain = results[none - modes.begin()][rank];
        // Hybrid shards over its shard group only.
        const int64_t shards = hybrid ? args.shard_group_size : world;
        const double held_bound = static_cast<double>(plain.held) / shards * 1.1;
        const double peak_bound = static_cast<double>(f.held + 4 * unit_bytes);
        verdict = fmt::format(" (held {} bound {} MB; peak {} bound {} MB)",
                              f.held <= held_bound ? "within" : "ABOVE", mb(held_bound),
                              f.peak <= peak_bound ? "within" : "ABOVE",
                              mb(static_cast<int64_t>(peak_bound)));
      }
      fmt::print("| {} | {} | {} | {} | {:.1f} | {:.1f} | {} ({}) |{}\n", modes[m], rank,
                 per_rank_allocator ? mb(f.held) : "-", per_rank_allocator ? mb(f.peak) : "-",
                 f.after_backward_ms, f.iteration_ms, f.root_computations, f.root_calls, verdict);
    }
  }
}

Json results_json(const Results& results, const std::vector<std::string>& modes, int world) {
  Json out = Json::object();
  for (size_t m = 0; m < modes.size(); ++m) {
    Json ranks = Json::array();
    for (int rank = 0; rank < world; ++rank) {
      const auto& f = results[m][rank];
      ranks.push_back({{"rank", rank},
                       {"held_bytes", f.held},
                       {"peak_bytes", f.peak},
                       {"after_backward_ms", f.after_backward_ms},
                       {"iteration_ms", f.iteration_ms},
                       {"root_computations", f.root_computations},
                       {"root_batched_calls", f.root_calls}});
    }
    out[modes[m]] = ranks;
  }
  return out;
}

std::vector<int64_t> to_ints(const Figures& f) {
  return {f.held,
          f.peak,
          static_cast<int64_t>(f.after_backward_ms * 1000),
          static_cast<int64_t>(f.iteration_ms * 1000),
          f.root_computations,
          f.root_calls};
}

Figures from_ints(const std::vector<int64_t>& v) {
  return {v[0], v[1], static_cast<double>(v[2]) / 1000, static_cast<double>(v[3]) / 1000,
          v[4], v[5]};
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  Flags flags("bench_fully_sharded",
              "Full sharding (ZeRO-3) against none, ZeRO-1 and ZeRO-2: bytes held per rank, peak, "
              "and the step's tail after backward with and without overlap");
  flags.add("world", args.world, "ranks as threads (not with --torchrun)", 1)
      .add_bool("torchrun", args.torchrun,
                "this process is one rank of a torchrun launch (WORLD_SIZE ranks)")
      .add("steps", args.steps, "measured iterations per mode", 1)
      .add("optimizer", args.optimizer, "adam or shampoo")
      .add("modes", args.modes,
           "comma-separated: none, zero1, zero2, full, full_no_undo, full_after_backward, "
           "distributor (Shampoo only), hybrid (full sharding within shard groups of "
           "--shard-group-size ranks, replicated across them), hybrid_split (hybrid, each "
           "parameter's state on one replica)")
      .add_bool("small", args.small, "every dim of the workload divided by 8")
      .add("threads", args.threads, "intra-op threads per rank", 1)
      .add("shard-group-size", args.shard_group_size,
           "hybrid: ranks per shard group (the world a multiple of it)", 1);
  add_output_flags(flags, args.json, args.label);
  parse_flags_or_exit(flags, "bench_fully_sharded", argc, argv);
  if (args.optimizer != "adam" && args.optimizer != "shampoo") {
    fmt::print(stderr, "bench_fully_sharded: --optimizer: got '{}', expected adam or shampoo\n",
               args.optimizer);
    return 2;
  }
  const auto modes = selected_modes(args);
  if (args.optimizer != "shampoo" &&
      std::find(modes.begin(), modes.end(), "distributor") != modes.end()) {
    fmt::print(stderr,
               "bench_fully_sharded: --modes: distributor is Shampoo's Distributor; "
               "add --optimizer shampoo\n");
    return 2;
  }

  auto& tracker = TrackingAllocator::install();
  const double load_before = load_average();
  const auto start = Clock::now();
  Results results(modes.size());
  std::mutex mutex;
  int world = static_cast<int>(args.world);
  bool lead = true;
  const auto run_rank = [&](int rank, const Group& group, TrackingAllocator* per_rank) {
    at::set_num_threads(static_cast<int>(args.threads));
    for (size_t m = 0; m < modes.size(); ++m) {
      const auto mine = run_mode(modes[m], rank, group, args, per_rank);
      const auto all = gather_from_ranks(group, to_ints(mine));
      if (rank != 0) continue;
      std::lock_guard<std::mutex> lock(mutex);
      for (const auto& row : all) results[m].push_back(from_ints(row));
    }
  };
  if (args.torchrun) {
    auto group = shampoo::init_process_group_from_env();
    world = group->getSize();
    run_rank(group->getRank(), group, &tracker);
    lead = group->getRank() == 0;
  } else {
    // One allocator for every thread: its figures are not per rank.
    run_ranks_as_threads(world, static_cast<int>(args.threads),
                         [&](int rank, const Group& group) { run_rank(rank, group, nullptr); });
  }
  if (!lead) return 0;
  const double load_after = load_average();
  print_results(results, modes, world, args, args.torchrun);
  print_timed_section(std::chrono::duration<double>(Clock::now() - start).count(), load_before,
                      load_after);
  if (args.json.empty()) return 0;
  const Json json{{"benchmark", "bench_fully_sharded"},
                  {"label", args.label},
                  {"machine", machine_json(load_before, load_after)},
                  {"ranks_as", args.torchrun ? "torchrun processes" : "threads"},
                  {"world", world},
                  {"optimizer", args.optimizer},
                  {"steps", args.steps},
                  {"small", args.small},
                  {"largest_unit_bytes", largest_unit_bytes(args)},
                  {"modes", results_json(results, modes, world)}};
  return write_json(args.json, json, "bench_fully_sharded") ? 0 : 1;
}
