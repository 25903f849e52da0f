#pragma once
/// Lanes of concurrent cuSOLVER work on one device: each lane is a CUDA stream of its own with a
/// cuSOLVER handle bound to it and an event that marks the end of its work. `run_on_lanes` spreads
/// the matrices of a stack over the lanes, ordered after the caller's stream on the device and
/// before it again at the end, without a host synchronization between matrices. Only built with
/// CUDA (SHAMPOO_WITH_CUDA).

#include <c10/cuda/CUDAStream.h>
#include <cusolverDn.h>

#include <cstdint>
#include <functional>

namespace shampoo::detail {

/// Most lanes one stack is spread over. The probe (78 syevd of 1024×1024 on an H100):
/// 932 ms one by one, 611 ms on 8 host threads with streams of their own; bench_cuda with these
/// lanes: 847 ms one by one, 607 ms on 8 threaded lanes, 850 ms on 8 lanes fed by one thread.
inline constexpr int kMaxEighLanes = 8;

/// How the lanes are fed.
enum class LaneFeeding {
  /// One host thread per lane, each taking the next matrix of the stack as it finishes one:
  /// overlaps the host-side parts of cuSOLVER's divide and conquer, which blocks its calling
  /// thread until the matrix is done.
  kThreadPerLane,
  /// The calling thread issues matrix i on lane i mod lanes: concurrent on the device only where
  /// the routine returns before its work is done, which syevd does not (for benchmarks: shows
  /// what threads add).
  kCallingThread,
};

/// Work on one matrix of the stack: `lane` in [0, lanes), its handle (bound to the lane's stream),
/// the matrix index. Must not throw; returns the cuSOLVER status.
using LaneWork =
    std::function<cusolverStatus_t(int lane, cusolverDnHandle_t handle, int64_t matrix)>;

/// Calls work for every matrix in [0, n) on min(lanes, n) lanes of `caller`'s device. The lanes
/// wait on the device for the work already on `caller`, and `caller` waits for every lane at the
/// end, so buffers allocated on `caller` may be used by the work and freed after the call.
/// Returns the first failure's status (the remaining matrices are then skipped), or success.
/// Lanes (streams, handles, events) are created on first use and cached per thread and device;
/// each call of run_on_lanes uses them for its own duration only.
cusolverStatus_t run_on_lanes(const c10::cuda::CUDAStream& caller, int64_t n, int lanes,
                              LaneFeeding feeding, const LaneWork& work);

}  // namespace shampoo::detail
