/// Optimizer step time: DistributedShampoo (Adam grafting) against torch::optim::Adam on the same
/// parameter shapes, measured in the same run.
///
/// Only `optimizer.step()` is timed. Gradients come from a pool of real forward/backward passes
/// of the model (computed once, before any timing) and are copied into `.grad()` before every
/// step, outside the timed region, so that forward and backward are not timed and every optimizer
/// sees the same gradient sequence.
///
/// Configurations:
///   adam          torch::optim::Adam, betas (0.9, 0.999), eps 1e-8
///   shampoo_f1    Shampoo, precondition_frequency 1 (a root computation every step)
///   shampoo_fN    Shampoo, precondition_frequency N (default 100), start_preconditioning_step N;
///                 a window of consecutive steps (default N, i.e. one root computation per window)
///                 gives the amortized per-step mean, the median of the steps without a root
///                 computation, and the time of the steps with one.
/// Adam steps alternate one by one with the Shampoo steps, so that every ratio Shampoo/Adam is
/// taken over the same stretch of time on a possibly busy machine; the order of the two phases
/// flips every repetition. Reported: medians over repetitions, and medians of the per-repetition
/// ratios.
///
/// A phase model then times the LibTorch primitives Shampoo is built from (outer products and
/// factor update, eigh + reconstruction of the inverse root, preconditioner products) on the
/// block stacks of the same model, to show where the step time goes.
///
///   bench_optimizer_step [--repetitions 5] [--steps 3] [--frequency 100] [--window N]
///                        [--threads T] [--grad-pool 8] [--batch 128] [--json PATH]
///                        [--label TEXT] [--no-phases] [--verbose]
/// Results and how to read them: benchmarks/RESULTS.md.

#include <ATen/Parallel.h>
#include <shampoo/shampoo.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <iterator>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "benchmarks/bench_support.h"
#include "distributor/block_plan.h"  // the library's own blocking, for the phase model

