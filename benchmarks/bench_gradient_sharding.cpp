/// Gradient sharding (ZeRO-2) against optimizer-state sharding alone (ZeRO-1): the gradient
/// memory each rank holds, and what the gradient collectives cost over Gloo.
///
/// Workload: the transformer-like parameters of issue 13 (transformer_workload_shapes, 29.4M
/// parameters in 21 tensors, float32; --small divides every dim by 8). The loss is
/// Σ_i sum(W_i ⊙ X_i) with a fixed X_i per rank, so backward produces one gradient per parameter
/// through autograd (the synchronizer's hooks fire as in training) at little compute. Optimizer:
/// shampoo::ShardedOptimizer over torch::optim::Adam (lr 1e-3), whole parameters owned by ranks.
///   zero1: GradientSynchronizer all-reduces every gradient (every rank holds all of them);
///   zero2: the same plus sync.shard_gradients(optimizer): each bucket reduced to its owner, the
///          other ranks release its gradients.
/// Per mode, alone in the process: one warm-up step, then --steps measured steps (zero_grad(),
/// forward + backward + synchronize(), step()). Per rank: the gradient bytes held after the step
/// (GradientSynchronizer::gradient_bytes + buffer_bytes: the .grad tensors and the synchronizer's
/// buffers), the tracking allocator's live bytes after the step and its peak during it (both
/// above what the process held before the mode was built: parameters, X, state, gradients,
/// buffers), and the median ms of backward + synchronize and of the step. The bound of issue 24:
/// parameter bytes / world + one bucket.
///
/// Collectives alone (--repetitions, medians, interleaved): the gradient bytes in buckets of
/// --bucket-mb: all-reduce of every bucket (zero1), reduce of every bucket to a root
/// (round-robin: zero2), and _reduce_scatter_base of every bucket (padded to a multiple of the
/// world; Gloo runs it as an all-reduce).
///
/// Ranks: as threads of this process (--world 2,4; the allocator is then shared, so its figures
/// are the process's), or as one rank of a torchrun launch (--torchrun: every rank's own
/// allocator; rank 0 prints every rank's figures).
///
///   bench_gradient_sharding [--world 2,4] [--torchrun] [--steps 5] [--repetitions 5]
///                           [--bucket-mb 25] [--small] [--threads 1] [--json PATH] [--label TEXT]
/// Results and how to read them: benchmarks/RESULTS.md ("Gradient sharding").

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <shampoo/shampoo.h>
#include <torch/optim/adam.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "benchmarks/bench_support.h"
#include "benchmarks/tracking_allocator.h"

namespace {

using namespace shampoo::bench;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

struct Args {
  std::vector<double> worlds{2, 4};  // world sizes (the flag parser reads numbers)
  bool torchrun = false;
  int64_t steps = 5;
  int64_t repetitions = 5;
  int64_t bucket_mb = 25;
  bool small = false;
  int64_t threads = 1;
  std::string json;
  std::string label;
};

/// One rank's figures of one mode.
struct ModeFigures {
  int64_t param_bytes = 0;
  int64_t owned_param_bytes = 0;  // of the parameters this rank steps
  int64_t gradient_bytes = 0;     // .grad + synchronizer buffers after the step
  int64_t live_after = 0;         // allocator, above the mode's baseline
  int64_t peak = 0;
  double backward_ms = 0;  // forward + backward + synchronize
  double step_ms = 0;
};

/// One rank's medians of the collectives alone.
struct CollectiveFigures {
  double all_reduce_ms = 0;
  double reduce_ms = 0;
  double reduce_scatter_ms = 0;
};

std::vector<at::Tensor> make_params(const std::vector<std::vector<int64_t>>& shapes) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  std::vector<at::Tensor> params;
  for (const auto& s : shapes) params.push_back((at::randn(s, gen) * 0.02).requires_grad_());
  return params;
}

