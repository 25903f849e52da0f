#pragma once
/// Ranks as threads of one process, for tests and benchmarks (not part of the library): every
/// rank runs on its own thread with its own process group over one shared in-memory store.

#include <chrono>
#include <functional>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace shampoo::testing {

using RankFunction = std::function<void(int rank, const c10::intrusive_ptr<c10d::ProcessGroup>&)>;

/// Runs fn(rank, group) for every rank on its own thread, each with a process group (Gloo, plus
/// NCCL when `with_nccl`) over one shared in-memory store; waits for all and rethrows the first
/// failure naming its rank. `timeout` bounds every collective. With `threads_per_rank` > 0 each
/// thread sets at::set_num_threads to it first (OpenMP's thread count is per thread). c10d's
/// flight recorder is switched off unless TORCH_FR_BUFFER_SIZE is set: it is not safe when
/// several ranks of one process enqueue collectives at once.
void run_ranks_as_threads(int world, const RankFunction& fn, std::chrono::milliseconds timeout,
                          bool with_nccl = false, int threads_per_rank = 0);

}  // namespace shampoo::testing
