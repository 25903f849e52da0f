/// The GPU workload of issue 13, "transformer-like": DistributedShampoo on 21 parameter tensors
/// (29.4M parameters), for each root solver setting, measured with the protocol that
/// benchmarks/reference_transformer.py applies to the reference Python implementation.
///
/// Workload: an embedding (4096, 1024); then twice: (3072, 1024), (3072), (1024, 1024), (1024),
/// (4096, 1024), (4096), (1024, 4096), (1024), (1024), (1024). Parameters and three sets of
/// gradients drawn once from torch's CPU generator seeded with 0 (the same numbers the Python
/// script draws), moved to the device; step i copies set i mod 3 into the existing .grad
/// tensors (untimed). Shampoo: lr 1e-3, betas (0.9, 0.999), epsilon 1e-8, decoupled weight decay
/// 1e-5, max_preconditioner_dim 1024, Adam grafting (0.999, 1e-8), bias correction,
/// start_preconditioning_step default (= precondition_frequency).
///
/// Per solver setting, with one optimizer alive at a time:
///   f=N (precondition_frequency N, default 20): warm-up through the first root computation
///     (step N), then `repetitions` windows of `window` consecutive steps (default 40, two root
///     computations each). Amortized ms/step = mean over a window; plain step = median of the
///     window's steps without a root computation; root step = median of those with one; root
///     time = root step − plain step. Medians over the windows.
///   f=1: two warm-up steps, then `steps` timed steps (a root computation each); their median.
///   Peak memory: on CUDA the caching allocator's peak of allocated bytes, reset after setup; on
///     the CPU the tracking allocator's peak of live tensor bytes. Both include the harness's own
///     tensors (parameters, gradients, the three gradient sets), reported separately.
/// Every step is synchronized before and after (torch::cuda::synchronize on CUDA).
///
///   bench_transformer [--device cuda|cpu] [--solvers eigh,coupled-newton,...] [--frequency 20]
///                     [--window 40] [--steps 5] [--repetitions 3] [--one-group-per-tensor]
///                     [--small] [--threads T] [--epsilon 1e-8] [--step-chunk-mb MB]
///                     [--amortize-chunk-mb MB] [--factor-chunk-mb MB]
///                     [--cuda-eigh auto|batched-chunks]
///                     [--memory] [--dense-storage] [--compact-state none|bf16|int8]
///                     [--profile-steps N] [--graft-norms device|host] [--full-outer-products]
///                     [--json PATH] [--label TEXT]
///   --memory (CPU): only the state after two steps, packed and unpacked, by kind (issue 26).
/// Exits 1 when a setting failed (its row says why; the others are still measured).
/// How to run it on a GPU machine: benchmarks/RESULTS.md ("GPU transformer workload").

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <shampoo/shampoo.h>
#include <shampoo/virtual_group.h>
#include <torch/cuda.h>
#include <torch/optim.h>
#include <torch/types.h>
#include <torch/utils.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "benchmarks/bench_support.h"
#include "benchmarks/kernel_profile.h"
#include "benchmarks/tracking_allocator.h"
#include "preconditioners/kronecker_contractions.h"
#include "preconditioners/kronecker_factor_list.h"
#include "preconditioners/kronecker_factors.h"
#include "update/elementwise_chain.h"

#if SHAMPOO_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>

#include "preconditioners/cuda/cuda_eigh.h"
#endif

