#pragma once
/// Launcher of the cuSOLVER eigendecompositions (preconditioners/cuda/cusolver_eigh.h) for CUDA
/// tensors: checks the stack, allocates workspace with LibTorch's caching allocator, runs on the
/// current stream (or on lanes ordered around it, preconditioners/cuda/eigh_lanes.h), converts
/// errors into c10::Error. Only built with CUDA (SHAMPOO_WITH_CUDA).

#include <ATen/ATen.h>

#include <vector>

#include "preconditioners/decomposition.h"

namespace shampoo::detail {

/// How cuda_eigh decomposes a stack [n, d, d]. kAuto is what the optimizer uses; the others are
/// for tests and benchmarks.
enum class CudaEighMethod {
  /// d ≤ 32: kBatchedJacobi; above: kConcurrent (kSequential for a single matrix). Every
  /// matrix's result independent of the rest of the stack. Measurements in cuda_eigh.cpp.
  kAuto,
  /// cusolverDn?syevjBatched on the whole stack, d ≤ 32.
  kBatchedJacobi,
  /// cusolverDnXsyevBatched on the whole stack (cuSOLVER ≥ 11.7.1): the routine
  /// torch::linalg_eigh calls for stacks of matrices up to 32, and by far the fastest above
  /// (78×1024: 153 ms against 607 for kConcurrent) but with a workspace of ~20 MiB per 1024
  /// matrix. Above 32 a matrix's result depends on the size of the batch (not bit for bit the
  /// matrix alone), so the optimizer does not use it there.
  kBatched,
  /// cusolverDnXsyevBatched on chunks of exactly kBatchedChunk matrices, the last padded with
  /// identity matrices: every matrix goes through a batch of the same size, so its result does
  /// not depend on the stack. Pays for stacks of many large blocks only (see cuda_eigh.cpp).
  kBatchedChunks,
  /// Divide and conquer (syevd) one matrix after the other on the current stream.
  kSequential,
  /// Divide and conquer, the matrices spread over up to kMaxEighLanes lanes (streams with
  /// handles of their own), each fed by a host thread of its own. Bit for bit kSequential.
  kConcurrent,
  /// As kConcurrent, the lanes fed round robin by the calling thread alone (benchmarks).
  kConcurrentStreams,
};

/// Matrices per XsyevBatched call of CudaEighMethod::kBatchedChunks. On an H100 a call at 1024
/// took ~65 ms for 4, 8 or 16 matrices and 153 ms for 78 (cuda_eigh.cpp).
inline constexpr int64_t kBatchedChunk = 16;

/// What kAuto resolves to above 32, process-wide: kAuto (the default: kConcurrent, kSequential
/// for one matrix) or, set by benchmarks weighing time against memory, kBatchedChunks. Every
/// matrix's result stays independent of its stack either way.
void set_large_eigh_method_for_benchmarks(CudaEighMethod method);

struct CudaEighResult {
  at::Tensor eigenvalues;       ///< [n, d], ascending
  at::Tensor eigenvectors;      ///< [n, d, d], eigenvector j in column j
  at::Tensor info;              ///< [n] int32 on the device: cuSOLVER's info, 0 when converged
  std::vector<bool> converged;  ///< info == 0, read back by cuda_eigh
};

/// Eigendecomposition of every matrix of a stack [n, d, d] of symmetric CUDA matrices (Float or
/// Double) on the current stream; waits for the device to read back `converged`.
CudaEighResult cuda_eigh(const at::Tensor& stack, CudaEighMethod method = CudaEighMethod::kAuto);

/// Per matrix of `result`, a decomposition of `stack`: whether it can be used, by the rule of
/// decompose_cuda below. Any device (the rule is tested on the CPU). One host synchronization; a
/// second, with the accuracy check in float64, only when some finite result is reported as not
/// converged.
std::vector<bool> usable_decompositions(const at::Tensor& stack, const CudaEighResult& result);

/// The stack's decompositions on CUDA. A matrix's result is used when it is finite (the sum of
/// its eigenvalues and eigenvector entries is) and converged, or, when cuSOLVER reports no
/// convergence (Jacobi stopped at its sweep limit), when it is accurate to working precision
/// anyway (residual and orthogonality within 30·d·ε, eigenvalues ascending). The other matrices
/// are retried together in float64 (divide and conquer) when `retry_double_precision`, else
/// marked failed. One host synchronization when every matrix converged.
Decomposition decompose_cuda(const at::Tensor& stack, bool retry_double_precision,
                             CudaEighMethod method = CudaEighMethod::kAuto);

}  // namespace shampoo::detail
