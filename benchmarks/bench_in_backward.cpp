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
#include <mutex>
#include <sstream>
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

Factory shampoo_factory() {
  return [](std::vector<at::Tensor> p) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<shampoo::DistributedShampoo>(
        std::move(p), shampoo_options(/*frequency=*/1000, /*start=*/2));
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
        shampoo::ShardedOptimizer optimizer(params, adam_factory(), group);
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

}  // namespace

int main(int argc, char** argv) {
  // First, before any tensor: every later allocation passes through the tracker.
  auto& tracker = TrackingAllocator::install();

  Args args;
  Flags flags("bench_in_backward",
              "[--repetitions R] [--window W] [--threads T] [--batch B] [--sharded-steps S]\n"
              "       [--no-shampoo] [--peak-breakdown] [--json PATH] [--label TEXT]");
  flags.add_int("--repetitions", &args.repetitions, 1);
  flags.add_int("--window", &args.window, 1);
  flags.add_int("--threads", &args.threads, 1);
  flags.add_int("--batch", &args.batch, 1);
  flags.add_int("--sharded-steps", &args.sharded_steps, 1);
  flags.add_bool("--no-shampoo", &args.no_shampoo);
  flags.add_bool("--peak-breakdown", &args.peak_breakdown);
  flags.add_string("--json", &args.json);
  flags.add_string("--label", &args.label);
  flags.parse(argc, argv);
  at::set_num_threads(static_cast<int>(args.threads));

  try {
    torch::manual_seed(0);
    std::vector<at::Tensor> init;
    {
      auto model = make_mlp(kLayerSizes);
      for (const auto& p : model->parameters()) init.push_back(p.detach().clone());
    }
    const int64_t num_params = numel_of(init);
    const int64_t param_bytes = nbytes_of(init);
    const Batch batch{
        torch::randn({args.batch, kLayerSizes[0]}),
        torch::randint(kLayerSizes[std::size(kLayerSizes) - 1], {args.batch}, torch::kLong)};
    const double load_before = load_average();
    std::cout << "bench_in_backward: " << mlp_name(kLayerSizes) << " (" << num_params
              << " parameters, " << init.size() << " tensors, " << format_bytes(param_bytes)
              << "), batch " << args.batch << ", LibTorch " << TORCH_VERSION << ", "
              << at::get_num_threads() << " thread(s), CPU " << cpu_model() << "\n"
              << std::flush;

    // (a, b) memory, each variant alone.
    const auto memory_begin = Clock::now();
    std::vector<MemoryRow> memory;
    memory.push_back(measure_memory("adam", init, adam_factory(), false, batch, 1, tracker,
                                    args.peak_breakdown));
    memory.push_back(measure_memory("adam in backward", init, adam_factory(), true, batch, 1,
                                    tracker, args.peak_breakdown));
    if (!args.no_shampoo) {
      // Step 1 grafting only, step 2 the first root computation, step 3 measured.
      memory.push_back(measure_memory("shampoo", init, shampoo_factory(), false, batch, 2, tracker,
                                      args.peak_breakdown));
      memory.push_back(measure_memory("shampoo in backward", init, shampoo_factory(), true, batch,
                                      2, tracker, args.peak_breakdown));
    }
    const double memory_s = elapsed_ms(memory_begin, Clock::now()) / 1000.0;

    std::cout << "\n(a, b) memory of one training step, each variant alone (bytes):\n"
              << std::left << std::setw(22) << "variant" << std::right << std::setw(14)
              << "grads alive" << std::setw(14) << "resting" << std::setw(14) << "peak"
              << std::setw(14) << "peak-resting" << std::setw(16) << "bwd peak-rest."
              << std::setw(14) << "opt. state" << std::setw(9) << "step ms"
              << "\n"
              << std::string(117, '-') << "\n";
    for (const auto& row : memory) {
      const auto& m = row.step;
      const int64_t base = row.live_before_build;
      std::cout << std::left << std::setw(22) << row.name << std::right << std::setw(14)
                << m.grads_alive << std::setw(14) << m.live_start - base << std::setw(14)
                << m.peak - base << std::setw(14) << m.peak - m.live_start << std::setw(16)
                << m.peak_to_backward - m.live_start << std::setw(14) << row.state << std::fixed
                << std::setprecision(1) << std::setw(9) << m.ms << "\n";
    }
    std::cout << "(grads alive: when loss.backward() returned; resting: the variant's live bytes "
                 "before the step (parameters + optimizer state), peak: its high-water mark "
                 "during the step, both above the "
              << row_base(memory)
              << " bytes the process held before it was built; bwd "
                 "peak-rest.: the same up to the end of loss.backward(); parameters "
              << param_bytes << " bytes)\nlive bytes before build / after teardown:";
    for (const auto& row : memory) {
      std::cout << " " << row.name << " " << row.live_before_build << "/" << row.live_after_teardown
                << ";";
    }
    std::cout << "\n" << std::flush;
    if (args.peak_breakdown) {
      for (const auto& row : memory) {
        std::vector<std::pair<std::string, std::pair<int64_t, int64_t>>> ops(row.at_peak.begin(),
                                                                             row.at_peak.end());
        std::sort(ops.begin(), ops.end(),
                  [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
        int64_t total = 0;
        for (const auto& op : ops) total += op.second.first;
        std::cout << "live bytes at the peak of a " << row.name << " step by allocating "
                  << "top-level operator (total " << total << "):\n";
        for (const auto& [op, bytes] : ops) {
          if (bytes.first < 1000000) continue;
          std::cout << "  " << std::left << std::setw(34)
                    << (op.empty() ? "(before the step / no operator)" : op) << std::right
                    << std::setw(14) << bytes.first << " in " << bytes.second << " allocations\n";
        }
      }
      std::cout << std::flush;
    }

    // (c) time, Adam ordinary vs in backward, alternating.
    std::vector<double> ordinary_rep, in_backward_rep, ratio_rep;
    const auto time_begin = Clock::now();
    {
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
        ordinary_rep.push_back(median(a));
        in_backward_rep.push_back(median(b));
        ratio_rep.push_back(in_backward_rep.back() / ordinary_rep.back());
        std::cout << "  (c) repetition " << r + 1 << "/" << args.repetitions << ": adam "
                  << std::setprecision(1) << ordinary_rep.back() << " ms, in backward "
                  << in_backward_rep.back() << " ms\n"
                  << std::flush;
      }
      // Same parameters after the same steps: in-backward Adam equals ordinary Adam.
      const auto pa = ordinary.model->parameters();
      const auto pb = in_backward.model->parameters();
      bool same = true;
      for (size_t i = 0; i < pa.size(); ++i) same &= at::equal(pa[i], pb[i]);
      std::cout << "  (c) parameters of the two after " << ordinary.steps
                << " steps bit-identical: " << (same ? "yes" : "NO") << "\n";
    }
    const double time_s = elapsed_ms(time_begin, Clock::now()) / 1000.0;
    std::cout << "\n(c) training step time (forward + backward + Adam), median ms:\n"
              << "  adam " << std::setprecision(2) << median(ordinary_rep) << ", adam in backward "
              << median(in_backward_rep) << ", ratio in backward / "
              << "ordinary " << std::setprecision(3) << median(ratio_rep) << "x\n"
              << std::flush;

    // (d) sharded optimizer state per rank.
    std::vector<at::Tensor> grads;
    {
      auto model = make_model(init);
      torch::nn::functional::cross_entropy(model->forward(batch.x), batch.y).backward();
      for (const auto& p : model->parameters()) grads.push_back(p.grad().detach().clone());
    }
    const int64_t unsharded_state = memory.front().state;
    const auto sharded_begin = Clock::now();
    std::vector<ShardedRow> sharded;
    for (const int world : {1, 2, 4}) sharded.push_back(measure_sharded(world, init, grads, args));
    const double sharded_s = elapsed_ms(sharded_begin, Clock::now()) / 1000.0;
    const double load_after = load_average();

    std::cout << "\n(d) ShardedOptimizer (Adam inside), state bytes per rank; unsharded Adam "
              << unsharded_state << ":\n"
              << std::left << std::setw(7) << "world" << std::right << std::setw(14) << "max/rank"
              << std::setw(14) << "min/rank" << std::setw(14) << "total/world" << std::setw(10)
              << "max/ideal" << std::setw(14) << "sum" << std::setw(12) << "tensors"
              << std::setw(10) << "step ms" << std::setw(10) << "cpu ms" << std::setw(10)
              << "comm ms"
              << "\n"
              << std::string(115, '-') << "\n";
    for (const auto& row : sharded) {
      int64_t sum = 0;
      std::ostringstream tensors;
      for (size_t r = 0; r < row.state_bytes.size(); ++r) {
        sum += row.state_bytes[r];
        tensors << (r ? "+" : "") << row.owned_params[r];
      }
      const auto mx = *std::max_element(row.state_bytes.begin(), row.state_bytes.end());
      const auto mn = *std::min_element(row.state_bytes.begin(), row.state_bytes.end());
      const double ideal = static_cast<double>(unsharded_state) / row.world;
      std::cout << std::left << std::setw(7) << row.world << std::right << std::setw(14) << mx
                << std::setw(14) << mn << std::setw(14) << unsharded_state / row.world
                << std::setw(9) << std::setprecision(3) << mx / ideal << "x" << std::setw(14) << sum
                << std::setw(12) << tensors.str() << std::setprecision(1) << std::setw(10)
                << row.step_ms << std::setw(10) << row.cpu_ms << std::setw(10) << row.comm_ms
                << "\n";
    }
    std::cout
        << "(max/ideal: largest rank's state over unsharded/world; tensors: parameters "
           "owned per rank; step ms: slowest rank, median; cpu ms: CPU time of the busiest rank's "
           "thread in the step, median (Gloo's transfers run on its own threads); comm ms: the "
           "step's AllGather replayed alone, median; ranks as "
           "threads on "
        << std::thread::hardware_concurrency() << " hardware threads)\n"
        << "sections: memory " << std::setprecision(1) << memory_s << " s, time " << time_s
        << " s, sharded " << sharded_s << " s; load average (1 min) " << std::setprecision(2)
        << load_before << " before, " << load_after << " after\n";

    if (!args.json.empty()) {
      std::ofstream out(args.json);
      if (!out) {
        std::cerr << "bench_in_backward: cannot write " << args.json << "\n";
        return 1;
      }
      out << std::setprecision(6);
      out << "{\n"
          << "  \"benchmark\": \"in_backward\",\n"
          << "  \"label\": " << json_string(args.label) << ",\n"
          << "  \"model\": " << json_string(mlp_name(kLayerSizes)) << ",\n"
          << "  \"parameters\": " << num_params << ",\n"
          << "  \"parameter_tensors\": " << init.size() << ",\n"
          << "  \"parameter_bytes\": " << param_bytes << ",\n"
          << "  \"machine\": " << machine_json(load_before, load_after) << ",\n"
          << "  \"settings\": {\"repetitions\": " << args.repetitions
          << ", \"window\": " << args.window << ", \"batch\": " << args.batch
          << ", \"sharded_steps\": " << args.sharded_steps
          << ", \"adam\": {\"lr\": 1e-3, \"betas\": [0.9, 0.999]}"
          << ", \"shampoo\": {\"lr\": 1e-3, \"betas\": [0.9, 0.999], \"epsilon\": 1e-12, "
             "\"max_preconditioner_dim\": 1024, \"precondition_frequency\": 1000, "
             "\"start_preconditioning_step\": 2, \"grafting\": \"adam(0.999, 1e-8)\"}},\n"
          << "  \"memory\": [";
      for (size_t i = 0; i < memory.size(); ++i) {
        const auto& row = memory[i];
        const auto& m = row.step;
        out << (i ? "," : "") << "\n    {\"variant\": " << json_string(row.name)
            << ", \"grad_bytes_alive_after_backward\": " << m.grads_alive
            << ", \"live_bytes_start\": " << m.live_start
            << ", \"live_bytes_after_backward\": " << m.live_after_backward
            << ", \"peak_bytes_to_backward_end\": " << m.peak_to_backward
            << ", \"peak_bytes\": " << m.peak << ", \"live_bytes_end\": " << m.live_end
            << ", \"live_bytes_before_build\": " << row.live_before_build
            << ", \"peak_minus_start\": " << m.peak - m.live_start
            << ", \"optimizer_state_bytes\": " << row.state << ", \"step_ms\": " << m.ms;
        if (!row.at_peak.empty()) {
          out << ", \"live_bytes_at_peak_by_operator\": {";
          bool first = true;
          for (const auto& [op, bytes] : row.at_peak) {
            out << (first ? "" : ", ") << json_string(op.empty() ? "(none)" : op) << ": "
                << bytes.first;
            first = false;
          }
          out << "}";
        }
        out << "}";
      }
      out << "\n  ],\n"
          << "  \"time\": {\"adam_median_ms\": " << median(ordinary_rep)
          << ", \"adam_in_backward_median_ms\": " << median(in_backward_rep)
          << ", \"ratio_in_backward_vs_ordinary\": " << median(ratio_rep)
          << ", \"adam_per_repetition_ms\": " << json_array(ordinary_rep)
          << ", \"adam_in_backward_per_repetition_ms\": " << json_array(in_backward_rep) << "},\n"
          << "  \"sharded\": {\"unsharded_adam_state_bytes\": " << unsharded_state
          << ", \"worlds\": [";
      for (size_t i = 0; i < sharded.size(); ++i) {
        const auto& row = sharded[i];
        out << (i ? "," : "") << "\n    {\"world\": " << row.world
            << ", \"state_bytes\": " << json_array(row.state_bytes)
            << ", \"owned_params\": " << json_array(row.owned_params)
            << ", \"owned_numel\": " << json_array(row.owned_numel)
            << ", \"step_ms\": " << row.step_ms
            << ", \"busiest_rank_thread_cpu_ms\": " << row.cpu_ms
            << ", \"communication_model_ms\": " << row.comm_ms << "}";
      }
      out << "\n  ]}\n}\n";
      std::cout << "\nwrote " << args.json << "\n";
    }
  } catch (const std::exception& e) {
    std::cerr << "bench_in_backward: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