namespace {

using namespace shampoo::bench;

constexpr int64_t kGradientSets = 3;
constexpr uint64_t kSeed = 0;
/// --small divides every dimension (and max_preconditioner_dim) by this: the same blocks, smaller.
constexpr int64_t kSmallDivisor = 8;

// ---- command line -------------------------------------------------------------------------------

struct Args {
  std::string device = torch::cuda::is_available() ? "cuda" : "cpu";
  std::string solvers = "eigh,coupled-newton,newton-db,newton-db-tf32,coupled-newton-tf32";
  int64_t frequency = 20;
  int64_t window = 40;
  int64_t steps = 5;  // timed steps at frequency 1; 0 skips frequency 1
  int64_t repetitions = 3;
  int64_t threads = 0;  // 0 = LibTorch's default
  double epsilon = 1e-8;
  bool one_group_per_tensor = false;
  bool small = false;
  std::string workload = "transformer";
  int64_t max_dim = 0;            // 0 = 1024 (1024 / 8 with --small)
  int64_t step_chunk_mb = 0;      // 0 = the library's default
  int64_t amortize_chunk_mb = 0;  // 0 = the library's default
  int64_t factor_chunk_mb = 0;    // 0 = the library's default
  std::string cuda_eigh = "auto";
  bool memory = false;
  bool dense_storage = false;
  std::string compact_state = "none";
  int64_t profile_steps = 0;  // 0 = no kernel profile
  std::string graft_norms = "device";
  bool full_outer_products = false;
  std::string json;
  std::string label;
};

Args parse_args(int argc, char** argv) {
  Args args;
  Flags flags("bench_transformer",
              "DistributedShampoo on the transformer-like workload of issue 13, per root solver "
              "(benchmarks/RESULTS.md).");
  flags.add_choice("device", args.device, {"cuda", "cpu"}, "device of the parameters")
      .add("solvers", args.solvers,
           "comma-separated root solver settings: eigh, coupled-newton, newton-db, newton-schulz, "
           "newton-db-tf32, coupled-newton-tf32; or the other preconditioner families: "
           "eigendecomposed, kl-root-inverse, kl-eigendecomposed, eigenvalue-corrected, "
           "spectral-descent (2-D tensors; the others "
           "with adam-preconditioner), sign-descent, adam-preconditioner")
      .add("frequency", args.frequency, "precondition_frequency N of the amortized runs", 2)
      .add("window", args.window, "timed consecutive steps per repetition at frequency N", 1)
      .add("steps", args.steps, "timed steps at frequency 1 (0 skips frequency 1)", 0)
      .add("repetitions", args.repetitions, "timed windows at frequency N (medians over them)", 1)
      .add("threads", args.threads, "intra-op threads (0 = LibTorch's default)", 0)
      .add("epsilon", args.epsilon, "Shampoo's epsilon (issue 13: 1e-8)", 0.0)
      .add_bool("one-group-per-tensor", args.one_group_per_tensor,
                "21 param groups, group i with lr 1e-3·(1 + i/21)")
      .add_bool("small", args.small,
                "every dimension and max_preconditioner_dim divided by 8 (CPU smoke runs)")
      .add_choice("workload", args.workload, {"transformer", "mlp"},
                  "the parameters: issue 13's transformer-like tensors (29.4M), or "
                  "bench_optimizer_step's MLP 784-2048-1024-512-10 (4.2M; issue 28)")
      .add("max-dim", args.max_dim, "max_preconditioner_dim (0 = 1024, or 1024 / 8 with --small)",
           0)
      .add("step-chunk-mb", args.step_chunk_mb,
           "bound on a step's gradient buffers per chunk of rows, MB (0 = the library's "
           "64 MiB; a large value = one chunk, as before chunking)",
           0)
      .add("amortize-chunk-mb", args.amortize_chunk_mb,
           "bound on the factors one amortized computation works on at once, MB (0 = the "
           "library's 32 MiB)",
           0)
      .add("factor-chunk-mb", args.factor_chunk_mb,
           "bound on the outer products a factor update holds at once, MB (0 = the library's "
           "8 MiB; on CUDA, larger bounds batch more blocks per product)",
           0)
      .add_choice("cuda-eigh", args.cuda_eigh, {"auto", "batched-chunks"},
                  "the eigh of factors above 32 on CUDA: auto (divide and conquer on concurrent "
                  "lanes) or batched-chunks (XsyevBatched in fixed batches of 16)")
      .add_bool("dense-storage", args.dense_storage,
                "use_symmetric_packing(false): factors and roots as full matrices (the timing "
                "modes)")
      .add_choice("compact-state", args.compact_state, {"none", "bf16", "int8"},
                  "compact_state of the timing modes (none, bf16 or int8)")
      .add("profile-steps", args.profile_steps,
           "after each setting's f=N windows, this many plain steps (no roots) under LibTorch's "
           "Kineto profiler: device time by kernel, and the plain step's matmul floor (CUDA); "
           "host time per shampoo:: scope and per outermost ATen op (CPU)",
           0)
      .add_choice("graft-norms", args.graft_norms, {"device", "host"},
                  "CUDA: where the grafting ratios are formed, on the device (the library's "
                  "default, no synchronization) or on the host (the norms copied back, as before)")
      .add_bool("full-outer-products", args.full_outer_products,
                "CUDA: the factor updates' outer products in full, as before (the library's "
                "default computes their lower blocks only, 3/4 of the multiplications)")
      .add_bool("memory", args.memory,
                "only the state: per solver, packed and unpacked, the bytes the tracking "
                "allocator sees the optimizer keep after two steps (CPU) against "
                "memory_summary() by kind");
  add_output_flags(flags, args.json, args.label);
  parse_flags_or_exit(flags, "bench_transformer", argc, argv);
  return args;
}

// ---- solver settings ----------------------------------------------------------------------------

/// A setting: root-inverse Shampoo with one of its solvers, or another preconditioner family
/// (issue 16). `matrix_only`: the family takes 2-D blocks only (spectral descent); the other
/// tensors then form a second param group with the Adam main preconditioner.
struct SolverSetting {
  std::string name;
  shampoo::PreconditionerConfig config;
  bool matrix_only = false;
};

/// The settings of the other families, by name; false when `name` is none of them.
bool family_setting(const std::string& name, SolverSetting& out) {
  out.name = name;
  if (name == "eigendecomposed") {
    out.config = shampoo::EigendecomposedShampooConfig{};
  } else if (name == "kl-root-inverse") {
    out.config = shampoo::RootInvKLShampooConfig{};
  } else if (name == "kl-eigendecomposed") {
    out.config = shampoo::EigendecomposedKLShampooConfig{};
  } else if (name == "eigenvalue-corrected") {
    out.config = shampoo::EigenvalueCorrectedShampooConfig{};
  } else if (name == "spectral-descent") {
    out.config = shampoo::SpectralDescentConfig{};
    out.matrix_only = true;
  } else if (name == "sign-descent") {
    out.config = shampoo::SignDescentConfig{};
  } else if (name == "adam-preconditioner") {
    out.config = shampoo::AdamPreconditionerConfig{};
  } else {
    return false;
  }
  return true;
}

SolverSetting solver_setting(const std::string& name) {
  using shampoo::RootSolver;
  SolverSetting family;
  if (family_setting(name, family)) return family;
  shampoo::RootInvShampooConfig c;
  if (name == "eigh") {
    c.solver = RootSolver::kEigh;
  } else if (name == "coupled-newton" || name == "coupled-newton-tf32") {
    c.solver = RootSolver::kCoupledNewton;
  } else if (name == "newton-db" || name == "newton-db-tf32") {
    c.solver = RootSolver::kNewtonDB;
  } else if (name == "newton-schulz") {
    c.solver = RootSolver::kNewtonSchulz;
  } else {
    throw std::invalid_argument(
        fmt::format("--solvers: got '{}', expected a comma-separated list of eigh, coupled-newton, "
                    "newton-db, newton-db-tf32, coupled-newton-tf32, newton-schulz or the families "
                    "eigendecomposed, kl-root-inverse, kl-eigendecomposed, eigenvalue-corrected, "
                    "spectral-descent, sign-descent, "
                    "adam-preconditioner",
                    name));
  }
  if (name.ends_with("-tf32")) {
    c.tf32 = true;
    c.tolerance = 3e-2;  // TF32 products floor the error near 1e-2 (shampoo_options.h)
  }
  return {name, c, false};
}

std::vector<SolverSetting> solver_settings(const std::string& list) {
  std::vector<SolverSetting> settings;
  std::stringstream in(list);
  std::string name;
  while (std::getline(in, name, ',')) {
    if (!name.empty()) settings.push_back(solver_setting(name));
  }
  if (settings.empty()) throw std::invalid_argument("--solvers: got an empty list");
  return settings;
}

std::string solver_name(shampoo::RootSolver s) {
  switch (s) {
    case shampoo::RootSolver::kEigh:
      return "eigh";
    case shampoo::RootSolver::kCoupledNewton:
      return "coupled_newton";
    case shampoo::RootSolver::kNewtonDB:
      return "newton_db";
    case shampoo::RootSolver::kCoupledHigherOrder:
      return "coupled_higher_order";
    case shampoo::RootSolver::kNewtonSchulz:
      return "newton_schulz";
  }
  return "unknown";
}

// ---- device: synchronization and peak memory ----------------------------------------------------

void synchronize(const at::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize();
}

/// Starts a new peak measurement at the bytes allocated now.
void reset_peak_memory(const at::Device& device) {
  if (device.is_cpu()) {
    TrackingAllocator::install().reset_peak();
    return;
  }
#if SHAMPOO_WITH_CUDA
  c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#endif
}

/// Peak bytes allocated since reset_peak_memory; −1 when this build cannot read it.
int64_t peak_memory_bytes(const at::Device& device) {
  if (device.is_cpu()) return TrackingAllocator::install().peak();
#if SHAMPOO_WITH_CUDA
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
  return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
      .peak;
#else
  return -1;
#endif
}

/// Bytes allocated now (CUDA caching allocator; the tracking allocator on the CPU).
int64_t current_memory_bytes(const at::Device& device) {
  if (device.is_cpu()) return TrackingAllocator::install().live();
#if SHAMPOO_WITH_CUDA
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
  return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)]
      .current;
