/// Step time of every preconditioner family of DistributedShampoo against root-inverse Shampoo
/// and torch::optim::Adam, on the model of bench_optimizer_step (MLP 784-2048-1024-512-10), in
/// one run.
///
/// Every optimizer has its own copy of the same initial parameters and sees the same gradient
/// sequence (a pool of real forward/backward passes, copied into .grad() outside the timed
/// region). Within a repetition the optimizers step in turn, one step each, for a window of
/// `--frequency` consecutive steps (so every Kronecker family does exactly one amortized
/// computation per window); the order of the turn rotates every repetition. Reported per family:
/// the mean step time over the window (amortized), its ratio to Adam's mean over the same window,
/// medians over repetitions, and the state bytes.
///
/// Settings (the family's usual use, documented in benchmarks/RESULTS.md): lr 1e-3, betas
/// (0.9, 0.999), max_preconditioner_dim 1024. The Kronecker families (root inverse,
/// eigendecomposed, their KL variants) use Adam grafting and epsilon 1e-12 like
/// bench_optimizer_step; eigenvalue-corrected Shampoo, the diagonal, sign and spectral families run
/// without grafting. Spectral descent is for 2-D blocks only: the biases form a second param group
/// with the Adam main preconditioner.
///
///   bench_families [--repetitions 3] [--frequency 20] [--threads T] [--grad-pool 8]
///                  [--batch 128] [--families a,b,...] [--json PATH] [--label TEXT]

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <shampoo/shampoo.h>
#include <torch/optim/adam.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "benchmarks/bench_support.h"

namespace {

using namespace shampoo::bench;

constexpr int64_t kLayerSizes[] = {784, 2048, 1024, 512, 10};
constexpr int64_t kInFeatures = kLayerSizes[0];
constexpr int64_t kClasses = kLayerSizes[std::size(kLayerSizes) - 1];

struct Args {
  int64_t repetitions = 3;
  int64_t frequency = 20;
  int64_t threads = 0;
  int64_t grad_pool = 8;
  int64_t batch = 128;
  std::string families;  // empty = all
  std::string json;
  std::string label;
};

using Maker = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>&)>;

/// One benchmarked optimizer: its name, how it is built, and its run.
struct Subject {
  std::string name;
  Maker make;
  std::vector<at::Tensor> params;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  int64_t steps_taken = 0;
  std::vector<double> window_mean_ms;  // per repetition
  std::vector<double> ratio_vs_adam;   // per repetition
};

/// ShampooOptions of a family: the benchmark's common settings with `preconditioner`.
shampoo::ShampooOptions family_options(const Args& args, shampoo::PreconditionerConfig config,
                                       bool grafting) {
  auto options = shampoo_options(args.frequency, args.frequency).preconditioner(std::move(config));
  if (!grafting) options.grafting(std::monostate{});
  return options;
}

Maker shampoo_maker(const Args& args, shampoo::PreconditionerConfig config, bool grafting) {
  return [options = family_options(args, std::move(config), grafting)](
             std::vector<at::Tensor>& params) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<shampoo::DistributedShampoo>(params, options);
  };
}

/// Spectral descent on the 2-D weights, the Adam main preconditioner on everything else.
Maker spectral_maker(const Args& args) {
  return [args](std::vector<at::Tensor>& params) -> std::unique_ptr<torch::optim::Optimizer> {
    std::vector<at::Tensor> matrices, others;
    for (const auto& p : params) (p.dim() == 2 ? matrices : others).push_back(p);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(matrices, std::make_unique<shampoo::ShampooOptions>(family_options(
                                      args, shampoo::SpectralDescentConfig{}, false)));
    groups.emplace_back(others, std::make_unique<shampoo::ShampooOptions>(family_options(
                                    args, shampoo::AdamPreconditionerConfig{}, false)));
    return std::make_unique<shampoo::DistributedShampoo>(std::move(groups));
  };
}

