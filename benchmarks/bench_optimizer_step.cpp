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
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <shampoo/shampoo.h>
#include <torch/optim.h>
#include <torch/types.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <iterator>
#include <memory>
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
              "Optimizer step time: DistributedShampoo (Adam grafting) against torch::optim::Adam "
              "on the same parameter shapes, in the same run (benchmarks/RESULTS.md).");
  flags.add("repetitions", args.repetitions, "repetitions (medians are over them)", 1)
      .add("steps", args.steps, "timed steps of shampoo_f1 per repetition", 1)
      .add("window", args.window,
           "timed consecutive steps of shampoo_fN per repetition (-1 = --frequency)", 1)
      .add("frequency", args.frequency, "precondition_frequency N of shampoo_fN", 2)
      .add("threads", args.threads, "intra-op threads (0 = LibTorch's default)", 1)
      .add("grad-pool", args.grad_pool, "distinct gradient sets, cycled", 1)
      .add("batch", args.batch, "batch size of the passes that make the gradients", 1)
      .add_bool("no-phases", args.no_phases, "skip the phase model")
      .add_bool("verbose", args.verbose,
                "print every step with its CLOCK_MONOTONIC start (for perf_by_step.py)");
  add_output_flags(flags, args.json, args.label);
  parse_flags_or_exit(flags, "bench_optimizer_step", argc, argv);
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
    fmt::print("    step {} {} start {:.6f} s, {:.2f} ms\n", s.name, s.steps_taken,
               std::chrono::duration<double>(begin.time_since_epoch()).count(), ms);
    std::fflush(stdout);
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
      row.stack = fmt::format("{}x[{}]", n, fmt::join(s.shape, ", "));
      row.factor = fmt::format("dim {} ({})", k, s.shape[k]);
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

// ---- the measurement ----------------------------------------------------------------------------

/// The three optimizers on copies of the same initial parameters, and the gradient pool.
struct Bench {
  std::vector<at::Tensor> init;
  std::vector<std::vector<at::Tensor>> pool;
  Subject adam, f1, fn;
  std::vector<double> grafting_phase_ms;  // steps 1..N-1 of shampoo_fN: Adam grafting only
};

/// One repetition: medians of its steps and their ratios to Adam.
struct Rep {
  double adam_median = 0;
  double f1_median = 0;
  double fn_mean = 0;              // amortized: every step of the window
  double fn_plain_median = 0;      // steps of the window without a root computation
  std::vector<double> fn_root_ms;  // steps of the window with a root computation
  double f1_ratio = 0, fn_ratio = 0, fn_plain_ratio = 0;
};

void print_header(const Bench& b, const Args& args) {
  fmt::print(
      "bench_optimizer_step: {} ({} parameters, {} tensors), LibTorch {}, {} threads, CPU {}\n"
      "  repetitions {}, shampoo_f1 steps/rep {}, shampoo_f{} window {} steps/rep, gradient pool "
      "{} x batch {}\n",
      mlp_name(kLayerSizes), numel_of(b.init), b.init.size(), TORCH_VERSION, at::get_num_threads(),
      cpu_model(), args.repetitions, args.steps, args.frequency, args.window, args.grad_pool,
      args.batch);
  std::fflush(stdout);
}

/// Warm-up: allocations and the first root computations, not timed in the results. shampoo_fN
/// is brought to its first root computation (step N), so every later window of N steps holds
/// exactly one root computation per block.
void warm_up(Bench& b, const Args& args) {
  const auto warm_begin = Clock::now();
  auto warm_step = [&](Subject& s) { return timed_step(s, b.pool, args.verbose); };
  for (int i = 0; i < 3; ++i) warm_step(b.adam);
  for (int i = 0; i < 2; ++i) warm_step(b.f1);
  for (int64_t i = 0; i < args.frequency; ++i) {
    const double ms = warm_step(b.fn);
    if (i + 1 < args.frequency) b.grafting_phase_ms.push_back(ms);
  }
  fmt::print("  warm-up {:.1f} s\n", elapsed_ms(warm_begin, Clock::now()) / 1000.0);
  std::fflush(stdout);
}