#else
  return -1;
#endif
}

// ---- workload -----------------------------------------------------------------------------------

/// Parameters (with their .grad tensors allocated) and the gradient sets, on the device.
struct Workload {
  at::Device device{at::kCPU};
  std::vector<std::vector<int64_t>> shapes;
  std::vector<at::Tensor> params;
  std::vector<std::vector<at::Tensor>> gradient_sets;
  int64_t harness_bytes = 0;  // parameters + gradients + gradient sets
  /// Sum of every initial parameter and gradient entry (float64): equal to the Python script's
  /// when both drew the same numbers.
  double checksum = 0.0;
};

/// Draws the initial parameters (0.02·N(0, 1)) and then the gradient sets (N(0, 1)) from the CPU
/// generator seeded with kSeed, in that order, shape by shape: the numbers of the Python script.
/// Returns the parameters' initial values on the CPU.
std::vector<at::Tensor> draw_parameters(const Workload& w) {
  torch::manual_seed(kSeed);
  std::vector<at::Tensor> init;
  for (const auto& s : w.shapes) init.push_back(at::randn(s) * 0.02);
  return init;
}

void reset_parameters(Workload& w) {
  torch::NoGradGuard no_grad;
  const auto init = draw_parameters(w);
  for (size_t i = 0; i < init.size(); ++i) w.params[i].copy_(init[i]);
}

int64_t max_dim(const Args& args) {
  if (args.max_dim > 0) return args.max_dim;
  return args.small ? 1024 / kSmallDivisor : 1024;
}

