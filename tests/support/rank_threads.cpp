#include "support/rank_threads.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <vector>

#include "parallel/communication/process_group.h"

namespace shampoo::testing {
namespace {

// c10d's process-wide flight recorder is not safe when several ranks of one process enqueue
// collectives at once (a std::map insert races; seen as a crash in
// FlightRecorder::recordWithResetEnabled). Real ranks are processes; for ranks as threads it is
// switched off when the program starts: the recorder reads the setting once, when the process's
// first process group records a collective, which may be a test's own group made before any
// ranks run as threads (process_group_test's Environment tests: the crash came in the hybrid
// tests after them, 1 run in 15 under load).
const bool kFlightRecorderOff = [] {
  setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0);
  return true;
}();

}  // namespace

void run_ranks_as_threads(int world, const RankFunction& fn, std::chrono::milliseconds timeout,
                          bool with_nccl, int threads_per_rank) {
  (void)kFlightRecorderOff;
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::mutex mutex;
  std::exception_ptr first_error;
  int failed_rank = -1;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        if (threads_per_rank > 0) at::set_num_threads(threads_per_rank);
        auto group = detail::make_process_group(store, rank, world, timeout, with_nccl);
        fn(rank, group);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!first_error) {
          first_error = std::current_exception();
          failed_rank = rank;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  if (!first_error) return;
  const std::string prefix = "rank " + std::to_string(failed_rank) + ": ";
  try {
    std::rethrow_exception(first_error);
  } catch (const c10::Error& e) {
    throw std::runtime_error(prefix + e.what_without_backtrace());
  } catch (const std::exception& e) {
    throw std::runtime_error(prefix + e.what());
  }
}

}  // namespace shampoo::testing
