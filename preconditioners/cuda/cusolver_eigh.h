#pragma once
/// cuSOLVER kernel layer of the symmetric eigendecompositions (no LibTorch: raw device pointers,
/// sizes and the handle in; cusolverStatus_t out). `batch` symmetric d×d matrices are stored one
/// after the other; symmetric input reads the same in row- and column-major order. On return the
/// matrices hold the eigenvectors in column-major order (so, read row-major, eigenvector j is
/// row j) and W [batch, d] the eigenvalues, ascending. info[i] ≠ 0 marks a matrix that did not
/// converge. Everything is asynchronous on the handle's stream, except where cuSOLVER itself
/// blocks the host (divide and conquer does, see cuda_eigh.cpp).

#include <cusolverDn.h>

#include <cstddef>
#include <cstdint>

namespace shampoo::kernels::cuda {

/// Largest matrix size cuSOLVER's batched Jacobi accepts.
inline constexpr int64_t kMaxBatchedJacobiSize = 32;

/// The cuSOLVER routine that decomposes a stack.
enum class EighKernel {
  /// cusolverDn?syevjBatched: Jacobi on the whole stack in one call, d ≤ 32.
  kBatchedJacobi,
  /// cusolverDnXsyevBatched (64-bit API, cuSOLVER ≥ 11.7.1): the whole stack in one call, any d
  /// (Jacobi for small matrices, divide and conquer above); what torch::linalg_eigh calls for
  /// stacks of matrices up to 32. Unavailable (CUSOLVER_STATUS_NOT_SUPPORTED) on older cuSOLVER.
  kBatched,
  /// cusolverDn?syevd: divide and conquer, one matrix per call. A matrix's result does not
  /// depend on the rest of the stack, nor on the handle, stream or workspace that computed it.
  kDivideAndConquer,
};

/// Whether this build's cuSOLVER has cusolverDnXsyevBatched.
bool has_batched_eigh();

/// Parameters objects of the routines; created and owned by the caller (cuda_eigh.cpp).
struct EighParams {
  syevjInfo_t jacobi = nullptr;          ///< kBatchedJacobi: tolerance, sweeps, sorting
  cusolverDnParams_t generic = nullptr;  ///< kBatched
};

/// Sets the batched Jacobi parameters: tolerance ‖off(A)‖_F ≤ tolerance·‖A‖_F (0 keeps cuSOLVER's
/// default, machine epsilon), at most `max_sweeps` sweeps, eigenvalues sorted ascending.
cusolverStatus_t set_jacobi_params(syevjInfo_t params, double tolerance, int max_sweeps);

/// Workspace of one eigh_stack call, in bytes, on the device and on the host.
struct EighWorkspace {
  size_t device_bytes = 0;
  size_t host_bytes = 0;
};

/// Workspace for eigh_stack with these sizes and buffers (for kDivideAndConquer: for one
/// matrix, reused by each matrix in turn).
template <typename T>
cusolverStatus_t eigh_stack_workspace(cusolverDnHandle_t handle, EighKernel kernel,
                                      const EighParams& params, const T* matrices,
                                      const T* eigenvalues, int64_t d, int64_t batch,
                                      EighWorkspace* workspace);

/// Eigendecomposes the stack in place (see above). `device_work` and `host_work` hold the bytes
/// eigh_stack_workspace asked for; `info` holds `batch` ints in device memory.
template <typename T>
cusolverStatus_t eigh_stack(cusolverDnHandle_t handle, EighKernel kernel, const EighParams& params,
                            T* matrices, T* eigenvalues, int64_t d, int64_t batch,
                            void* device_work, void* host_work, const EighWorkspace& workspace,
                            int* info);

const char* cusolver_status_name(cusolverStatus_t status);

}  // namespace shampoo::kernels::cuda