ModeFigures run_mode(bool zero2, const std::vector<std::vector<int64_t>>& shapes, int rank,
                     const Group& group, const Args& args, TrackingAllocator* tracker) {
  ModeFigures f;
  const int64_t baseline = tracker != nullptr ? tracker->live() : 0;
  auto params = make_params(shapes);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + rank);
  std::vector<at::Tensor> inputs;
  for (const auto& s : shapes) inputs.push_back(at::randn(s, gen));
  shampoo::GradientSynchronizer sync(
      params, group, shampoo::GradientSynchronizerOptions().bucket_cap_bytes(args.bucket_mb << 20));
  shampoo::ShardedOptimizer optimizer(
      params, shampoo::group_optimizer_factory<torch::optim::Adam>(torch::optim::AdamOptions(1e-3)),
      group);
  if (zero2) sync.shard_gradients(optimizer);
  f.param_bytes = nbytes_of(params);
  for (size_t i = 0; i < params.size(); ++i) {
    if (optimizer.owners()[i] == rank) f.owned_param_bytes += params[i].nbytes();
  }
  std::vector<double> backward_ms, step_ms;
  for (int64_t s = 0; s <= args.steps; ++s) {
    optimizer.zero_grad();
    barrier(group);
    if (tracker != nullptr) tracker->reset_peak();
    const auto t0 = Clock::now();
    at::Tensor loss = at::zeros({});
    for (size_t i = 0; i < params.size(); ++i) loss = loss + (params[i] * inputs[i]).sum();
    loss.backward();
    sync.synchronize();
    const auto t1 = Clock::now();
    optimizer.step();
    const auto t2 = Clock::now();
    if (s == 0) continue;  // warm-up: creates Adam's state
    backward_ms.push_back(elapsed_ms(t0, t1));
    step_ms.push_back(elapsed_ms(t1, t2));
    f.gradient_bytes = sync.gradient_bytes() + sync.buffer_bytes();
    if (tracker != nullptr) {
      f.live_after = tracker->live() - baseline;
      f.peak = std::max(f.peak, tracker->peak() - baseline);
    }
  }
  f.backward_ms = median(backward_ms);
  f.step_ms = median(step_ms);
  return f;
}

CollectiveFigures run_collectives(int64_t total_bytes, const Group& group, const Args& args) {
  const int world = group->getSize();
  const int64_t bucket = (args.bucket_mb << 20) / 4;
  int64_t remaining = total_bytes / 4;
  std::vector<at::Tensor> buffers;
  while (remaining > 0) {
    // Padded to a multiple of the world for the reduce-scatter.
    int64_t n = std::min(bucket, remaining);
    remaining -= n;
    n = (n + world - 1) / world * world;
    buffers.push_back(at::randn({n}));
  }
  auto* backend = group->getBackend(c10::DeviceType::CPU).get();
  std::vector<double> all_reduce, reduce, reduce_scatter;
  for (int64_t r = 0; r < args.repetitions; ++r) {
    barrier(group);
    auto t0 = Clock::now();
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (auto& b : buffers) {
      std::vector<at::Tensor> one{b};
      works.push_back(backend->allreduce(one));
    }
    for (auto& w : works) w->wait();
    all_reduce.push_back(elapsed_ms(t0, Clock::now()));
    works.clear();
    barrier(group);
    t0 = Clock::now();
    for (size_t k = 0; k < buffers.size(); ++k) {
      std::vector<at::Tensor> one{buffers[k]};
      c10d::ReduceOptions options;
      options.rootRank = static_cast<int64_t>(k % static_cast<size_t>(world));
      works.push_back(backend->reduce(one, options));
    }
    for (auto& w : works) w->wait();
    reduce.push_back(elapsed_ms(t0, Clock::now()));
    works.clear();
    barrier(group);
    t0 = Clock::now();
    std::vector<at::Tensor> outputs;
    for (auto& b : buffers) {
      outputs.push_back(at::empty({b.numel() / world}));
      works.push_back(backend->_reduce_scatter_base(outputs.back(), b));
    }
    for (auto& w : works) w->wait();
    reduce_scatter.push_back(elapsed_ms(t0, Clock::now()));
  }
  return {median(all_reduce), median(reduce), median(reduce_scatter)};
}

struct WorldResult {
  int world = 0;
  std::vector<ModeFigures> zero1, zero2;  // per rank
  std::vector<CollectiveFigures> collectives;
};

/// Every rank's figures, gathered on every rank.
template <typename T, typename ToInts, typename FromInts>
std::vector<T> gather(const Group& group, const T& mine, ToInts to_ints, FromInts from_ints) {
  const auto all = gather_from_ranks(group, to_ints(mine));
  std::vector<T> out;
  for (const auto& row : all) out.push_back(from_ints(row));
  return out;
}

