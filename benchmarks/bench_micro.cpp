/// Micro-benchmarks (Google Benchmark) of the kernels under a Shampoo step, on the CPU, float32:
///   InverseRootEigh/n/d     stacked_inverse_root (eigh, exponent 1/4, ε 1e-12) of n SPD d×d
///   ElementwiseChain/n/d    run_chain_pre + _norms + _post over n blocks d×d (Adam grafting,
///                           momentum, decoupled weight decay): the per-step elementwise work
///   ChainNorms/tiled/n/d    the norm pass alone over n blocks d×d (diagonal statistics V > 0):
///                           tiled 0 = the per-element loop, 1 = the tiled CPU loop (same bits)
///   OuterProduct/n/d/dim    stacked_outer_product of n d×d gradient blocks along a dim (the
///                           Kronecker factor update)
///   MultiplyAlongDim/n/d/dim stacked_multiply_along_dim: n d×d blocks times n d×d matrices (the
///                           preconditioner product)
///   UnpackSymmetric/n/d/into unpack_symmetric of n packed d×d matrices (the packed roots, before
///                           each preconditioner product): into a fresh tensor (0) or into a
///                           reused one (1, unpack_symmetric_into)
///   ColumnBlockStep/views/fused  DistributedShampoo::step of two 512×2048 matrices in column
///                           blocks of 512 (Adam as the main preconditioner, β1, momentum, weight
///                           decay): views 1 = the chain takes the blocks where they lie, 0 = their
///                           gradients copied in and updates staged (set_chain_views(false), the
///                           CUDA route); fused 1 = the fused pass, 0 = Adam grafting (three
///                           passes)
///   OptionsPush/shampoo/changed  the per-step options push of one param group into the optimizer
///                           a wrapper drives (ShardedOptimizer's, full sharding's;
///                           parallel/optimizers/options_push.h) over one 64×64 parameter:
///                           shampoo 0 = torch::optim::Adam, 1 = DistributedShampoo; changed 1 =
///                           the lr changed since the last push (a per-step schedule), 0 = not
///   FloatOptionPrints/groups  the fingerprints of the param groups' float options that a
///                           distributed step's agreement carries (shampoo/rank_agreement.h), for
///                           1, 8 and 64 groups: the host time it adds to every agreeing step
/// Each runs --repetitions (5) repetitions and reports mean, median, stddev and cv (Google
/// Benchmark's aggregates); --json PATH writes Google Benchmark's JSON (it becomes
/// --benchmark_out=PATH
/// --benchmark_out_format=json), and every --benchmark_* flag goes to Google Benchmark.
///
///   bench_micro [--repetitions 5] [--threads 1] [--json PATH] [--label TEXT]
///   [--benchmark_filter=REGEX] ...
/// Results: benchmarks/RESULTS.md, "Micro-benchmarks".

// The library internals measured; kept together (elementwise_chain.h is moving to update/).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <shampoo/shampoo.h>
#include <torch/optim/adam.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "benchmarks/bench_support.h"
#include "parallel/optimizers/local_optimizer.h"
#include "parallel/optimizers/options_push.h"
#include "preconditioners/kronecker_contractions.h"
#include "preconditioners/matrix_functions.h"
#include "preconditioners/symmetric_matrices.h"
#include "shampoo/rank_agreement.h"
#include "update/elementwise_chain.h"
#include "update/elementwise_chain_cpu.h"