std::vector<Subject> all_subjects(const Args& args) {
  std::vector<Subject> s;
  auto add = [&](std::string name, Maker make) {
    Subject subject;
    subject.name = std::move(name);
    subject.make = std::move(make);
    s.push_back(std::move(subject));
  };
  add("adam", [](std::vector<at::Tensor>& params) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<torch::optim::Adam>(
        params, torch::optim::AdamOptions(1e-3).betas(std::make_tuple(0.9, 0.999)).eps(1e-8));
  });
  add("root_inverse", shampoo_maker(args, shampoo::RootInvShampooConfig{}, true));
  add("eigendecomposed", shampoo_maker(args, shampoo::EigendecomposedShampooConfig{}, true));
  add("kl_root_inverse", shampoo_maker(args, shampoo::RootInvKLShampooConfig{}, true));
  add("kl_eigendecomposed", shampoo_maker(args, shampoo::EigendecomposedKLShampooConfig{}, true));
  add("eigenvalue_corrected",
      shampoo_maker(args, shampoo::EigenvalueCorrectedShampooConfig{}, false));
  add("spectral_descent", spectral_maker(args));
  add("sign_descent", shampoo_maker(args, shampoo::SignDescentConfig{}, false));
  add("sgd", shampoo_maker(args, shampoo::SGDPreconditionerConfig{}, false));
  add("adagrad", shampoo_maker(args, shampoo::AdaGradPreconditionerConfig{}, false));
  add("rmsprop", shampoo_maker(args, shampoo::RMSpropPreconditionerConfig{}, false));
  add("adam_main", shampoo_maker(args, shampoo::AdamPreconditionerConfig{}, false));
  return s;
}

/// The subjects named by --families (Adam always; unknown names are an error naming them).
std::vector<Subject> chosen_subjects(const Args& args) {
  auto all = all_subjects(args);
  if (args.families.empty()) return all;
  std::vector<std::string> names;
  std::stringstream list(args.families);
  for (std::string name; std::getline(list, name, ',');) names.push_back(name);
  std::vector<Subject> chosen;
  for (auto& s : all) {
    const bool named = std::find(names.begin(), names.end(), s.name) != names.end();
    if (named) names.erase(std::find(names.begin(), names.end(), s.name));
    if (named || s.name == "adam") chosen.push_back(std::move(s));
  }
  if (!names.empty()) {
    std::string known;
    for (const auto& s : all_subjects(args)) known += " " + s.name;
    fmt::print(stderr, "bench_families: --families: unknown '{}'; known:{}\n", names.front(),
               known);
    std::exit(2);
  }
  return chosen;
}

Args parse_args(int argc, char** argv) {
  Args args;
  Flags flags("bench_families",
              "Step time of every DistributedShampoo preconditioner family against root-inverse "
              "Shampoo and torch::optim::Adam, in the same run (benchmarks/RESULTS.md).");
  flags.add("repetitions", args.repetitions, "repetitions (medians are over them)", 1)
      .add("frequency", args.frequency,
           "precondition_frequency = start step = timed window of steps", 1)
      .add("threads", args.threads, "intra-op threads (0 = LibTorch's default)", 1)
      .add("grad-pool", args.grad_pool, "distinct gradient sets, cycled", 1)
      .add("batch", args.batch, "batch size of the passes that make the gradients", 1)
      .add("families", args.families, "comma-separated subset (default: all; adam always runs)");
  add_output_flags(flags, args.json, args.label);
  parse_flags_or_exit(flags, "bench_families", argc, argv);
  return args;
}

double timed_step(Subject& s, const std::vector<std::vector<at::Tensor>>& pool) {
  set_gradients(s.params, pool[static_cast<size_t>(s.steps_taken) % pool.size()]);
  const auto begin = Clock::now();
  s.optimizer->step();
  const double ms = elapsed_ms(begin, Clock::now());
  ++s.steps_taken;
  return ms;
}

/// One repetition: a window of steps, the subjects in turn (rotated by `r`).
void run_repetition(std::vector<Subject>& subjects,
                    const std::vector<std::vector<at::Tensor>>& pool, const Args& args, int64_t r) {
  const size_t n = subjects.size();
  std::vector<std::vector<double>> ms(n);
  for (int64_t i = 0; i < args.frequency; ++i) {
    for (size_t k = 0; k < n; ++k) {
      const size_t j = (k + static_cast<size_t>(r)) % n;
      ms[j].push_back(timed_step(subjects[j], pool));
    }
  }
  const double adam = mean(ms[0]);
  fmt::print("  repetition {}/{}:", r + 1, args.repetitions);
  for (size_t j = 0; j < n; ++j) {
    subjects[j].window_mean_ms.push_back(mean(ms[j]));
    subjects[j].ratio_vs_adam.push_back(mean(ms[j]) / adam);
    fmt::print(" {} {:.2f}", subjects[j].name, mean(ms[j]));
  }
  fmt::print(" ms\n");
  std::fflush(stdout);
}