std::vector<int64_t> mode_ints(const ModeFigures& f) {
  return {f.param_bytes,
          f.owned_param_bytes,
          f.gradient_bytes,
          f.live_after,
          f.peak,
          static_cast<int64_t>(f.backward_ms * 1000),
          static_cast<int64_t>(f.step_ms * 1000)};
}
ModeFigures mode_from(const std::vector<int64_t>& v) {
  return {v[0],
          v[1],
          v[2],
          v[3],
          v[4],
          static_cast<double>(v[5]) / 1000,
          static_cast<double>(v[6]) / 1000};
}
std::vector<int64_t> collective_ints(const CollectiveFigures& f) {
  return {static_cast<int64_t>(f.all_reduce_ms * 1000), static_cast<int64_t>(f.reduce_ms * 1000),
          static_cast<int64_t>(f.reduce_scatter_ms * 1000)};
}
CollectiveFigures collective_from(const std::vector<int64_t>& v) {
  return {static_cast<double>(v[0]) / 1000, static_cast<double>(v[1]) / 1000,
          static_cast<double>(v[2]) / 1000};
}

void run_rank(int rank, const Group& group, const Args& args, TrackingAllocator* tracker,
              WorldResult& result, std::mutex& mutex) {
  at::set_num_threads(static_cast<int>(args.threads));
  const auto shapes = transformer_workload_shapes(args.small ? 8 : 1);
  const auto zero1 = run_mode(false, shapes, rank, group, args, tracker);
  const auto zero2 = run_mode(true, shapes, rank, group, args, tracker);
  const auto collectives = run_collectives(zero1.param_bytes, group, args);
  auto all1 = gather(group, zero1, mode_ints, mode_from);
  auto all2 = gather(group, zero2, mode_ints, mode_from);
  auto allc = gather(group, collectives, collective_ints, collective_from);
  if (rank != 0) return;
  std::lock_guard<std::mutex> lock(mutex);
  result.world = group->getSize();
  result.zero1 = std::move(all1);
  result.zero2 = std::move(all2);
  result.collectives = std::move(allc);
}

std::string mb(int64_t bytes) { return fmt::format("{:.1f}", static_cast<double>(bytes) / 1e6); }

void print_world(const WorldResult& r, const Args& args, bool per_rank_allocator) {
  const int64_t params = r.zero1[0].param_bytes;
  const int64_t bucket = args.bucket_mb << 20;
  fmt::print(
      "\nworld {}: parameters {} MB; bound of issue 24 (parameters / world + one bucket) "
      "{} MB\n",
      r.world, mb(params), mb(params / r.world + bucket));
  fmt::print(
      "| rank | owns MB | grads held after step MB: zero1 | zero2 | zero2 within bound | "
      "live after step MB: zero1 | zero2 | peak MB: zero1 | zero2 | fwd+bwd+sync ms: "
      "zero1 | zero2 | step ms: zero1 | zero2 |\n");
  for (int rank = 0; rank < r.world; ++rank) {
    const auto& a = r.zero1[rank];
    const auto& b = r.zero2[rank];
    fmt::print(
        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1f} | {:.1f} | {:.1f} | {:.1f} |\n",
        rank, mb(a.owned_param_bytes), mb(a.gradient_bytes), mb(b.gradient_bytes),
        b.gradient_bytes <= params / r.world + bucket ? "yes" : "NO",
        per_rank_allocator ? mb(a.live_after) : "-", per_rank_allocator ? mb(b.live_after) : "-",
        per_rank_allocator ? mb(a.peak) : "-", per_rank_allocator ? mb(b.peak) : "-", a.backward_ms,
        b.backward_ms, a.step_ms, b.step_ms);
  }
  fmt::print(
      "collectives alone, {} MB in buckets of {} MB (median of {}, slowest rank): "
      "all-reduce {:.1f} ms | reduce to owners {:.1f} ms | reduce-scatter {:.1f} ms\n",
      mb(params), args.bucket_mb, args.repetitions,
      std::max_element(r.collectives.begin(), r.collectives.end(),
                       [](auto& x, auto& y) { return x.all_reduce_ms < y.all_reduce_ms; })
          ->all_reduce_ms,
      std::max_element(r.collectives.begin(), r.collectives.end(),
                       [](auto& x, auto& y) { return x.reduce_ms < y.reduce_ms; })
          ->reduce_ms,
      std::max_element(r.collectives.begin(), r.collectives.end(), [](auto& x, auto& y) {
        return x.reduce_scatter_ms < y.reduce_scatter_ms;
      })->reduce_scatter_ms);
}