namespace {

using shampoo::bench::Flags;

/// n symmetric positive definite d×d matrices, well conditioned: G·Gᵀ / (2d) of Gaussian G [d, 2d].
at::Tensor spd_stack(int64_t n, int64_t d) {
  const auto g = at::randn({n, d, 2 * d});
  return at::bmm(g, g.transpose(1, 2)) / (2.0 * static_cast<double>(d));
}

void InverseRootEigh(benchmark::State& state) {
  const int64_t n = state.range(0), d = state.range(1);
  const auto a = spd_stack(n, d);
  const std::vector<double> epsilons(n, 1e-12), exponents(n, 0.25);
  for (auto _ : state) {
    auto result = shampoo::detail::stacked_inverse_root(a, epsilons, exponents, true);
    benchmark::DoNotOptimize(result.values.data_ptr());
  }
  state.counters["matrices/s"] =
      benchmark::Counter(static_cast<double>(n * state.iterations()), benchmark::Counter::kIsRate);
}

void ElementwiseChain(benchmark::State& state) {
  const int64_t n = state.range(0), d = state.range(1);
  auto chain = shampoo::bench::make_chain(n, {d, d}, at::TensorOptions());
  for (auto _ : state) {
    shampoo::detail::run_chain_pre(chain.blocks);
    shampoo::detail::run_chain_norms(chain.blocks);
    shampoo::detail::run_chain_post(chain.blocks);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * n * d * d * static_cast<int64_t>(sizeof(float)));
}

void OuterProduct(benchmark::State& state) {
  const int64_t n = state.range(0), d = state.range(1), dim = state.range(2);
  const auto blocks = at::randn({n, d, d});
  for (auto _ : state) {
    auto factor = shampoo::detail::stacked_outer_product(blocks, dim);
    benchmark::DoNotOptimize(factor.data_ptr());
  }
}

void MultiplyAlongDim(benchmark::State& state) {
  const int64_t n = state.range(0), d = state.range(1), dim = state.range(2);
  const auto blocks = at::randn({n, d, d});
  const auto matrices = spd_stack(n, d);
  for (auto _ : state) {
    auto product = shampoo::detail::stacked_multiply_along_dim(blocks, matrices, dim);
    benchmark::DoNotOptimize(product.data_ptr());
  }
}

void UnpackSymmetric(benchmark::State& state) {
  const int64_t n = state.range(0), d = state.range(1);
  const bool into = state.range(2) != 0;
  const auto packed = at::randn({n, shampoo::detail::packed_size(d)});
  auto scratch = at::empty({n, d, d});
  for (auto _ : state) {
    if (into) {
      shampoo::detail::unpack_symmetric_into(scratch, packed);
      benchmark::DoNotOptimize(scratch.data_ptr());
      continue;
    }
    auto dense = shampoo::detail::unpack_symmetric(packed, d);
    benchmark::DoNotOptimize(dense.data_ptr());
  }
  state.SetBytesProcessed(state.iterations() * n * d * d * static_cast<int64_t>(sizeof(float)));
}

void ChainNorms(benchmark::State& state) {
  const bool tiled = state.range(0) != 0;
  const int64_t n = state.range(1), d = state.range(2);
  auto chain = shampoo::bench::make_chain(n, {d, d}, at::TensorOptions());
  std::vector<shampoo::kernels::ChainBlock<float>> blocks;
  for (auto& c : chain.blocks) {
    c.diagonal_state.uniform_(0.5, 1.5);
    shampoo::kernels::ChainBlock<float> b;
    b.numel = c.grad.numel();
    b.filtered_out = c.filtered_out.data_ptr<float>();
    b.diagonal_state = c.diagonal_state.data_ptr<float>();
    b.preconditioned = c.preconditioned.data_ptr<float>();
    b.s = c.scalars;
    blocks.push_back(b);
  }
  const auto norms = shampoo::kernels::chain_tiles<float>().norms;
  for (auto _ : state) {
    double sums[2] = {0.0, 0.0};
    for (const auto& b : blocks) {
      if (tiled) {
        norms(b, 0, b.numel, sums[0], sums[1]);
      } else {
        shampoo::kernels::chain_norm_range(b, 0, b.numel, sums[0], sums[1]);
      }
    }
    benchmark::DoNotOptimize(sums);
  }
  state.SetBytesProcessed(state.iterations() * 3 * n * d * d * static_cast<int64_t>(sizeof(float)));
}

void ColumnBlockStep(benchmark::State& state) {
  const bool views = state.range(0) != 0, fused = state.range(1) != 0;
  std::vector<at::Tensor> params;
  for (int i = 0; i < 2; ++i) {
    params.push_back(at::randn({512, 2048}).requires_grad_());
    params.back().mutable_grad() = at::randn({512, 2048});
  }
  auto options = shampoo::ShampooOptions::reference_defaults(1e-3)
                     .betas({0.9, 0.999})
                     .epsilon(1e-8)
                     .momentum(0.5)
                     .weight_decay(1e-2)
                     .max_preconditioner_dim(512)
                     .preconditioner(shampoo::AdamPreconditionerConfig{0.999, 1e-8, false});
  if (!fused) options.grafting(shampoo::AdamGraftingConfig{0.999, 1e-8, false});
  shampoo::DistributedShampoo optimizer(params, options);
  shampoo::detail::set_chain_views(views);
  for (auto _ : state) optimizer.step();
  shampoo::detail::set_chain_views(true);
  state.SetBytesProcessed(state.iterations() * 2 * 512 * 2048 *
                          static_cast<int64_t>(sizeof(float)));
}

BENCHMARK(InverseRootEigh)
    ->ArgNames({"n", "d"})
    ->Args({8, 128})
    ->Args({2, 512})
    ->Unit(benchmark::kMillisecond)
    ->ReportAggregatesOnly(true);
BENCHMARK(ElementwiseChain)
    ->ArgNames({"n", "d"})
    ->Args({64, 64})
    ->Unit(benchmark::kMicrosecond)
    ->ReportAggregatesOnly(true);
BENCHMARK(ChainNorms)
    ->ArgNames({"tiled", "n", "d"})
    ->Args({0, 16, 512})
    ->Args({1, 16, 512})
    ->Unit(benchmark::kMillisecond)
    ->ReportAggregatesOnly(true);
/// The block stacks of the contractions: 8 blocks 128×128 along either dim, 2 blocks 512×512.
void contraction_shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n", "d", "dim"})
      ->Args({8, 128, 0})
      ->Args({8, 128, 1})
      ->Args({2, 512, 0})
      ->Unit(benchmark::kMicrosecond)
      ->ReportAggregatesOnly(true);
}
BENCHMARK(ColumnBlockStep)
    ->ArgNames({"views", "fused"})
    ->Args({0, 1})
    ->Args({1, 1})
    ->Args({0, 0})
    ->Args({1, 0})
    ->Unit(benchmark::kMillisecond)
    ->ReportAggregatesOnly(true);
