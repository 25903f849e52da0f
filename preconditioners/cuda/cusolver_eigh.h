#pragma once
/// cuSOLVER kernel layer of the symmetric eigendecompositions (no LibTorch: raw device pointers,
/// sizes and the handle in; cusolverStatus_t out). `batch` symmetric d×d matrices are stored one
/// after the other; symmetric input reads the same in row- and column-major order. On return the
/// matrices hold the eigenvectors in column-major order (so, read row-major, eigenvector j is
/// row j) and W [batch, d] the eigenvalues, ascending. info[i] ≠ 0 marks a matrix that did not
/// converge.
///
/// Two algorithms: Jacobi on the whole batch in one call (syevjBatched, d ≤ 32, stacks of small
/// equal-size blocks) and divide and conquer one matrix at a time (syevd, large blocks).

#include <cusolverDn.h>

namespace shampoo::kernels::cuda {

/// Largest matrix size cuSOLVER's batched Jacobi accepts.
inline constexpr int kMaxBatchedJacobiSize = 32;

/// Workspace elements (of T) for eigh_stack with these sizes.
template <typename T>
cusolverStatus_t eigh_stack_workspace(cusolverDnHandle_t handle, int d, int batch,
                                      bool batched_jacobi, syevjInfo_t params, int* lwork);

/// Eigendecomposes the stack in place (see above); `work` holds `lwork` elements, `info` batch
/// ints, all in device memory. Asynchronous on the handle's stream.
template <typename T>
cusolverStatus_t eigh_stack(cusolverDnHandle_t handle, T* matrices, T* eigenvalues, int d,
                            int batch, T* work, int lwork, int* info, bool batched_jacobi,
                            syevjInfo_t params);

const char* cusolver_status_name(cusolverStatus_t status);

}  // namespace shampoo::kernels::cuda
