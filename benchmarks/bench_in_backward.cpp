/// Optimizer-in-backward and sharded optimizer state: memory and time of a training step with
/// and without shampoo::apply_optimizer_in_backward, and optimizer-state bytes per rank of
/// shampoo::ShardedOptimizer.
///
/// Model: wide MLP 1024-2048-2048-2048-2048-2048-2048-2048-10 (ReLU): 27,297,802 parameters in
/// 16 tensors (six 2048x2048 weights of 16 MiB each); batch 32, so gradients (104 MiB) are a
/// large share of a step's memory and activations a small one.
///
/// Parts:
///   (a, b) memory, each variant alone in the process (built, one warm-up step that creates the
///          optimizer state, then one measured step): gradient bytes alive when loss.backward()
///          returns (sum of nbytes of the defined .grad()), and the allocator's live and peak
///          bytes over the step (forward + backward + step; in-backward: forward + backward),
///          from a resting state without gradients (the ordinary variant's zero_grad(), which
///          frees them, runs just before). Peaks are reported above what the process held before
///          the variant was built, i.e. the variant's own footprint. Measured by a tracking CPU
///          allocator installed at start-up around LibTorch's default one (c10::SetCPUAllocator):
///          it counts tensor storage, not MKL's or Gloo's private buffers. Variants:
///          torch::optim::Adam and, in backward, the same Adam per parameter; DistributedShampoo
///          (Adam grafting, max_preconditioner_dim 1024, first root computation at step 2, measured
///          step 3 preconditioned) both ways unless --no-shampoo.
///   (c)    time of a training step, Adam ordinary vs Adam in backward, both alive, steps
///          alternating one by one; medians per repetition and their same-repetition ratio.
///   (d)    shampoo::ShardedOptimizer (Adam inside) at world 1, 2, 4, ranks as threads of this
///          process (Gloo over loopback): optimizer-state bytes per rank (ShardedOptimizer::
///          state_bytes after a step) against the unsharded Adam, and the step time (slowest
///          rank, median of --sharded-steps steps after one warm-up step; and the CPU time of the
///          busiest rank's thread, which excludes Gloo's transfer threads and waiting; and the
///          step's one AllGather replayed alone on buffers of the same size).
///
///   bench_in_backward [--repetitions 5] [--window 4] [--threads 1] [--batch 32]
///                     [--sharded-steps 5] [--no-shampoo] [--peak-breakdown] [--json PATH]
///                     [--label TEXT]
/// --peak-breakdown: after each variant's measured step, one more step tags every allocation
/// with the top-level ATen operator that made it (at::RecordFunction) and prints the live bytes
/// at the step's peak by operator: where a step's transient memory comes from.
/// Results and how to read them: benchmarks/RESULTS.md.

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <shampoo/shampoo.h>
#include <torch/nn.h>
#include <torch/optim.h>
#include <torch/types.h>
#include <torch/utils.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "benchmarks/bench_support.h"
#include "benchmarks/op_observer.h"
#include "benchmarks/tracking_allocator.h"