Workload make_workload(const at::Device& device, const Args& args) {
  Workload w;
  w.device = device;
  const int64_t divisor = args.small ? kSmallDivisor : 1;
  w.shapes =
      args.workload == "mlp" ? mlp_workload_shapes(divisor) : transformer_workload_shapes(divisor);
  for (const auto& p : draw_parameters(w)) {
    w.params.push_back(p.to(device).set_requires_grad(true));
  }
  for (int64_t k = 0; k < kGradientSets; ++k) {
    std::vector<at::Tensor> set;
    for (const auto& s : w.shapes) set.push_back(at::randn(s).to(device));
    w.gradient_sets.push_back(std::move(set));
  }
  set_gradients(w.params, w.gradient_sets[0]);  // allocates the .grad tensors once
  std::vector<at::Tensor> grads;
  for (const auto& p : w.params) grads.push_back(p.grad());
  w.harness_bytes = nbytes_of(w.params) + nbytes_of(grads);
  for (const auto& set : w.gradient_sets) w.harness_bytes += nbytes_of(set);
  for (const auto& p : w.params) w.checksum += p.to(at::kDouble).sum().item<double>();
  for (const auto& set : w.gradient_sets) {
    for (const auto& g : set) w.checksum += g.to(at::kDouble).sum().item<double>();
  }
  synchronize(device);
  return w;
}

shampoo::ShampooOptions transformer_options(int64_t frequency,
                                            const shampoo::PreconditionerConfig& solver,
                                            const Args& args) {
  return shampoo::ShampooOptions::reference_defaults(1e-3)
      .betas(std::make_tuple(0.9, 0.999))
      .epsilon(args.epsilon)
      .weight_decay(1e-5)
      .weight_decay_type(shampoo::WeightDecayType::kDecoupled)
      .max_preconditioner_dim(max_dim(args))
      .precondition_frequency(frequency)
      .use_bias_correction(true)
      .grafting(shampoo::AdamGraftingConfig{0.999, 1e-8})
      .use_symmetric_packing(!args.dense_storage)
      .compact_state(args.compact_state == "int8"   ? shampoo::CompactState::kInt8
                     : args.compact_state == "bf16" ? shampoo::CompactState::kBfloat16
                                                    : shampoo::CompactState::kNone)
      .preconditioner(solver);
}

// ---- one optimizer's run ------------------------------------------------------------------------

/// One optimizer over the workload's parameters, reset to their initial values.
struct Run {
  Workload* workload;
  std::unique_ptr<shampoo::DistributedShampoo> optimizer;
  int64_t steps_taken = 0;
};

/// Spectral descent's two param groups: the 2-D tensors with it, the others with the Adam main
/// preconditioner.
std::vector<torch::optim::OptimizerParamGroup> matrix_groups(
    const Workload& w, const shampoo::ShampooOptions& options) {
  std::vector<at::Tensor> matrices, others;
  for (const auto& p : w.params) (p.dim() == 2 ? matrices : others).push_back(p);
  auto other_options = options;
  other_options.preconditioner(shampoo::AdamPreconditionerConfig{});
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(matrices, std::make_unique<shampoo::ShampooOptions>(options));
  groups.emplace_back(others, std::make_unique<shampoo::ShampooOptions>(other_options));
  return groups;
}

Run make_run(Workload& w, const shampoo::ShampooOptions& options, bool one_group_per_tensor,
             bool matrix_only = false) {
  reset_parameters(w);
  Run run{&w, nullptr, 0};
  if (matrix_only) {
    run.optimizer =
        std::make_unique<shampoo::DistributedShampoo>(matrix_groups(w, options), options);
  } else if (one_group_per_tensor) {
    const auto groups = static_cast<int64_t>(w.params.size());
    run.optimizer = std::make_unique<shampoo::DistributedShampoo>(
        lr_param_groups(w.params, groups, options), options);
  } else {
    run.optimizer = std::make_unique<shampoo::DistributedShampoo>(w.params, options);
  }
  synchronize(w.device);
  reset_peak_memory(w.device);
  return run;
}

/// Copies gradient set (steps taken mod 3) into .grad (untimed), then times step() between two
/// synchronizations. `root` tells whether the step computed inverse roots.
double timed_step(Run& run, bool* root = nullptr) {
  Workload& w = *run.workload;
  set_gradients(w.params, w.gradient_sets[static_cast<size_t>(run.steps_taken % kGradientSets)]);
  const auto computations = run.optimizer->stats().amortized_computations;
  synchronize(w.device);
  const auto begin = Clock::now();
  run.optimizer->step();
  synchronize(w.device);
  const double ms = elapsed_ms(begin, Clock::now());
  ++run.steps_taken;
  if (root != nullptr) *root = run.optimizer->stats().amortized_computations != computations;
  return ms;
}

// ---- measurements -------------------------------------------------------------------------------

/// --profile-steps: steps on until one computes roots, then the plain steps after it (at most
/// f − 1, so none computes roots) under the Kineto profiler: device time by kernel.
void profile_plain_steps(Run& run, const std::string& name, const Args& args) {
  bool root = false;
  for (int64_t i = 0; i < args.frequency && !root; ++i) timed_step(run, &root);
  const int64_t steps = std::min(args.profile_steps, args.frequency - 1);
  if (!root || steps < 1) {
    fmt::print("  {}: no kernel profile (no root step within f = {} steps)\n", name,
               args.frequency);
    return;
  }
  const auto computations = run.optimizer->stats().amortized_computations;
  const auto profile = profile_kernels(run.workload->device, [&] {
    for (int64_t i = 0; i < steps; ++i) timed_step(run);
  });
  const bool plain = run.optimizer->stats().amortized_computations == computations;
  fmt::print("  {} kernel profile of {} plain step(s){}:\n", name, steps,
             plain ? "" : " (one of them computed roots)");
  print_kernel_profile(profile, steps, 15);
}