Json world_json(const WorldResult& r) {
  Json ranks = Json::array();
  for (int rank = 0; rank < r.world; ++rank) {
    const auto& a = r.zero1[rank];
    const auto& b = r.zero2[rank];
    const auto& c = r.collectives[rank];
    ranks.push_back({{"rank", rank},
                     {"owned_param_bytes", a.owned_param_bytes},
                     {"zero1",
                      {{"gradient_bytes", a.gradient_bytes},
                       {"live_after_step", a.live_after},
                       {"peak", a.peak},
                       {"backward_sync_ms", a.backward_ms},
                       {"step_ms", a.step_ms}}},
                     {"zero2",
                      {{"gradient_bytes", b.gradient_bytes},
                       {"live_after_step", b.live_after},
                       {"peak", b.peak},
                       {"backward_sync_ms", b.backward_ms},
                       {"step_ms", b.step_ms}}},
                     {"collectives_ms",
                      {{"all_reduce", c.all_reduce_ms},
                       {"reduce", c.reduce_ms},
                       {"reduce_scatter", c.reduce_scatter_ms}}}});
  }
  return {{"world", r.world}, {"param_bytes", r.zero1[0].param_bytes}, {"ranks", ranks}};
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  Flags flags("bench_gradient_sharding",
              "Gradient sharding (ZeRO-2) against state sharding (ZeRO-1): gradient memory per "
              "rank and the cost of the gradient collectives over Gloo");
  flags
      .add_list("world", args.worlds, "world sizes to run as threads (not with --torchrun)",
                std::nullopt, "", 2.0)
      .add_bool("torchrun", args.torchrun,
                "this process is one rank of a torchrun launch (WORLD_SIZE ranks)")
      .add("steps", args.steps, "measured steps per mode", 1)
      .add("repetitions", args.repetitions, "repetitions of the collectives alone", 1)
      .add("bucket-mb", args.bucket_mb, "the synchronizer's bucket size in MiB", 1)
      .add_bool("small", args.small, "every dim of the workload divided by 8")
      .add("threads", args.threads, "intra-op threads per rank", 1);
  add_output_flags(flags, args.json, args.label);
  parse_flags_or_exit(flags, "bench_gradient_sharding", argc, argv);

  auto& tracker = TrackingAllocator::install();
  const double load_before = load_average();
  const auto start = Clock::now();
  std::vector<WorldResult> results;
  std::mutex mutex;
  bool lead = true;
  if (args.torchrun) {
    auto group = shampoo::init_process_group_from_env();
    WorldResult result;
    run_rank(group->getRank(), group, args, &tracker, result, mutex);
    lead = group->getRank() == 0;
    if (lead) results.push_back(result);
  } else {
    for (const auto world : args.worlds) {
      WorldResult result;
      run_ranks_as_threads(static_cast<int>(world), static_cast<int>(args.threads),
                           [&](int rank, const Group& group) {
                             // One allocator for every thread: its figures are not per rank.
                             run_rank(rank, group, args, nullptr, result, mutex);
                           });
      results.push_back(result);
    }
  }
  if (!lead) return 0;
  const double load_after = load_average();
  fmt::print(
      "bench_gradient_sharding: transformer-like workload{}, ShardedOptimizer(Adam), ranks "
      "as {}, {} step(s) per mode, buckets of {} MiB\n",
      args.small ? " (small)" : "", args.torchrun ? "torchrun processes" : "threads", args.steps,
      args.bucket_mb);
  for (const auto& r : results) print_world(r, args, args.torchrun);
  print_timed_section(std::chrono::duration<double>(Clock::now() - start).count(), load_before,
                      load_after);
  if (args.json.empty()) return 0;
  Json worlds = Json::array();
  for (const auto& r : results) worlds.push_back(world_json(r));
  const Json json{{"benchmark", "bench_gradient_sharding"},
                  {"label", args.label},
                  {"machine", machine_json(load_before, load_after)},
                  {"ranks_as", args.torchrun ? "torchrun processes" : "threads"},
                  {"steps", args.steps},
                  {"bucket_mb", args.bucket_mb},
                  {"small", args.small},
                  {"worlds", worlds}};
  return write_json(args.json, json, "bench_gradient_sharding") ? 0 : 1;
}