namespace {

using namespace shampoo::bench;

/// MLP 784-2048-1024-512-10 (ReLU): 4.24M parameters, 2-D weights from 10x512 to 1024x2048.
constexpr int64_t kLayerSizes[] = {784, 2048, 1024, 512, 10};
constexpr int64_t kInFeatures = kLayerSizes[0];
constexpr int64_t kClasses = kLayerSizes[std::size(kLayerSizes) - 1];

// ---- command line -------------------------------------------------------------------------------

struct Args {
  int64_t repetitions = 5;
  int64_t steps = 3;  // timed steps per repetition of shampoo_f1
  int64_t frequency = 100;
  int64_t window = -1;    // timed consecutive steps per repetition of shampoo_fN; -1 = frequency
  int64_t threads = 0;    // 0 = LibTorch's default
  int64_t grad_pool = 8;  // distinct gradient sets, cycled
  int64_t batch = 128;    // batch size of the forward/backward passes that make the gradients
  bool no_phases = false;
  bool verbose = false;  // print every step: optimizer, step, CLOCK_MONOTONIC start (s), ms
  std::string json;
  std::string label;  // free text copied into the JSON (run_all.sh: the git revision)
};

Args parse_args(int argc, char** argv) {
  Args args;
  Flags flags("bench_optimizer_step",
              "[--repetitions R] [--steps S] [--window W]\n"
              "                            [--frequency F] [--threads T] [--grad-pool K]\n"
              "                            [--batch B] [--json PATH] [--label TEXT] [--no-phases]\n"
              "                            [--verbose]");
  flags.add_int("--repetitions", &args.repetitions, 1);
  flags.add_int("--steps", &args.steps, 1);
  flags.add_int("--window", &args.window, 1);
  flags.add_int("--frequency", &args.frequency, 2);
  flags.add_int("--threads", &args.threads, 1);
  flags.add_int("--grad-pool", &args.grad_pool, 1);
  flags.add_int("--batch", &args.batch, 1);
  flags.add_bool("--no-phases", &args.no_phases);
  flags.add_bool("--verbose", &args.verbose);
  flags.add_string("--json", &args.json);
  flags.add_string("--label", &args.label);
  flags.parse(argc, argv);
  if (args.window < 0) args.window = args.frequency;
  return args;
}

// ---- subjects -----------------------------------------------------------------------------------

/// One optimizer with its own copy of the parameters.
struct Subject {
  std::string name;
  std::vector<at::Tensor> params;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  shampoo::DistributedShampoo* shampoo = nullptr;  // non-owning, when a Shampoo
  int64_t steps_taken = 0;
};

/// Copies gradient set `steps_taken mod pool` into .grad() (untimed), then times step(). With
/// `verbose`, prints the step with its CLOCK_MONOTONIC start time, which is what
/// `perf record -k mono` stamps samples with: `perf report --time START,END` then profiles a
/// chosen stretch of steps.
double timed_step(Subject& s, const std::vector<std::vector<at::Tensor>>& pool,
                  bool verbose = false) {
  set_gradients(s.params, pool[static_cast<size_t>(s.steps_taken) % pool.size()]);
  const auto begin = Clock::now();
  s.optimizer->step();
  const auto end = Clock::now();
  ++s.steps_taken;
  const double ms = elapsed_ms(begin, end);
  if (verbose) {
    std::cout << "    step " << s.name << " " << s.steps_taken << " start " << std::fixed
              << std::setprecision(6)
              << std::chrono::duration<double>(begin.time_since_epoch()).count() << " s, "
              << std::setprecision(2) << ms << " ms\n"
              << std::flush;
  }
  return ms;
}

Subject make_adam(const std::vector<at::Tensor>& init) {
  Subject s;
  s.name = "adam";
  s.params = clone_params(init);
  s.optimizer = std::make_unique<torch::optim::Adam>(
      s.params, torch::optim::AdamOptions(1e-3).betas(std::make_tuple(0.9, 0.999)).eps(1e-8));
  return s;
}

Subject make_shampoo(const std::vector<at::Tensor>& init, int64_t frequency) {
  Subject s;
  s.name = "shampoo_f" + std::to_string(frequency);
  s.params = clone_params(init);
  auto opt = std::make_unique<shampoo::DistributedShampoo>(
      s.params, shampoo_options(frequency, /*start=*/frequency));
  s.shampoo = opt.get();
  s.optimizer = std::move(opt);
  return s;
}

int64_t adam_state_bytes(const torch::optim::Optimizer& opt) {
  int64_t bytes = 0;
  for (const auto& [key, state] : opt.state()) {
    const auto& adam = static_cast<const torch::optim::AdamParamState&>(*state);
    for (const auto* t : {&adam.exp_avg(), &adam.exp_avg_sq(), &adam.max_exp_avg_sq()}) {
      if (t->defined()) bytes += t->numel() * static_cast<int64_t>(t->element_size());
    }
  }
  return bytes;
}

// ---- phase model --------------------------------------------------------------------------------

/// Blocks of one shape, stacked as the library stacks them ([n, block_shape...]).
struct BlockStack {
  std::vector<int64_t> shape;
  std::vector<at::Tensor> members;  // gradient blocks (contiguous copies)
};

std::vector<BlockStack> block_stacks(const std::vector<at::Tensor>& params,
                                     const std::vector<at::Tensor>& grads) {
  std::vector<BlockStack> stacks;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto plan = shampoo::detail::make_block_plan(params[i].sizes(), 1024, true);
    const auto views = shampoo::detail::block_views(grads[i], plan);
    for (size_t b = 0; b < views.size(); ++b) {
      const auto& shape = plan.blocks[b].sizes;
      auto it = std::find_if(stacks.begin(), stacks.end(),
                             [&](const BlockStack& s) { return s.shape == shape; });
      if (it == stacks.end()) {
        stacks.push_back({shape, {}});
        it = std::prev(stacks.end());
      }
      it->members.push_back(views[b].contiguous());
    }
  }
  return stacks;
}