/// --profile-steps on CUDA: the float32 products of a plain step (per 2-D block [m, n]: the
/// factor updates G·Gᵀ and Gᵀ·G, and L·G·R, 4·m·n·(m + n) flop; the 1-D blocks' matrix-vector
/// work is left out) and the time they take at the rate at::bmm reaches on a stack of the
/// workload's blocks of max_preconditioner_dim² (median of 10 after 3 warm-ups).
void print_matmul_floor(const Workload& w, const Args& args) {
  const int64_t d = max_dim(args);
  double flop = 0.0;
  int64_t square = 0;
  for (const auto& shape : w.shapes) {
    if (shape.size() != 2) continue;
    for (int64_t r = 0; r < shape[0]; r += d) {
      for (int64_t c = 0; c < shape[1]; c += d) {
        const double m = static_cast<double>(std::min(d, shape[0] - r));
        const double n = static_cast<double>(std::min(d, shape[1] - c));
        flop += 4.0 * m * n * (m + n);
        if (m == d && n == d) ++square;
      }
    }
  }
  const int64_t stack = std::max<int64_t>(square, 1);
  const auto options = at::TensorOptions().device(w.device).dtype(at::kFloat);
  const auto a = at::randn({stack, d, d}, options);
  const auto b = at::randn({stack, d, d}, options);
  std::vector<double> ms;
  for (int i = 0; i < 13; ++i) {
    synchronize(w.device);
    const auto begin = Clock::now();
    at::bmm(a, b);
    synchronize(w.device);
    if (i >= 3) ms.push_back(elapsed_ms(begin, Clock::now()));
  }
  const double rate = 2.0 * static_cast<double>(stack) * d * d * d / (median(ms) * 1e-3);
  fmt::print(
      "matmul floor of a plain step: {:.1f} GFLOP of float32 products; at::bmm on [{}, {}, {}] "
      "float32: {:.3f} ms, {:.1f} TFLOP/s; floor {:.2f} ms\n",
      flop / 1e9, stack, d, d, median(ms), rate / 1e12, flop / rate * 1e3);
  std::fflush(stdout);
}

struct Amortized {
  std::vector<double> window_mean_ms;   // per window: mean of its steps
  std::vector<double> plain_median_ms;  // per window: median of its steps without roots
  std::vector<double> root_step_ms;     // every step with roots, all windows
  int64_t peak_bytes = -1;
  shampoo::ShampooStats stats;
};

Amortized measure_amortized(Workload& w, const SolverSetting& setting, const Args& args) {
  const auto options = transformer_options(args.frequency, setting.config, args);
  Run run = make_run(w, options, args.one_group_per_tensor, setting.matrix_only);
  const int64_t start = options.resolved_start_preconditioning_step();
  for (int64_t i = 0; i < start; ++i) timed_step(run);  // warm-up through the first roots
  Amortized a;
  for (int64_t r = 0; r < args.repetitions; ++r) {
    std::vector<double> all, plain;
    for (int64_t i = 0; i < args.window; ++i) {
      bool root = false;
      const double ms = timed_step(run, &root);
      all.push_back(ms);
      (root ? a.root_step_ms : plain).push_back(ms);
    }
    a.window_mean_ms.push_back(mean(all));
    a.plain_median_ms.push_back(median(plain));
    fmt::print("  {} f={} window {}/{}: {:.2f} ms/step, plain step {:.2f} ms, {} root step(s)\n",
               setting.name, args.frequency, r + 1, args.repetitions, a.window_mean_ms.back(),
               a.plain_median_ms.back(), all.size() - plain.size());
    std::fflush(stdout);
  }
  a.peak_bytes = peak_memory_bytes(w.device);
  a.stats = run.optimizer->stats();
  if (args.profile_steps > 0) profile_plain_steps(run, setting.name, args);
  return a;
}

struct EveryStep {
  std::vector<double> step_ms;
  int64_t peak_bytes = -1;
  shampoo::ShampooStats stats;
};

