#include "preconditioners/cuda/eigh_lanes.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <thread>
#include <unordered_map>
#include <vector>

namespace shampoo::detail {
namespace {

/// A lane: a non-blocking stream of its own (it does not wait on the legacy default stream), a
/// cuSOLVER handle bound to it, and the event recorded after its share of a call.
class Lane {
 public:
  explicit Lane(int device) {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    try {
      C10_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      C10_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
      TORCH_CHECK(cusolverDnCreate(&handle_) == CUSOLVER_STATUS_SUCCESS,
                  "cuSOLVER cusolverDnCreate failed for an eigh lane on device ", device);
      TORCH_CHECK(cusolverDnSetStream(handle_, stream_) == CUSOLVER_STATUS_SUCCESS,
                  "cuSOLVER cusolverDnSetStream failed for an eigh lane on device ", device);
    } catch (...) {
      release();
      throw;
    }
  }
  ~Lane() { release(); }
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;

  cudaStream_t stream() const { return stream_; }
  cusolverDnHandle_t handle() const { return handle_; }
  cudaEvent_t done() const { return done_; }

 private:
  // Errors ignored: this may run at thread exit, after the CUDA runtime began to shut down.
  void release() {
    if (handle_ != nullptr) cusolverDnDestroy(handle_);
    if (done_ != nullptr) cudaEventDestroy(done_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    handle_ = nullptr;
    done_ = nullptr;
    stream_ = nullptr;
  }

  cudaStream_t stream_ = nullptr;
  cusolverDnHandle_t handle_ = nullptr;
  cudaEvent_t done_ = nullptr;
};

/// The lanes of one device for the calling thread, and the event that marks where the caller's
/// stream stood when a call began.
struct DeviceLanes {
  DeviceLanes() = default;
  DeviceLanes(const DeviceLanes&) = delete;
  DeviceLanes& operator=(const DeviceLanes&) = delete;
  ~DeviceLanes() {
    if (ready != nullptr) cudaEventDestroy(ready);
  }
  cudaEvent_t ready = nullptr;
  std::vector<std::unique_ptr<Lane>> lanes;
};

/// This thread's lanes of `device`, at least `count` of them. Cached per thread (as the cuSOLVER
/// handle of the current stream is) so that two host threads never share a handle.
DeviceLanes& lanes_of(int device, int count) {
  thread_local std::unordered_map<int, std::unique_ptr<DeviceLanes>> by_device;
  auto& slot = by_device[device];
  if (slot == nullptr) slot = std::make_unique<DeviceLanes>();
  if (slot->ready == nullptr) {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&slot->ready, cudaEventDisableTiming));
  }
  while (static_cast<int>(slot->lanes.size()) < count) {
    slot->lanes.push_back(std::make_unique<Lane>(device));
  }
  return *slot;
}

/// Matrices handed out one at a time to whichever lane is free (lanes finish at different times).
struct Queue {
  explicit Queue(int64_t n, int lanes) : n(n), status(lanes, CUSOLVER_STATUS_SUCCESS) {}
  const int64_t n;
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::vector<cusolverStatus_t> status;  // one per lane; each lane writes its own
};

void drain(Queue& queue, int lane, cusolverDnHandle_t handle, int device, const LaneWork& work) {
  try {
    // A new thread starts on device 0; the caller's device is the lanes' device.
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    for (int64_t i = queue.next++; i < queue.n && !queue.failed; i = queue.next++) {
      queue.status[lane] = work(lane, handle, i);
      if (queue.status[lane] != CUSOLVER_STATUS_SUCCESS) queue.failed = true;
    }
  } catch (...) {
    queue.status[lane] = CUSOLVER_STATUS_INTERNAL_ERROR;
    queue.failed = true;
  }
}

/// Why host threads, and why per call. cuSOLVER's divide and conquer (syevd) runs part of its
/// work on the host and returns only when the matrix is decomposed, so one host thread issuing
/// matrices round robin over streams gets little overlap (LaneFeeding::kCallingThread shows how
/// little in bench_cuda); the probe got its speed-up from host threads with streams of
/// their own. Threads are started per call (lanes - 1 of them; the calling thread drives lane 0)
/// rather than kept in a pool: starting them costs tens of microseconds against ~10 ms per large
/// matrix, and no thread outlives the call, so nothing has to be shut down at process exit while
/// the CUDA runtime goes away.
cusolverStatus_t feed_by_threads(DeviceLanes& lanes, int count, int64_t n, int device,
                                 const LaneWork& work) {
  Queue queue(n, count);
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(count - 1));
  try {
    for (int lane = 1; lane < count; ++lane) {
      threads.emplace_back(drain, std::ref(queue), lane, lanes.lanes[lane]->handle(), device,
                           std::cref(work));
    }
  } catch (...) {
    queue.failed = true;
    for (auto& thread : threads) thread.join();
    throw;
  }
  drain(queue, 0, lanes.lanes[0]->handle(), device, work);
  for (auto& thread : threads) thread.join();
  for (const auto status : queue.status) {
    if (status != CUSOLVER_STATUS_SUCCESS) return status;
  }
  return CUSOLVER_STATUS_SUCCESS;
}

cusolverStatus_t feed_from_caller(DeviceLanes& lanes, int count, int64_t n, const LaneWork& work) {
  for (int64_t i = 0; i < n; ++i) {
    const int lane = static_cast<int>(i % count);
    const auto status = work(lane, lanes.lanes[lane]->handle(), i);
    if (status != CUSOLVER_STATUS_SUCCESS) return status;
  }
  return CUSOLVER_STATUS_SUCCESS;
}

}  // namespace

cusolverStatus_t run_on_lanes(const c10::cuda::CUDAStream& caller, int64_t n, int lanes,
                              LaneFeeding feeding, const LaneWork& work) {
  TORCH_CHECK(lanes >= 1 && lanes <= kMaxEighLanes, "run_on_lanes: lanes: got ", lanes,
              ", expected 1 to ", kMaxEighLanes);
  if (n == 0) return CUSOLVER_STATUS_SUCCESS;
  const int count = static_cast<int>(std::min<int64_t>(lanes, n));
  const int device = caller.device_index();
  auto& pool = lanes_of(device, count);
  // Device-side order: every lane starts after the work already on the caller's stream.
  C10_CUDA_CHECK(cudaEventRecord(pool.ready, caller.stream()));
  for (int lane = 0; lane < count; ++lane) {
    C10_CUDA_CHECK(cudaStreamWaitEvent(pool.lanes[lane]->stream(), pool.ready, 0));
  }
  cusolverStatus_t status = CUSOLVER_STATUS_INTERNAL_ERROR;
  try {
    status = feeding == LaneFeeding::kThreadPerLane ? feed_by_threads(pool, count, n, device, work)
                                                    : feed_from_caller(pool, count, n, work);
  } catch (...) {
    status = CUSOLVER_STATUS_INTERNAL_ERROR;
  }
  // ...and the caller's stream continues after every lane, also after a failure, so buffers the
  // caller frees are not handed out again while a lane still uses them.
  for (int lane = 0; lane < count; ++lane) {
    C10_CUDA_CHECK(cudaEventRecord(pool.lanes[lane]->done(), pool.lanes[lane]->stream()));
    C10_CUDA_CHECK(cudaStreamWaitEvent(caller.stream(), pool.lanes[lane]->done(), 0));
  }
  return status;
}

}  // namespace shampoo::detail
