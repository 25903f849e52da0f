#pragma once
/// Launcher of the cuSOLVER eigendecompositions (preconditioners/cuda/cusolver_eigh.h) for CUDA
/// tensors: checks the stack, allocates workspace with LibTorch's caching allocator, runs on the
/// current stream with LibTorch's cuSOLVER handle, converts errors into c10::Error. Only built
/// with CUDA (SHAMPOO_WITH_CUDA).

#include <ATen/ATen.h>

#include <vector>

#include "preconditioners/decomposition.h"

namespace shampoo::detail {

struct CudaEighResult {
  at::Tensor eigenvalues;   ///< [n, d], ascending
  at::Tensor eigenvectors;  ///< [n, d, d], eigenvector j in column j
  std::vector<bool> converged;
};

/// Eigendecomposition of every matrix of a stack [n, d, d] of symmetric CUDA matrices (Float or
/// Double): one batched Jacobi call when d ≤ 32 and `batched_jacobi`, else divide and conquer
/// one matrix at a time.
CudaEighResult cuda_eigh(const at::Tensor& stack, bool batched_jacobi = true);

/// The stack's decompositions on CUDA: cuSOLVER on the whole stack (batched Jacobi for small
/// blocks), then a float64 retry (divide and conquer) of the matrices that did not converge or
/// came out non-finite, when `retry_double_precision`.
Decomposition decompose_cuda(const at::Tensor& stack, bool retry_double_precision);

}  // namespace shampoo::detail