/// --memory: per solver setting and storage (use_symmetric_packing on, off; compact_state bf16 and
/// int8, packed), an optimizer at
/// frequency N takes two steps (no root computation yet: the state is allocated at construction
/// and the β1 filter at the first step); the bytes live after them minus those live before the
/// optimizer existed (the tracking allocator: every tensor) against memory_summary() by kind.
int print_state_memory(Workload& w, const std::vector<SolverSetting>& settings, const Args& args) {
  if (!w.device.is_cpu()) {
    fmt::print(stderr, "bench_transformer: --memory counts with the CPU tracking allocator\n");
    return 2;
  }
  fmt::print(
      "State after two steps (MB = 1e6 bytes): 'tracked' = tensor bytes live after the steps "
      "minus those live before the optimizer (harness {:.1f} MB); the kinds from "
      "memory_summary(); 'journal' = what a third step (not recomputing roots) saved to undo "
      "itself, with a no-op phase hook that makes a single process keep its journal as a "
      "distributed step does (its parameters included, which a distributed step does not "
      "copy)\n\n| setting | storage | tracked | memory_summary | factors | inverse "
      "roots | eigenvectors | other | grafting | filtered gradient | momentum | journal |\n"
      "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
      w.harness_bytes / 1e6);
  struct Storage {
    const char* name;
    bool packed;
    shampoo::CompactState compact;
  };
  const Storage storages[] = {{"packed", true, shampoo::CompactState::kNone},
                              {"dense", false, shampoo::CompactState::kNone},
                              {"packed, compact bf16", true, shampoo::CompactState::kBfloat16},
                              {"packed, compact int8", true, shampoo::CompactState::kInt8}};
  for (const auto& setting : settings) {
    for (const auto& storage : storages) {
      const bool packed = storage.packed;
      const int64_t before = current_memory_bytes(w.device);
      int64_t tracked = 0;
      shampoo::MemorySummary m;
      int64_t journal = 0;
      {
        auto options = transformer_options(args.frequency, setting.config, args);
        options.use_symmetric_packing(packed).compact_state(storage.compact);
        Run run = make_run(w, options, args.one_group_per_tensor, setting.matrix_only);
        for (int i = 0; i < 2; ++i) timed_step(run);
        tracked = current_memory_bytes(w.device) - before;
        m = run.optimizer->memory_summary();
        run.optimizer->set_fault_injector_for_testing([](shampoo::FaultPoint) {});
        timed_step(run);
        journal = run.optimizer->memory_summary().scratch_last_step;
      }
      const auto mb = [](int64_t b) { return fmt::format("{:.1f}", static_cast<double>(b) / 1e6); };
      fmt::print("| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n", setting.name,
                 storage.name, mb(tracked), mb(m.state_total()), mb(m.factors), mb(m.inverse_roots),
                 mb(m.eigenvectors), mb(m.preconditioner_other), mb(m.grafting),
                 mb(m.filtered_gradient), mb(m.momentum), mb(journal));
      std::fflush(stdout);
    }
  }
  return 0;
}

/// One more step of `run` with the memory at each phase of the step (shampoo/fault_point.h):
/// bytes allocated at the phase and the peak since the previous one, in MB above the bytes
/// allocated before the step. The phase hook makes the step keep its undo journal (copies of
/// the state it changes, alive from before the statistics to the end); its bytes are reported
/// and subtracted, so the figures are those of an ordinary step.
void print_memory_phases(Run& run, const std::string& name) {
  const auto& device = run.workload->device;
  synchronize(device);
  const int64_t base = current_memory_bytes(device);
  struct Phase {
    const char* name;
    int64_t now, peak;
  };
  std::vector<Phase> phases;
  auto record = [&](const char* phase) {
    synchronize(device);
    phases.push_back(
        {phase, current_memory_bytes(device) - base, peak_memory_bytes(device) - base});
    reset_peak_memory(device);
  };
  run.optimizer->set_fault_injector_for_testing([&](shampoo::FaultPoint phase) {
    constexpr const char* kNames[] = {"statistics+roots", "preconditioned", "computed", "exchange"};
    record(kNames[static_cast<int>(phase)]);
  });
  reset_peak_memory(device);
  timed_step(run);
  record("end");
  run.optimizer->set_fault_injector_for_testing(nullptr);
  const int64_t journal = run.optimizer->stats().rollback_bytes_last_step;
  std::vector<std::string> parts;
  for (size_t i = 0; i < phases.size(); ++i) {
    const int64_t j = i + 1 < phases.size() ? journal : 0;  // released at the end
    parts.push_back(fmt::format("{} now {:.1f} peak {:.1f}", phases[i].name,
                                (phases[i].now - j) / 1e6, (phases[i].peak - journal) / 1e6));
  }
  fmt::print(
      "  {} memory by phase (MB above the {:.1f} before the step; journal {:.1f} MB "
      "subtracted): {}\n",
      name, base / 1e6, journal / 1e6, fmt::join(parts, "; "));
}

EveryStep measure_every_step(Workload& w, const SolverSetting& setting, const Args& args) {
  EveryStep e;
  if (args.steps == 0) return e;
  Run run = make_run(w, transformer_options(1, setting.config, args), args.one_group_per_tensor,
                     setting.matrix_only);
  for (int i = 0; i < 2; ++i) timed_step(run);  // warm-up: allocations, the first roots
  for (int64_t i = 0; i < args.steps; ++i) e.step_ms.push_back(timed_step(run));
  e.peak_bytes = peak_memory_bytes(w.device);
  e.stats = run.optimizer->stats();
  print_memory_phases(run, setting.name);
  fmt::print("  {} f=1: median {:.2f} ms/step over {} steps [{:.1f}]; {} roots by eigh fallback\n",
             setting.name, median(e.step_ms), e.step_ms.size(), fmt::join(e.step_ms, ", "),
             e.stats.root_solver_fallbacks);
  std::fflush(stdout);
  return e;
}