namespace {

using namespace shampoo::bench;

constexpr int64_t kLayerSizes[] = {1024, 2048, 2048, 2048, 2048, 2048, 2048, 2048, 10};

struct Args {
  int64_t repetitions = 5;
  int64_t window = 4;  // timed steps of each variant per repetition
  int64_t threads = 1;
  int64_t batch = 32;
  int64_t sharded_steps = 5;
  bool no_shampoo = false;
  bool peak_breakdown = false;
  std::string json;
  std::string label;
};

// ---- model --------------------------------------------------------------------------------------

/// A fresh model with a copy of the parameters `init`.
torch::nn::Sequential make_model(const std::vector<at::Tensor>& init) {
  auto model = make_mlp(kLayerSizes);
  torch::NoGradGuard no_grad;
  const auto params = model->parameters();
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(init[i]);
  return model;
}

struct Batch {
  at::Tensor x, y;
};

/// A model (own copy of the initial parameters) with its optimizer, ordinary or in backward.
struct Subject {
  std::string name;
  torch::nn::Sequential model;
  std::unique_ptr<torch::optim::Optimizer> optimizer;  // ordinary
  std::unique_ptr<shampoo::InBackwardOptimizer> in_backward;
  int64_t steps = 0;
};

using Factory = shampoo::OptimizerFactory;

Factory adam_factory() {
  return [](std::vector<at::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::Adam>(
        std::move(p), torch::optim::AdamOptions(1e-3).betas(std::make_tuple(0.9, 0.999)));
  };
}

/// `undo_in_backward`: DistributedOptions::undo_in_backward (in backward, the undo journal).
Factory shampoo_factory(bool undo_in_backward = true) {
  return [undo_in_backward](std::vector<at::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<shampoo::DistributedShampoo>(
        std::move(p), shampoo_options(/*frequency=*/1000, /*start=*/2),
        shampoo::DistributedOptions().undo_in_backward(undo_in_backward));
  };
}

Subject make_subject(const std::string& name, const std::vector<at::Tensor>& init,
                     const Factory& factory, bool in_backward) {
  Subject s;
  s.name = name;
  s.model = make_model(init);
  if (in_backward) {
    s.in_backward = std::make_unique<shampoo::InBackwardOptimizer>(
        shampoo::apply_optimizer_in_backward(s.model->parameters(), factory));
  } else {
    s.optimizer = factory(s.model->parameters());
  }
  return s;
}

/// Bytes of the optimizer state of a subject (LibTorch optimizer or DistributedShampoo).
int64_t state_bytes(Subject& s) {
  torch::optim::Optimizer& opt = s.optimizer ? *s.optimizer : s.in_backward->optimizer(0);
  if (const auto* shampoo = dynamic_cast<const shampoo::DistributedShampoo*>(&opt)) {
    return shampoo->stats().state_bytes;
  }
  return shampoo::optimizer_state_bytes(opt);
}

/// What one training step did to memory.
struct StepMemory {
  int64_t live_start = 0;   // live bytes when the step began (after zero_grad)
  int64_t grads_alive = 0;  // bytes of defined gradients when loss.backward() returned
  int64_t live_after_backward = 0;
  int64_t peak_to_backward = 0;  // peak from the step's start to the end of backward
  int64_t peak = 0;              // peak over the whole step
  int64_t live_end = 0;
  double ms = 0;
};

/// One training step; with a tracker, its memory too.
StepMemory train_step(Subject& s, const Batch& batch, TrackingAllocator* tracker) {
  StepMemory m;
  const auto begin = Clock::now();
  if (s.optimizer) s.optimizer->zero_grad();  // frees the gradients (set_to_none)
  if (tracker != nullptr) {
    tracker->reset_peak();
    m.live_start = tracker->live();
  }
  auto loss = torch::nn::functional::cross_entropy(s.model->forward(batch.x), batch.y);
  loss.backward();
  if (tracker != nullptr) {
    m.peak_to_backward = tracker->peak();
    m.live_after_backward = tracker->live();
    int64_t grads = 0;
    for (const auto& p : s.model->parameters()) {
      if (p.grad().defined()) grads += static_cast<int64_t>(p.grad().nbytes());
    }
    m.grads_alive = grads;
  }
  if (s.optimizer) s.optimizer->step();
  loss = at::Tensor();
  m.ms = elapsed_ms(begin, Clock::now());
  if (tracker != nullptr) {
    m.peak = tracker->peak();
    m.live_end = tracker->live();
  }
  ++s.steps;
  return m;
}

struct MemoryRow {
  std::string name;
  StepMemory step;
  TrackingAllocator::ByOp at_peak;  // --peak-breakdown: live bytes at the peak of a step
  int64_t state = 0;
  int64_t live_before_build = 0;
  int64_t live_after_teardown = 0;
};

/// Builds the subject alone, runs `warm` untimed steps, measures the next one, tears it down.
/// With `breakdown`, one more step runs with allocations tagged by operator and the live
/// allocations at its peak are kept.
MemoryRow measure_memory(const std::string& name, const std::vector<at::Tensor>& init,
                         const Factory& factory, bool in_backward, const Batch& batch, int64_t warm,
                         TrackingAllocator& tracker, bool breakdown) {
  MemoryRow row;
  row.name = name;
  row.live_before_build = tracker.live();
  {
    auto s = make_subject(name, init, factory, in_backward);
    for (int64_t i = 0; i < warm; ++i) train_step(s, batch, nullptr);
    row.step = train_step(s, batch, &tracker);
    row.state = state_bytes(s);
    if (breakdown) {
      if (s.optimizer) s.optimizer->zero_grad();
      OpObserver tagger;  // tags allocations with their top-level operator
      tracker.set_snapshot_at_peak(true);
      train_step(s, batch, &tracker);
      row.at_peak = tracker.snapshot();
      tracker.set_snapshot_at_peak(false);
    }
  }
  row.live_after_teardown = tracker.live();
  return row;
}

int64_t row_base(const std::vector<MemoryRow>& rows) {
  return rows.empty() ? 0 : rows.front().live_before_build;
}

// ---- sharded optimizer --------------------------------------------------------------------------

struct ShardedRow {
  int world = 1;
  std::vector<int64_t> state_bytes;   // per rank
  std::vector<int64_t> owned_params;  // parameters (tensors) per rank
  std::vector<int64_t> owned_numel;   // elements per rank
  double step_ms = 0;                 // median, slowest rank
  double cpu_ms = 0;                  // median, CPU time of the busiest rank's thread
  double comm_ms = 0;                 // the step's AllGather replayed alone, median
};

ShardedRow measure_sharded(int world, const std::vector<at::Tensor>& init,
                           const std::vector<at::Tensor>& grads, const Args& args) {
  ShardedRow row;
  row.world = world;
  std::vector<double> rank0_ms, rank0_cpu;
  std::mutex mutex;
  run_ranks_as_threads(
      world, static_cast<int>(args.threads),
      [&](int rank, const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
        const auto params = clone_params(init);
        shampoo::ShardedOptimizer optimizer(
            params,
            shampoo::group_optimizer_factory<torch::optim::Adam>(
                torch::optim::AdamOptions(1e-3).betas(std::make_tuple(0.9, 0.999))),
            group);
        std::vector<double> ms, cpu;
        for (int64_t i = 0; i <= args.sharded_steps; ++i) {
          set_gradients(params, grads);
          barrier(group);
          const double cpu_begin = thread_cpu_ms();
          const auto begin = Clock::now();
          optimizer.step();
          const double t = max_over_ranks(group, elapsed_ms(begin, Clock::now()));
          const double c = max_over_ranks(group, thread_cpu_ms() - cpu_begin);
          if (i > 0) {  // the first step creates the state
            ms.push_back(t);
            cpu.push_back(c);
          }
        }
        int64_t count = 0, numel = 0;
        for (size_t k = 0; k < params.size(); ++k) {
          if (optimizer.owners()[k] == rank) {
            ++count;
            numel += params[k].numel();
          }
        }
        const auto all = gather_from_ranks(group, {optimizer.state_bytes(), count, numel});
        // Communication model: one AllGather of the same size as the optimizer's (segment = the
        // largest rank's elements), on buffers of its own, timed like the steps.
        int64_t segment = 0;
        for (const auto& v : all) segment = std::max(segment, v[2]);
        auto send = at::zeros({segment});
        auto receive = at::zeros({segment * world});
        std::vector<double> comm;
        for (int64_t i = 0; i <= args.sharded_steps; ++i) {
          barrier(group);
          const auto begin = Clock::now();
          group->getBackend(c10::DeviceType::CPU)->_allgather_base(receive, send)->wait();
          const double t = max_over_ranks(group, elapsed_ms(begin, Clock::now()));
          if (i > 0) comm.push_back(t);  // the first one, like the first step, is not counted
        }
        if (rank == 0) {
          std::lock_guard<std::mutex> lock(mutex);
          for (const auto& v : all) {
            row.state_bytes.push_back(v[0]);
            row.owned_params.push_back(v[1]);
            row.owned_numel.push_back(v[2]);
          }
          rank0_ms = ms;
          rank0_cpu = cpu;
          row.comm_ms = median(comm);
        }
      });
  row.step_ms = median(rank0_ms);
  row.cpu_ms = median(rank0_cpu);
  return row;
}

Args parse_args(int argc, char** argv) {
  Args args;
  Flags flags("bench_in_backward",
              "Memory and time of a training step with and without optimizer-in-backward, and "
              "optimizer-state bytes per rank of ShardedOptimizer (benchmarks/RESULTS.md).");
  flags.add("repetitions", args.repetitions, "repetitions of the time section (c)", 1)
      .add("window", args.window, "timed steps of each variant per repetition", 1)
      .add("threads", args.threads, "intra-op threads (per rank)", 1)
      .add("batch", args.batch, "batch size", 1)
      .add("sharded-steps", args.sharded_steps, "timed steps of ShardedOptimizer per world", 1)
      .add_bool("no-shampoo", args.no_shampoo, "measure the memory of Adam only")
      .add_bool("peak-breakdown", args.peak_breakdown,
                "print the live bytes at each variant's peak by allocating top-level operator");
  add_output_flags(flags, args.json, args.label);
  parse_flags_or_exit(flags, "bench_in_backward", argc, argv);
  return args;
}

/// (a, b) memory, each variant alone.
std::vector<MemoryRow> measure_memory_rows(const std::vector<at::Tensor>& init, const Batch& batch,
                                           TrackingAllocator& tracker, const Args& args) {
  std::vector<MemoryRow> memory;
  memory.push_back(
      measure_memory("adam", init, adam_factory(), false, batch, 1, tracker, args.peak_breakdown));
  memory.push_back(measure_memory("adam in backward", init, adam_factory(), true, batch, 1, tracker,
                                  args.peak_breakdown));
  if (!args.no_shampoo) {
    // Step 1 grafting only, step 2 the first root computation, step 3 measured.
    memory.push_back(measure_memory("shampoo", init, shampoo_factory(), false, batch, 2, tracker,
                                    args.peak_breakdown));
    memory.push_back(measure_memory("shampoo in backward", init, shampoo_factory(), true, batch, 2,
                                    tracker, args.peak_breakdown));
    memory.push_back(measure_memory("shampoo in bwd, no undo", init,
                                    shampoo_factory(/*undo_in_backward=*/false), true, batch, 2,
                                    tracker, args.peak_breakdown));
  }
  return memory;
}

void print_memory(const std::vector<MemoryRow>& memory, int64_t param_bytes) {
  fmt::print(
      "\n(a, b) memory of one training step, each variant alone (bytes):\n"
      "{:<22}{:>14}{:>14}{:>14}{:>14}{:>16}{:>14}{:>9}\n{:-<117}\n",
      "variant", "grads alive", "resting", "peak", "peak-resting", "bwd peak-rest.", "opt. state",
      "step ms", "");
  for (const auto& row : memory) {
    const auto& m = row.step;
    const int64_t base = row.live_before_build;
    fmt::print("{:<22}{:>14}{:>14}{:>14}{:>14}{:>16}{:>14}{:>9.1f}\n", row.name, m.grads_alive,
               m.live_start - base, m.peak - base, m.peak - m.live_start,
               m.peak_to_backward - m.live_start, row.state, m.ms);
  }
  fmt::print(
      "(grads alive: when loss.backward() returned; resting: the variant's live bytes "
      "before the step (parameters + optimizer state), peak: its high-water mark during the "
      "step, both above the {} bytes the process held before it was built; bwd peak-rest.: "
      "the same up to the end of loss.backward(); parameters {} bytes)\n"
      "live bytes before build / after teardown:",
      row_base(memory), param_bytes);
  for (const auto& row : memory) {
    fmt::print(" {} {}/{};", row.name, row.live_before_build, row.live_after_teardown);
  }
  fmt::print("\n");
  std::fflush(stdout);
}

void print_peak_breakdown(const std::vector<MemoryRow>& memory) {
  for (const auto& row : memory) {
    std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>> ops(row.at_peak.begin(),
                                                                         row.at_peak.end());
    std::sort(ops.begin(), ops.end(),
              [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
    int64_t total = 0;
    for (const auto& op : ops) total += op.second.first;
    fmt::print("live bytes at the peak of a {} step by allocating top-level operator (total {}):\n",
               row.name, total);
    for (const auto& [op, bytes] : ops) {
      if (bytes.first < 1000000) continue;
      fmt::print("  {:<34}{:>14} in {} allocations\n",
                 op.empty() ? "(before the step / no operator)" : op, bytes.first, bytes.second);
    }
  }
  std::fflush(stdout);
}

/// (c) medians per repetition: Adam ordinary, Adam in backward, their ratio.
struct TimeRows {
  std::vector<double> ordinary, in_backward, ratio;
};

/// (c) time, Adam ordinary vs in backward, both alive, steps alternating one by one.
TimeRows measure_time(const std::vector<at::Tensor>& init, const Batch& batch, const Args& args) {
  TimeRows t;
  auto ordinary = make_subject("adam", init, adam_factory(), false);
  auto in_backward = make_subject("adam in backward", init, adam_factory(), true);
  train_step(ordinary, batch, nullptr);  // warm-up: creates the state
  train_step(in_backward, batch, nullptr);
  for (int64_t r = 0; r < args.repetitions; ++r) {
    std::vector<double> a, b;
    for (int64_t w = 0; w < args.window; ++w) {
      if ((w + r) % 2 == 0) {
        a.push_back(train_step(ordinary, batch, nullptr).ms);
        b.push_back(train_step(in_backward, batch, nullptr).ms);
      } else {
        b.push_back(train_step(in_backward, batch, nullptr).ms);
        a.push_back(train_step(ordinary, batch, nullptr).ms);
      }
    }
    t.ordinary.push_back(median(a));
    t.in_backward.push_back(median(b));
    t.ratio.push_back(t.in_backward.back() / t.ordinary.back());
    fmt::print("  (c) repetition {}/{}: adam {:.1f} ms, in backward {:.1f} ms\n", r + 1,
               args.repetitions, t.ordinary.back(), t.in_backward.back());
    std::fflush(stdout);
  }
  // Same parameters after the same steps: in-backward Adam equals ordinary Adam.
  const auto pa = ordinary.model->parameters();
  const auto pb = in_backward.model->parameters();
  bool same = true;
  for (size_t i = 0; i < pa.size(); ++i) same &= at::equal(pa[i], pb[i]);
  fmt::print("  (c) parameters of the two after {} steps bit-identical: {}\n", ordinary.steps,
             same ? "yes" : "NO");
  fmt::print(
      "\n(c) training step time (forward + backward + Adam), median ms:\n  adam {:.2f}, "
      "adam in backward {:.2f}, ratio in backward / ordinary {:.3f}x\n",
      median(t.ordinary), median(t.in_backward), median(t.ratio));
  std::fflush(stdout);
  return t;
}

/// Gradients of one forward/backward pass of the model on `batch`.
std::vector<at::Tensor> one_pass_gradients(const std::vector<at::Tensor>& init,
                                           const Batch& batch) {
  auto model = make_model(init);
  torch::nn::functional::cross_entropy(model->forward(batch.x), batch.y).backward();
  std::vector<at::Tensor> grads;
  for (const auto& p : model->parameters()) grads.push_back(p.grad().detach().clone());
  return grads;
}

void print_sharded(const std::vector<ShardedRow>& sharded, int64_t unsharded_state) {
  fmt::print(
      "\n(d) ShardedOptimizer (Adam inside), state bytes per rank; unsharded Adam {}:\n"
      "{:<7}{:>14}{:>14}{:>14}{:>10}{:>14}{:>12}{:>10}{:>10}{:>10}\n{:-<115}\n",
      unsharded_state, "world", "max/rank", "min/rank", "total/world", "max/ideal", "sum",
      "tensors", "step ms", "cpu ms", "comm ms", "");
  for (const auto& row : sharded) {
    int64_t sum = 0;
    for (const int64_t bytes : row.state_bytes) sum += bytes;
    const auto mx = *std::max_element(row.state_bytes.begin(), row.state_bytes.end());
    const auto mn = *std::min_element(row.state_bytes.begin(), row.state_bytes.end());
    const double ideal = static_cast<double>(unsharded_state) / row.world;
    fmt::print("{:<7}{:>14}{:>14}{:>14}{:>9.3f}x{:>14}{:>12}{:>10.1f}{:>10.1f}{:>10.1f}\n",
               row.world, mx, mn, unsharded_state / row.world, mx / ideal, sum,
               fmt::format("{}", fmt::join(row.owned_params, "+")), row.step_ms, row.cpu_ms,
               row.comm_ms);
  }
  fmt::print(
      "(max/ideal: largest rank's state over unsharded/world; tensors: parameters owned per "
      "rank; step ms: slowest rank, median; cpu ms: CPU time of the busiest rank's thread "
      "in the step, median (Gloo's transfers run on its own threads); comm ms: the step's "
      "AllGather replayed alone, median; ranks as threads on {} hardware threads)\n",
      std::thread::hardware_concurrency());
}

Json memory_json(const std::vector<MemoryRow>& memory) {
  Json rows = Json::array();
  for (const auto& row : memory) {
    const auto& m = row.step;
    Json json{{"variant", row.name},
              {"grad_bytes_alive_after_backward", m.grads_alive},
              {"live_bytes_start", m.live_start},
              {"live_bytes_after_backward", m.live_after_backward},
              {"peak_bytes_to_backward_end", m.peak_to_backward},
              {"peak_bytes", m.peak},
              {"live_bytes_end", m.live_end},
              {"live_bytes_before_build", row.live_before_build},
              {"peak_minus_start", m.peak - m.live_start},
              {"optimizer_state_bytes", row.state},
              {"step_ms", m.ms}};
    if (!row.at_peak.empty()) {
      Json by_operator = Json::object();
      for (const auto& [op, bytes] : row.at_peak)
        by_operator[op.empty() ? "(none)" : op] = bytes.first;
      json["live_bytes_at_peak_by_operator"] = by_operator;
    }
    rows.push_back(json);
  }
  return rows;
}

Json sharded_json(const std::vector<ShardedRow>& sharded, int64_t unsharded_state) {
  Json worlds = Json::array();
  for (const auto& row : sharded) {
    worlds.push_back({{"world", row.world},
                      {"state_bytes", row.state_bytes},
                      {"owned_params", row.owned_params},
                      {"owned_numel", row.owned_numel},
                      {"step_ms", row.step_ms},
                      {"busiest_rank_thread_cpu_ms", row.cpu_ms},
                      {"communication_model_ms", row.comm_ms}});
  }
  return Json{{"unsharded_adam_state_bytes", unsharded_state}, {"worlds", worlds}};
}

Json settings_json(const Args& args) {
  Json settings{{"repetitions", args.repetitions},
                {"window", args.window},
                {"batch", args.batch},
                {"sharded_steps", args.sharded_steps}};
  settings["adam"] = {{"lr", 1e-3}, {"betas", {0.9, 0.999}}};
  settings["shampoo"] = {{"lr", 1e-3},
                         {"betas", {0.9, 0.999}},
                         {"epsilon", 1e-12},
                         {"max_preconditioner_dim", 1024},
                         {"precondition_frequency", 1000},
                         {"start_preconditioning_step", 2},
                         {"grafting", "adam(0.999, 1e-8)"}};
  return settings;
}

int run(const Args& args, TrackingAllocator& tracker) {
  torch::manual_seed(0);
  std::vector<at::Tensor> init;
  for (const auto& p : make_mlp(kLayerSizes)->parameters()) init.push_back(p.detach().clone());
  const Batch batch{
      torch::randn({args.batch, kLayerSizes[0]}),
      torch::randint(kLayerSizes[std::size(kLayerSizes) - 1], {args.batch}, torch::kLong)};
  const double load_before = load_average();
  fmt::print(
      "bench_in_backward: {} ({} parameters, {} tensors, {}), batch {}, LibTorch {}, {} "
      "thread(s), CPU {}\n",
      mlp_name(kLayerSizes), numel_of(init), init.size(), format_bytes(nbytes_of(init)), args.batch,
      TORCH_VERSION, at::get_num_threads(), cpu_model());
  std::fflush(stdout);

  auto section_begin = Clock::now();
  const auto memory = measure_memory_rows(init, batch, tracker, args);
  const double memory_s = elapsed_ms(section_begin, Clock::now()) / 1000.0;
  print_memory(memory, nbytes_of(init));
  if (args.peak_breakdown) print_peak_breakdown(memory);

  section_begin = Clock::now();
  const TimeRows time = measure_time(init, batch, args);
  const double time_s = elapsed_ms(section_begin, Clock::now()) / 1000.0;

  const auto grads = one_pass_gradients(init, batch);
  const int64_t unsharded_state = memory.front().state;
  section_begin = Clock::now();
  std::vector<ShardedRow> sharded;
  for (const int world : {1, 2, 4}) sharded.push_back(measure_sharded(world, init, grads, args));
  const double sharded_s = elapsed_ms(section_begin, Clock::now()) / 1000.0;
  const double load_after = load_average();
  print_sharded(sharded, unsharded_state);
  fmt::print(
      "sections: memory {:.1f} s, time {:.1f} s, sharded {:.1f} s; load average (1 min) "
      "{:.2f} before, {:.2f} after\n",
      memory_s, time_s, sharded_s, load_before, load_after);
  if (args.json.empty()) return 0;

  const Json json{{"benchmark", "in_backward"},
                  {"label", args.label},
                  {"model", mlp_name(kLayerSizes)},
                  {"parameters", numel_of(init)},
                  {"parameter_tensors", init.size()},
                  {"parameter_bytes", nbytes_of(init)},
                  {"machine", machine_json(load_before, load_after)},
                  {"settings", settings_json(args)},
                  {"memory", memory_json(memory)},
                  {"time",
                   {{"adam_median_ms", median(time.ordinary)},
                    {"adam_in_backward_median_ms", median(time.in_backward)},
                    {"ratio_in_backward_vs_ordinary", median(time.ratio)},
                    {"adam_per_repetition_ms", time.ordinary},
                    {"adam_in_backward_per_repetition_ms", time.in_backward}}},
                  {"sharded", sharded_json(sharded, unsharded_state)}};
  return write_json(args.json, json, "bench_in_backward") ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  // First, before any tensor: every later allocation passes through the tracker.
  auto& tracker = TrackingAllocator::install();
  const Args args = parse_args(argc, argv);
  at::set_num_threads(static_cast<int>(args.threads));
  try {
    return run(args, tracker);
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_in_backward: {}\n", e.what());
    return 1;
  }
}