/// Adam steps alternate one by one with the Shampoo steps; the order of the two phases flips
/// every repetition.
Rep run_repetition(Bench& b, const Args& args, int64_t r) {
  Rep rep;
  std::vector<double> adam_ms, f1_ms, fn_ms, fn_plain_ms;
  auto phase_f1 = [&] {
    for (int64_t i = 0; i < args.steps; ++i) {
      adam_ms.push_back(timed_step(b.adam, b.pool, args.verbose));
      f1_ms.push_back(timed_step(b.f1, b.pool, args.verbose));
    }
  };
  auto phase_fn = [&] {
    for (int64_t i = 0; i < args.window; ++i) {
      const auto computations = b.fn.shampoo->stats().amortized_computations;
      const double ms = timed_step(b.fn, b.pool, args.verbose);
      fn_ms.push_back(ms);
      const bool root = b.fn.shampoo->stats().amortized_computations != computations;
      (root ? rep.fn_root_ms : fn_plain_ms).push_back(ms);
      adam_ms.push_back(timed_step(b.adam, b.pool, args.verbose));
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
  fmt::print(
      "  repetition {}/{}: adam {:.2f} ms, shampoo_f1 {:.2f} ms, shampoo_f{} amortized "
      "{:.2f} ms (plain step {:.2f} ms, {} root step(s) [{:.6g}] ms)\n",
      r + 1, args.repetitions, rep.adam_median, rep.f1_median, args.frequency, rep.fn_mean,
      rep.fn_plain_median, rep.fn_root_ms.size(), fmt::join(rep.fn_root_ms, ", "));
  std::fflush(stdout);
  return rep;
}

/// The medians over repetitions (and every per-repetition value) of one configuration.
struct Summary {
  std::vector<double> adam, f1, fn, fn_plain, f1_ratio, fn_ratio, fn_plain_ratio, fn_root;
};

Summary summarize(const std::vector<Rep>& reps) {
  Summary s;
  for (const auto& r : reps) {
    s.adam.push_back(r.adam_median);
    s.f1.push_back(r.f1_median);
    s.fn.push_back(r.fn_mean);
    s.fn_plain.push_back(r.fn_plain_median);
    s.f1_ratio.push_back(r.f1_ratio);
    s.fn_ratio.push_back(r.fn_ratio);
    s.fn_plain_ratio.push_back(r.fn_plain_ratio);
    s.fn_root.insert(s.fn_root.end(), r.fn_root_ms.begin(), r.fn_root_ms.end());
  }
  return s;
}

void print_table(const Bench& b, const Summary& s, const Args& args) {
  const std::string fn_name = fmt::format("shampoo_f{}", args.frequency);
  fmt::print("\n{:<34}{:>14}{:>16}\n{:-<64}\n", "configuration", "median ms", "ratio vs adam", "");
  auto row = [](const std::string& name, double ms, double ratio) {
    fmt::print("{:<34}{:>14.2f}{:>15.2f}x\n", name, ms, ratio);
  };
  const double adam = median(s.adam);
  row("adam", adam, 1.0);
  row("shampoo_f1", median(s.f1), median(s.f1_ratio));
  row(fn_name + " amortized (mean)", median(s.fn), median(s.fn_ratio));
  row(fn_name + " step without root", median(s.fn_plain), median(s.fn_plain_ratio));
  row(fn_name + " step with root", median(s.fn_root), median(s.fn_root) / adam);
  row(fn_name + " grafting phase", median(b.grafting_phase_ms), median(b.grafting_phase_ms) / adam);
  const auto stats = b.fn.shampoo->stats();
  const int64_t adam_bytes = adam_state_bytes(*b.adam.optimizer);
  fmt::print(
      "(ratios: median over repetitions of the same-repetition ratio; the last two rows "
      "divide medians)\nblocks {}, virtual groups {}; state bytes: shampoo {} ({:.1f} MiB), "
      "adam {} ({:.1f} MiB)\n",
      stats.total_blocks, stats.virtual_groups, stats.state_bytes, stats.state_bytes / 1048576.0,
      adam_bytes, adam_bytes / 1048576.0);
}

void print_phase_model(const std::vector<PhaseRow>& phases) {
  PhaseRow total;
  fmt::print(
      "\nphase model (LibTorch primitives on the block stacks, ms):\n"
      "{:<18}{:<14}{:>12}{:>14}{:>12}\n{:-<70}\n",
      "stack", "factor", "update", "precondition", "root", "");
  for (const auto& p : phases) {
    fmt::print("{:<18}{:<14}{:>12.2f}{:>14.2f}{:>12.2f}\n", p.stack, p.factor, p.update_ms,
               p.precondition_ms, p.root_ms);
    total.update_ms += p.update_ms;
    total.precondition_ms += p.precondition_ms;
    total.root_ms += p.root_ms;
  }
  fmt::print("{:<32}{:>12.2f}{:>14.2f}{:>12.2f}\n", "total", total.update_ms, total.precondition_ms,
             total.root_ms);
}

Json results_json(const Bench& b, const Summary& s, const std::vector<PhaseRow>& phases,
                  const Args& args) {
  const std::string fn = fmt::format("shampoo_f{}", args.frequency);
  const auto f1_stats = b.f1.shampoo->stats();
  const auto fn_stats = b.fn.shampoo->stats();
  Json settings{{"repetitions", args.repetitions}, {"shampoo_f1_steps", args.steps},
                {"frequency", args.frequency},     {"window", args.window},
                {"grad_pool", args.grad_pool},     {"batch", args.batch}};
  settings["shampoo"] = {{"lr", 1e-3},
                         {"betas", {0.9, 0.999}},
                         {"epsilon", 1e-12},
                         {"max_preconditioner_dim", 1024},
                         {"grafting", "adam(0.999, 1e-8)"}};
  settings["adam"] = {{"lr", 1e-3}, {"betas", {0.9, 0.999}}, {"eps", 1e-8}};
  Json phase_rows = Json::array();
  for (const auto& p : phases) {
    phase_rows.push_back({{"stack", p.stack},
                          {"factor", p.factor},
                          {"update", p.update_ms},
                          {"precondition", p.precondition_ms},
                          {"root", p.root_ms}});
  }
  return Json{{"benchmark", "optimizer_step"},
              {"label", args.label},
              {"model", mlp_name(kLayerSizes)},
              {"parameters", numel_of(b.init)},
              {"parameter_tensors", b.init.size()},
              {"machine", nullptr},  // set by the caller
              {"settings", settings},
              {"median_ms",
               {{"adam", median(s.adam)},
                {"shampoo_f1", median(s.f1)},
                {fn + "_amortized", median(s.fn)},
                {fn + "_without_root", median(s.fn_plain)},
                {fn + "_with_root", median(s.fn_root)},
                {fn + "_grafting_phase", median(b.grafting_phase_ms)}}},
              {"ratio_vs_adam",
               {{"shampoo_f1", median(s.f1_ratio)},
                {fn + "_amortized", median(s.fn_ratio)},
                {fn + "_without_root", median(s.fn_plain_ratio)}}},
              {"per_repetition_ms",
               {{"adam", s.adam},
                {"shampoo_f1", s.f1},
                {fn + "_amortized", s.fn},
                {fn + "_without_root", s.fn_plain},
                {fn + "_with_root", s.fn_root}}},
              {"shampoo_stats",
               {{"total_blocks", fn_stats.total_blocks},
                {"virtual_groups", fn_stats.virtual_groups},
                {"state_bytes", fn_stats.state_bytes},
                {"shampoo_f1_amortized_computations", f1_stats.amortized_computations},
                {fn + "_amortized_computations", fn_stats.amortized_computations},
                {"failed_amortized_computations",
                 f1_stats.failed_amortized_computations + fn_stats.failed_amortized_computations}}},
              {"adam_state_bytes", adam_state_bytes(*b.adam.optimizer)},
              {"timed_section_s", nullptr},  // set by the caller
              {"phase_model_ms", phase_rows}};
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse_args(argc, argv);
  if (args.threads > 0) at::set_num_threads(static_cast<int>(args.threads));
  torch::manual_seed(0);

  auto model = make_mlp(kLayerSizes);
  Bench b;
  b.init = model->parameters();
  b.pool = make_gradient_pool(model, args.grad_pool, args.batch, kInFeatures, kClasses);
  const double load_before = load_average();
  b.adam = make_adam(b.init);
  b.f1 = make_shampoo(b.init, 1);
  b.fn = make_shampoo(b.init, args.frequency);
  print_header(b, args);
  warm_up(b, args);

  std::vector<Rep> reps;
  const auto run_begin = Clock::now();
  for (int64_t r = 0; r < args.repetitions; ++r) reps.push_back(run_repetition(b, args, r));
  const double run_s = elapsed_ms(run_begin, Clock::now()) / 1000.0;
  const double load_after = load_average();

  const Summary summary = summarize(reps);
  print_table(b, summary, args);
  print_timed_section(run_s, load_before, load_after);
  std::vector<PhaseRow> phases;
  if (!args.no_phases) {
    phases = phase_model(block_stacks(b.init, b.pool[0]));
    print_phase_model(phases);
  }
  if (args.json.empty()) return 0;
  Json json = results_json(b, summary, phases, args);
  json["machine"] = machine_json(load_before, load_after);
  json["timed_section_s"] = run_s;
  return write_json(args.json, json, "bench_optimizer_step") ? 0 : 1;
}