struct SolverResult {
  SolverSetting setting;
  Amortized amortized;
  EveryStep every_step;
  std::string error;  // what stopped the setting's runs ("" = none)

  double amortized_ms() const { return median(amortized.window_mean_ms); }
  double plain_ms() const { return median(amortized.plain_median_ms); }
  double root_step_ms() const { return median(amortized.root_step_ms); }
  /// 0 for the families without an amortized computation (no step with roots).
  double root_ms() const {
    return amortized.root_step_ms.empty() ? 0.0 : root_step_ms() - plain_ms();
  }
  bool has_every_step() const { return !every_step.step_ms.empty(); }
  double every_step_ms() const { return median(every_step.step_ms); }
  int64_t peak_bytes() const { return std::max(amortized.peak_bytes, every_step.peak_bytes); }
};

/// Both runs of one setting; an exception (e.g. a root computation that failed more often than
/// tolerated) ends the setting's runs and is reported in its row.
SolverResult run_setting(Workload& w, const SolverSetting& setting, const Args& args) {
  SolverResult r{setting, {}, {}, {}};
  try {
    r.amortized = measure_amortized(w, setting, args);
    r.every_step = measure_every_step(w, setting, args);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    r.error = what.substr(0, what.find('\n'));
    fmt::print("  {}: failed: {}\n", setting.name, r.error);
  }
  return r;
}

// ---- output -------------------------------------------------------------------------------------

std::string megabytes(int64_t bytes) {
  return bytes < 0 ? "n/a" : fmt::format("{:.1f}", static_cast<double>(bytes) / 1e6);
}

void print_header(const Workload& w, const Args& args) {
  fmt::print(
      "bench_transformer: {} workload, {} parameters in {} tensors{}, max_preconditioner_dim {}, "
      "device {}, LibTorch {}\n"
      "  frequency {}: warm-up {} steps, {} window(s) of {} steps; frequency 1: {} timed steps; "
      "{}, epsilon {:g}, step chunks {} MiB, amortize chunks {} MiB, factor update chunks {} MiB, "
      "eigh {}, grafting norms on the {}, {} outer products\n  harness tensors "
      "(parameters, gradients, {} gradient "
      "sets): {} MB\n",
      args.workload, numel_of(w.params), w.params.size(),
      args.small ? " (--small: dimensions / 8)" : "", max_dim(args), w.device.str(), TORCH_VERSION,
      args.frequency, args.frequency, args.repetitions, args.window, args.steps,
      args.one_group_per_tensor ? "21 param groups" : "one param group", args.epsilon,
      shampoo::detail::step_chunk_bytes() >> 20, shampoo::detail::amortize_chunk_bytes() >> 20,
      shampoo::detail::factor_update_chunk_bytes(w.device) >> 20, args.cuda_eigh, args.graft_norms,
      args.full_outer_products ? "full" : "lower-block", kGradientSets, megabytes(w.harness_bytes));
  std::fflush(stdout);
}

void print_table(const std::vector<SolverResult>& results, const Workload& w, const Args& args) {
  const int64_t f = args.frequency;
  fmt::print(
      "\n| solver | f={} ms/step | f={} plain step ms | root ms | f=1 ms/step | peak MB |\n"
      "|---|---|---|---|---|---|\n",
      f, f);
  for (const auto& r : results) {
    if (!r.error.empty()) {
      fmt::print("| {} | failed: {} | | | | |\n", r.setting.name, r.error.substr(0, 120));
      continue;
    }
    fmt::print("| {} | {:.2f} | {:.2f} | {:.1f} | {} | {} |\n", r.setting.name, r.amortized_ms(),
               r.plain_ms(), r.root_ms(),
               r.has_every_step() ? fmt::format("{:.1f}", r.every_step_ms()) : "—",
               megabytes(r.peak_bytes()));
  }
  fmt::print(
      "\nf={}: mean over a window of {} steps (median of {} windows); plain step: median of "
      "the steps without roots; root = step with roots − plain step. Peak MB (1e6 bytes) "
      "includes the harness's {} MB of parameters, gradients and gradient sets. {}\n",
      f, args.window, args.repetitions, megabytes(w.harness_bytes),
      args.one_group_per_tensor ? "21 param groups." : "One param group.");
}

/// The root solver of a root-inverse setting; the family's name for the others.
Json config_json(const SolverSetting& setting) {
  const auto* c = std::get_if<shampoo::RootInvShampooConfig>(&setting.config);
  if (c == nullptr) return Json{{"family", setting.name}};
  return Json{{"solver", solver_name(c->solver)},
              {"max_iterations", c->max_iterations},
              {"tolerance", c->tolerance},
              {"tf32", c->tf32}};
}