int64_t state_bytes(const Subject& s) {
  if (const auto* shampoo = dynamic_cast<const shampoo::DistributedShampoo*>(s.optimizer.get())) {
    return shampoo->stats().state_bytes;
  }
  int64_t bytes = 0;  // torch::optim::Adam
  for (const auto& [key, state] : s.optimizer->state()) {
    const auto& adam = static_cast<const torch::optim::AdamParamState&>(*state);
    for (const auto* t : {&adam.exp_avg(), &adam.exp_avg_sq()}) {
      if (t->defined()) bytes += t->numel() * static_cast<int64_t>(t->element_size());
    }
  }
  return bytes;
}

Json report(const std::vector<Subject>& subjects, const Args& args) {
  fmt::print("\n{:<24}{:>16}{:>16}{:>16}\n{:-<72}\n", "family", "ms/step (mean)", "ratio vs adam",
             "state MiB", "");
  Json rows = Json::array();
  for (const auto& s : subjects) {
    const double ms = median(s.window_mean_ms);
    const double ratio = median(s.ratio_vs_adam);
    const int64_t bytes = state_bytes(s);
    fmt::print("{:<24}{:>16.2f}{:>15.2f}x{:>16.1f}\n", s.name, ms, ratio, bytes / 1048576.0);
    rows.push_back({{"family", s.name},
                    {"median_ms", ms},
                    {"ratio_vs_adam", ratio},
                    {"state_bytes", bytes},
                    {"per_repetition_ms", s.window_mean_ms}});
  }
  fmt::print(
      "(ms/step: mean over a window of {} steps holding one amortized computation, median over "
      "{} repetitions; ratio: median of the same-repetition ratios)\n",
      args.frequency, args.repetitions);
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse_args(argc, argv);
  if (args.threads > 0) at::set_num_threads(static_cast<int>(args.threads));
  torch::manual_seed(0);
  auto model = make_mlp(kLayerSizes);
  const auto init = model->parameters();
  const auto pool = make_gradient_pool(model, args.grad_pool, args.batch, kInFeatures, kClasses);
  auto subjects = chosen_subjects(args);
  fmt::print("bench_families: {} ({} parameters), LibTorch {}, {} threads, CPU {}\n",
             mlp_name(kLayerSizes), numel_of(init), TORCH_VERSION, at::get_num_threads(),
             cpu_model());
  const double load_before = load_average();
  const auto warm_begin = Clock::now();
  for (auto& s : subjects) {
    s.params = clone_params(init);
    s.optimizer = s.make(s.params);
    // To the first amortized computation (step N): every later window holds exactly one.
    for (int64_t i = 0; i < args.frequency; ++i) timed_step(s, pool);
  }
  fmt::print("  warm-up {:.1f} s\n", elapsed_ms(warm_begin, Clock::now()) / 1000.0);
  const auto run_begin = Clock::now();
  for (int64_t r = 0; r < args.repetitions; ++r) run_repetition(subjects, pool, args, r);
  const double run_s = elapsed_ms(run_begin, Clock::now()) / 1000.0;
  const double load_after = load_average();
  const Json rows = report(subjects, args);
  print_timed_section(run_s, load_before, load_after);
  if (args.json.empty()) return 0;
  Json json{{"benchmark", "families"},
            {"label", args.label},
            {"model", mlp_name(kLayerSizes)},
            {"parameters", numel_of(init)},
            {"settings",
             {{"repetitions", args.repetitions},
              {"frequency", args.frequency},
              {"grad_pool", args.grad_pool},
              {"batch", args.batch}}},
            {"machine", machine_json(load_before, load_after)},
            {"timed_section_s", run_s},
            {"families", rows}};
  return write_json(args.json, json, "bench_families") ? 0 : 1;
}