BENCHMARK(OuterProduct)->Apply(contraction_shapes);
BENCHMARK(MultiplyAlongDim)->Apply(contraction_shapes);
BENCHMARK(UnpackSymmetric)
    ->ArgNames({"n", "d", "into"})
    ->ArgsProduct({{4}, {128, 512, 1024}, {0, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->ReportAggregatesOnly(true);

void OptionsPush(benchmark::State& state) {
  const bool shampoo_optimizer = state.range(0) == 1, changed = state.range(1) == 1;
  const auto factory =
      shampoo_optimizer
          ? shampoo::group_optimizer_factory<shampoo::DistributedShampoo>(
                shampoo::ShampooOptions(0.01))
          : shampoo::group_optimizer_factory<torch::optim::Adam>(torch::optim::AdamOptions(0.01));
  shampoo::detail::LocalOptimizer driven(factory, "bench: ");
  const auto param = at::zeros({64, 64}).requires_grad_(true);
  driven.make(torch::optim::OptimizerParamGroup({param}));
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{param},
                      driven.get()->param_groups()[0].options().clone());
  shampoo::detail::OptionsPush push("bench: ", "param_groups()", "local_optimizer()");
  push.add_group(groups[0].options());
  int64_t step = 0;
  for (auto _ : state) {
    if (changed) groups[0].options().set_lr(0.01 * (1.0 + 1e-3 * static_cast<double>(++step % 7)));
    push.push(groups, {&driven});
  }
}

BENCHMARK(OptionsPush)
    ->ArgNames({"shampoo", "changed"})
    ->ArgsProduct({{0, 1}, {0, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->ReportAggregatesOnly(true);

void FloatOptionPrints(benchmark::State& state) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (int64_t g = 0; g < state.range(0); ++g) {
    groups.emplace_back(
        std::vector<at::Tensor>{at::zeros({4})},
        std::make_unique<shampoo::ShampooOptions>(0.01 * static_cast<double>(g + 1)));
  }
  for (auto _ : state) benchmark::DoNotOptimize(shampoo::detail::float_option_prints(groups));
}

BENCHMARK(FloatOptionPrints)
    ->ArgNames({"groups"})
    ->Args({1})
    ->Args({8})
    ->Args({64})
    ->Unit(benchmark::kMicrosecond)
    ->ReportAggregatesOnly(true);

}  // namespace

int main(int argc, char** argv) {
  // --benchmark_* flags go to Google Benchmark, the rest (shared with every benchmark, for
  // run_all.sh) to our parser.
  std::vector<char*> ours{argv[0]}, theirs{argv[0]};
  for (int i = 1; i < argc; ++i) {
    (std::string_view(argv[i]).rfind("--benchmark_", 0) == 0 ? theirs : ours).push_back(argv[i]);
  }
  int64_t repetitions = 5, threads = 1;
  std::string json, label;
  Flags flags("bench_micro",
              "Google Benchmark micro-benchmarks of inverse roots, the elementwise chain and the "
              "Kronecker contractions; every --benchmark_* flag (--benchmark_filter=REGEX, "
              "--benchmark_repetitions=N, ...) goes to Google Benchmark.");
  flags.add("repetitions", repetitions, "repetitions of every benchmark (medians are over them)", 1)
      .add("threads", threads, "intra-op threads", 1);
  shampoo::bench::add_output_flags(flags, json, label);
  shampoo::bench::parse_flags_or_exit(flags, "bench_micro", static_cast<int>(ours.size()),
                                      ours.data());
  std::string repeat = fmt::format("--benchmark_repetitions={}", repetitions);
  std::string out = "--benchmark_out=" + json, out_format = "--benchmark_out_format=json";
  theirs.insert(theirs.begin() + 1, repeat.data());  // a --benchmark_repetitions given wins
  if (!json.empty()) {
    theirs.push_back(out.data());
    theirs.push_back(out_format.data());
  }
  int their_count = static_cast<int>(theirs.size());
  benchmark::Initialize(&their_count, theirs.data());
  if (benchmark::ReportUnrecognizedArguments(their_count, theirs.data())) return 2;

  at::set_num_threads(static_cast<int>(threads));
  at::manual_seed(0);
  benchmark::AddCustomContext("libtorch_threads", std::to_string(at::get_num_threads()));
  benchmark::AddCustomContext("label", label);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  if (!json.empty()) fmt::print("\nwrote {}\n", json);
  return 0;
}