Json solver_json(const SolverResult& r) {
  const auto& s = r.amortized.stats;
  return Json{{"name", r.setting.name},
              {"error", r.error.empty() ? Json(nullptr) : Json(r.error)},
              {"config", config_json(r.setting)},
              {"amortized_ms", r.amortized_ms()},
              {"plain_step_ms", r.plain_ms()},
              {"root_step_ms", r.root_step_ms()},
              {"root_ms", r.root_ms()},
              {"every_step_ms", r.has_every_step() ? Json(r.every_step_ms()) : Json(nullptr)},
              {"peak_bytes", r.peak_bytes()},
              {"peak_bytes_amortized", r.amortized.peak_bytes},
              {"peak_bytes_every_step", r.every_step.peak_bytes},
              {"per_window_ms", r.amortized.window_mean_ms},
              {"per_window_plain_ms", r.amortized.plain_median_ms},
              {"root_steps_ms", r.amortized.root_step_ms},
              {"every_steps_ms", r.every_step.step_ms},
              {"virtual_groups", s.virtual_groups},
              {"total_blocks", s.total_blocks},
              {"state_bytes", s.state_bytes},
              {"amortized_computations", s.amortized_computations},
              {"failed_amortized_computations",
               s.failed_amortized_computations + r.every_step.stats.failed_amortized_computations},
              {"double_precision_retries",
               s.double_precision_retries + r.every_step.stats.double_precision_retries},
              {"root_solver_fallbacks",
               s.root_solver_fallbacks + r.every_step.stats.root_solver_fallbacks}};
}

Json results_json(const std::vector<SolverResult>& results, const Workload& w, const Args& args) {
  Json shapes = Json::array();
  for (const auto& s : w.shapes) shapes.push_back(s);
  Json settings{{"device", w.device.str()},
                {"frequency", args.frequency},
                {"window", args.window},
                {"repetitions", args.repetitions},
                {"every_step_steps", args.steps},
                {"one_group_per_tensor", args.one_group_per_tensor},
                {"small", args.small},
                {"workload", args.workload},
                {"step_chunk_bytes", shampoo::detail::step_chunk_bytes()},
                {"amortize_chunk_bytes", shampoo::detail::amortize_chunk_bytes()},
                {"factor_update_chunk_bytes", shampoo::detail::factor_update_chunk_bytes(w.device)},
                {"cuda_eigh", args.cuda_eigh},
                {"shapes", shapes},
                {"shampoo",
                 {{"lr", 1e-3},
                  {"betas", {0.9, 0.999}},
                  {"epsilon", args.epsilon},
                  {"weight_decay", 1e-5},
                  {"weight_decay_type", "decoupled"},
                  {"max_preconditioner_dim", max_dim(args)},
                  {"grafting", "adam(0.999, 1e-8)"},
                  {"use_bias_correction", true}}}};
  Json solvers = Json::array();
  for (const auto& r : results) solvers.push_back(solver_json(r));
  return Json{{"benchmark", "bench_transformer"},
              {"label", args.label},
              {"parameters", numel_of(w.params)},
              {"parameter_tensors", w.params.size()},
              {"harness_bytes", w.harness_bytes},
              {"workload_checksum", w.checksum},
              {"settings", settings},
              {"solvers", solvers},
              {"machine", nullptr}};
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse_args(argc, argv);
  if (args.threads > 0) at::set_num_threads(static_cast<int>(args.threads));
  shampoo::detail::set_step_chunk_bytes_for_testing(args.step_chunk_mb << 20);
  shampoo::detail::set_amortize_chunk_bytes_for_benchmarks(args.amortize_chunk_mb << 20);
  shampoo::detail::set_factor_update_chunk_bytes_for_benchmarks(args.factor_chunk_mb << 20);
  shampoo::detail::set_chain_norms_on_device(args.graft_norms == "device");
  shampoo::detail::set_lower_outer_products_for_benchmarks(!args.full_outer_products);
  if (args.cuda_eigh != "auto") {
#if SHAMPOO_WITH_CUDA
    shampoo::detail::set_large_eigh_method_for_benchmarks(
        shampoo::detail::CudaEighMethod::kBatchedChunks);
#else
    fmt::print(stderr, "bench_transformer: --cuda-eigh {}: this build has no CUDA (auto only)\n",
               args.cuda_eigh);
    return 2;
#endif
  }
  std::vector<SolverSetting> settings;
  try {
    settings = solver_settings(args.solvers);
  } catch (const std::invalid_argument& e) {
    fmt::print(stderr, "bench_transformer: {} (see --help)\n", e.what());
    return 2;
  }
  if (args.device == "cuda" && !torch::cuda::is_available()) {
    fmt::print(stderr, "bench_transformer: --device cuda, but no CUDA device is available\n");
    return 2;
  }
  const at::Device device = args.device == "cuda" ? at::Device(at::kCUDA, 0) : at::kCPU;
  if (device.is_cpu()) TrackingAllocator::install();  // counts every tensor from here on
  const double load_before = load_average();
  Workload w = make_workload(device, args);
  print_header(w, args);
  if (args.memory) return print_state_memory(w, settings, args);
  if (args.profile_steps > 0 && device.is_cuda()) print_matmul_floor(w, args);
  std::vector<SolverResult> results;
  for (const auto& s : settings) results.push_back(run_setting(w, s, args));
  print_table(results, w, args);
  const bool all_ran =
      std::all_of(results.begin(), results.end(), [](const auto& r) { return r.error.empty(); });
  if (args.json.empty()) return all_ran ? 0 : 1;
  Json json = results_json(results, w, args);
  json["machine"] = machine_json(load_before, load_average());
  return write_json(args.json, json, "bench_transformer") && all_ran ? 0 : 1;
}