/// X of the stack as [n, d_k, rest] (dim k first): outer product X·Xᵀ, preconditioner product M·X.
at::Tensor dim_major(const at::Tensor& stacked, int64_t k) {
  const int64_t n = stacked.size(0);
  return stacked.movedim(k + 1, 1).reshape({n, stacked.size(k + 1), -1}).contiguous();
}

template <typename F>
double median_time_ms(int64_t repetitions, F&& f) {
  std::vector<double> t;
  for (int64_t r = 0; r < repetitions; ++r) {
    const auto begin = Clock::now();
    f();
    t.push_back(elapsed_ms(begin, Clock::now()));
  }
  return median(t);
}

struct PhaseRow {
  std::string stack;           // "2x[1024, 784]"
  std::string factor;          // "dim 0 (1024)"
  double update_ms = 0;        // outer product + β-update of the factor (every step)
  double precondition_ms = 0;  // preconditioner product (every preconditioned step)
  double root_ms = 0;          // eigh + reconstruction (every root computation)
};

std::vector<PhaseRow> phase_model(const std::vector<BlockStack>& stacks) {
  std::vector<PhaseRow> rows;
  for (const auto& s : stacks) {
    const auto stacked = at::stack(s.members);  // [n, shape...]
    const auto n = stacked.size(0);
    for (int64_t k = 0; k < static_cast<int64_t>(s.shape.size()); ++k) {
      PhaseRow row;
      std::ostringstream name;
      name << n << "x" << at::IntArrayRef(s.shape);
      row.stack = name.str();
      row.factor = "dim " + std::to_string(k) + " (" + std::to_string(s.shape[k]) + ")";
      const auto x = dim_major(stacked, k);
      auto factor = at::zeros({n, s.shape[k], s.shape[k]});
      // Outer products of a few gradients, so that eigh sees a factor like the real one.
      for (int i = 0; i < 4; ++i) factor.add_(at::bmm(x, x.transpose(1, 2)));
      row.update_ms = median_time_ms(3, [&] {
        auto outer = at::bmm(x, x.transpose(1, 2));
        outer.mul_(0.001);
        factor.mul_(0.999).add_(outer);
      });
      const auto eye = at::eye(s.shape[k]);
      at::Tensor root = eye.expand({n, s.shape[k], s.shape[k]}).contiguous();
      row.root_ms = median_time_ms(1, [&] {
        auto [values, vectors] = at::linalg_eigh(factor + eye * 1e-12);
        const auto powers = at::pow(values.clamp_min(1e-12), -0.25);
        root = at::matmul(vectors * powers.unsqueeze(-2), vectors.transpose(-2, -1));
      });
      row.precondition_ms = median_time_ms(3, [&] { (void)at::bmm(root, x); });
      rows.push_back(row);
    }
  }
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse_args(argc, argv);
  if (args.threads > 0) at::set_num_threads(static_cast<int>(args.threads));
  torch::manual_seed(0);

  auto model = make_mlp(kLayerSizes);
  const auto init = model->parameters();
  const int64_t num_params = numel_of(init);
  const auto pool = make_gradient_pool(model, args.grad_pool, args.batch, kInFeatures, kClasses);
  const double load_before = load_average();

  auto adam = make_adam(init);
  auto f1 = make_shampoo(init, 1);
  auto fn = make_shampoo(init, args.frequency);

  std::cout << "bench_optimizer_step: " << mlp_name(kLayerSizes) << " (" << num_params
            << " parameters, " << init.size() << " tensors), LibTorch " << TORCH_VERSION << ", "
            << at::get_num_threads() << " threads, CPU " << cpu_model() << "\n"
            << "  repetitions " << args.repetitions << ", shampoo_f1 steps/rep " << args.steps
            << ", shampoo_f" << args.frequency << " window " << args.window
            << " steps/rep, gradient pool " << args.grad_pool << " x batch " << args.batch << "\n"
            << std::flush;

  // Warm-up: allocations and the first root computations, not timed in the results. shampoo_fN
  // is brought to its first root computation (step N), so every later window of N steps holds
  // exactly one root computation per block.
  const auto warm_begin = Clock::now();
  auto warm_step = [&](Subject& s) { return timed_step(s, pool, args.verbose); };
  for (int i = 0; i < 3; ++i) warm_step(adam);
  for (int i = 0; i < 2; ++i) warm_step(f1);
  std::vector<double> grafting_phase_ms;  // steps 1..N-1 of shampoo_fN: Adam grafting only
  for (int64_t i = 0; i < args.frequency; ++i) {
    const double ms = warm_step(fn);
    if (i + 1 < args.frequency) grafting_phase_ms.push_back(ms);
  }
  std::cout << "  warm-up " << std::fixed << std::setprecision(1)
            << elapsed_ms(warm_begin, Clock::now()) / 1000.0 << " s\n"
            << std::flush;

  struct Rep {
    double adam_median = 0;
    double f1_median = 0;
    double fn_mean = 0;              // amortized: every step of the window
    double fn_plain_median = 0;      // steps of the window without a root computation
    std::vector<double> fn_root_ms;  // steps of the window with a root computation
    double f1_ratio = 0, fn_ratio = 0, fn_plain_ratio = 0;
  };
  std::vector<Rep> reps;
  const auto run_begin = Clock::now();
  for (int64_t r = 0; r < args.repetitions; ++r) {
    Rep rep;
    std::vector<double> adam_ms, f1_ms, fn_ms, fn_plain_ms;
    auto phase_f1 = [&] {
      for (int64_t i = 0; i < args.steps; ++i) {
        adam_ms.push_back(timed_step(adam, pool, args.verbose));
        f1_ms.push_back(timed_step(f1, pool, args.verbose));
      }
    };
    auto phase_fn = [&] {
      for (int64_t i = 0; i < args.window; ++i) {
        const auto computations = fn.shampoo->stats().amortized_computations;
        const double ms = timed_step(fn, pool, args.verbose);
        fn_ms.push_back(ms);
        if (fn.shampoo->stats().amortized_computations != computations) {
          rep.fn_root_ms.push_back(ms);
        } else {
          fn_plain_ms.push_back(ms);
        }
        adam_ms.push_back(timed_step(adam, pool, args.verbose));
      }
    };
    if (r % 2 == 0) {
      phase_f1();
      phase_fn();
    } else {
      phase_fn();
      phase_f1();
    }
    rep.adam_median = median(adam_ms);
    rep.f1_median = median(f1_ms);
    rep.fn_mean = mean(fn_ms);
    rep.fn_plain_median = median(fn_plain_ms);
    rep.f1_ratio = rep.f1_median / rep.adam_median;
    rep.fn_ratio = rep.fn_mean / rep.adam_median;
    rep.fn_plain_ratio = rep.fn_plain_median / rep.adam_median;
    std::cout << "  repetition " << r + 1 << "/" << args.repetitions << std::setprecision(2)
              << ": adam " << rep.adam_median << " ms, shampoo_f1 " << rep.f1_median
              << " ms, shampoo_f" << args.frequency << " amortized " << rep.fn_mean
              << " ms (plain step " << rep.fn_plain_median << " ms, " << rep.fn_root_ms.size()
              << " root step(s) " << json_array(rep.fn_root_ms) << " ms)\n"
              << std::flush;
    reps.push_back(std::move(rep));
  }
  const double run_s = elapsed_ms(run_begin, Clock::now()) / 1000.0;
  const double load_after = load_average();

  auto collect = [&](auto field) {
    std::vector<double> v;
    for (const auto& rep : reps) v.push_back(field(rep));
    return v;
  };
  const auto adam_v = collect([](const Rep& r) { return r.adam_median; });
  const auto f1_v = collect([](const Rep& r) { return r.f1_median; });
  const auto fn_v = collect([](const Rep& r) { return r.fn_mean; });
  const auto fn_plain_v = collect([](const Rep& r) { return r.fn_plain_median; });
  const auto f1_ratio_v = collect([](const Rep& r) { return r.f1_ratio; });
  const auto fn_ratio_v = collect([](const Rep& r) { return r.fn_ratio; });
  const auto fn_plain_ratio_v = collect([](const Rep& r) { return r.fn_plain_ratio; });
  std::vector<double> fn_root_v;
  for (const auto& rep : reps) {
    fn_root_v.insert(fn_root_v.end(), rep.fn_root_ms.begin(), rep.fn_root_ms.end());
  }

  const auto f1_stats = f1.shampoo->stats();
  const auto fn_stats = fn.shampoo->stats();
  const int64_t adam_bytes = adam_state_bytes(*adam.optimizer);

  const std::string fn_name = "shampoo_f" + std::to_string(args.frequency);
  std::cout << "\n"
            << std::left << std::setw(34) << "configuration" << std::right << std::setw(14)
            << "median ms" << std::setw(16) << "ratio vs adam"
            << "\n"
            << std::string(64, '-') << "\n";
  auto table_row = [](const std::string& name, double ms, double ratio) {
    std::cout << std::left << std::setw(34) << name << std::right << std::fixed
              << std::setprecision(2) << std::setw(14) << ms << std::setw(15) << ratio << "x\n";
  };
  table_row("adam", median(adam_v), 1.0);
  table_row("shampoo_f1", median(f1_v), median(f1_ratio_v));
  table_row(fn_name + " amortized (mean)", median(fn_v), median(fn_ratio_v));
  table_row(fn_name + " step without root", median(fn_plain_v), median(fn_plain_ratio_v));
  table_row(fn_name + " step with root", median(fn_root_v), median(fn_root_v) / median(adam_v));
  table_row(fn_name + " grafting phase", median(grafting_phase_ms),
            median(grafting_phase_ms) / median(adam_v));
  std::cout << "(ratios: median over repetitions of the same-repetition ratio; the last two rows"
               " divide medians)\n"
            << "blocks " << fn_stats.total_blocks << ", virtual groups " << fn_stats.virtual_groups
            << "; state bytes: shampoo " << fn_stats.state_bytes << " (" << std::setprecision(1)
            << fn_stats.state_bytes / 1048576.0 << " MiB), adam " << adam_bytes << " ("
            << adam_bytes / 1048576.0 << " MiB)\n";
  print_timed_section(std::cout, run_s, load_before, load_after);

  std::vector<PhaseRow> phases;
  if (!args.no_phases) {
    phases = phase_model(block_stacks(init, pool[0]));
    PhaseRow total;
    std::cout << "\nphase model (LibTorch primitives on the block stacks, ms):\n"
              << std::left << std::setw(18) << "stack" << std::setw(14) << "factor" << std::right
              << std::setw(12) << "update" << std::setw(14) << "precondition" << std::setw(12)
              << "root"
              << "\n"
              << std::string(70, '-') << "\n";
    for (const auto& p : phases) {
      std::cout << std::left << std::setw(18) << p.stack << std::setw(14) << p.factor << std::right
                << std::setprecision(2) << std::setw(12) << p.update_ms << std::setw(14)
                << p.precondition_ms << std::setw(12) << p.root_ms << "\n";
      total.update_ms += p.update_ms;
      total.precondition_ms += p.precondition_ms;
      total.root_ms += p.root_ms;
    }
    std::cout << std::left << std::setw(32) << "total" << std::right << std::setw(12)
              << total.update_ms << std::setw(14) << total.precondition_ms << std::setw(12)
              << total.root_ms << "\n";
  }

  if (!args.json.empty()) {
    std::ofstream out(args.json);
    if (!out) {
      std::cerr << "bench_optimizer_step: cannot write " << args.json << "\n";
      return 1;
    }
    out << std::setprecision(6);
    out << "{\n"
        << "  \"benchmark\": \"optimizer_step\",\n"
        << "  \"label\": " << json_string(args.label) << ",\n"
        << "  \"model\": " << json_string(mlp_name(kLayerSizes)) << ",\n"
        << "  \"parameters\": " << num_params << ",\n"
        << "  \"parameter_tensors\": " << init.size() << ",\n"
        << "  \"machine\": " << machine_json(load_before, load_after) << ",\n"
        << "  \"settings\": {\"repetitions\": " << args.repetitions
        << ", \"shampoo_f1_steps\": " << args.steps << ", \"frequency\": " << args.frequency
        << ", \"window\": " << args.window << ", \"grad_pool\": " << args.grad_pool
        << ", \"batch\": " << args.batch
        << ", \"shampoo\": {\"lr\": 1e-3, \"betas\": [0.9, 0.999], \"epsilon\": 1e-12, "
           "\"max_preconditioner_dim\": 1024, \"grafting\": \"adam(0.999, 1e-8)\"}"
        << ", \"adam\": {\"lr\": 1e-3, \"betas\": [0.9, 0.999], \"eps\": 1e-8}},\n"
        << "  \"median_ms\": {\"adam\": " << median(adam_v) << ", \"shampoo_f1\": " << median(f1_v)
        << ", \"" << fn_name << "_amortized\": " << median(fn_v) << ", \"" << fn_name
        << "_without_root\": " << median(fn_plain_v) << ", \"" << fn_name
        << "_with_root\": " << median(fn_root_v) << ", \"" << fn_name
        << "_grafting_phase\": " << median(grafting_phase_ms) << "},\n"
        << "  \"ratio_vs_adam\": {\"shampoo_f1\": " << median(f1_ratio_v) << ", \"" << fn_name
        << "_amortized\": " << median(fn_ratio_v) << ", \"" << fn_name
        << "_without_root\": " << median(fn_plain_ratio_v) << "},\n"
        << "  \"per_repetition_ms\": {\"adam\": " << json_array(adam_v)
        << ", \"shampoo_f1\": " << json_array(f1_v) << ", \"" << fn_name
        << "_amortized\": " << json_array(fn_v) << ", \"" << fn_name
        << "_without_root\": " << json_array(fn_plain_v) << ", \"" << fn_name
        << "_with_root\": " << json_array(fn_root_v) << "},\n"
        << "  \"shampoo_stats\": {\"total_blocks\": " << fn_stats.total_blocks
        << ", \"virtual_groups\": " << fn_stats.virtual_groups
        << ", \"state_bytes\": " << fn_stats.state_bytes
        << ", \"shampoo_f1_amortized_computations\": " << f1_stats.amortized_computations << ", \""
        << fn_name << "_amortized_computations\": " << fn_stats.amortized_computations
        << ", \"failed_amortized_computations\": "
        << f1_stats.failed_amortized_computations + fn_stats.failed_amortized_computations << "},\n"
        << "  \"adam_state_bytes\": " << adam_bytes << ",\n"
        << "  \"timed_section_s\": " << run_s << ",\n"
        << "  \"phase_model_ms\": [";
    for (size_t i = 0; i < phases.size(); ++i) {
      const auto& p = phases[i];
      out << (i ? "," : "") << "\n    {\"stack\": " << json_string(p.stack)
          << ", \"factor\": " << json_string(p.factor) << ", \"update\": " << p.update_ms
          << ", \"precondition\": " << p.precondition_ms << ", \"root\": " << p.root_ms << "}";
    }
    out << "\n  ]\n}\n";
    std::cout << "\nwrote " << args.json << "\n";
  }
  return 0;
}
