#include "preconditioners/cuda/cusolver_eigh.h"

#include <climits>

// cusolverDnXsyevBatched arrived in cuSOLVER 11.7.1 (CUDA 12.6 update 2).
#if defined(CUSOLVER_VERSION) && CUSOLVER_VERSION >= 11701
#define SHAMPOO_HAS_XSYEV_BATCHED 1
#else
#define SHAMPOO_HAS_XSYEV_BATCHED 0
#endif

namespace shampoo::kernels::cuda {
namespace {

constexpr auto kJob = CUSOLVER_EIG_MODE_VECTOR;
constexpr auto kFill = CUBLAS_FILL_MODE_LOWER;

cusolverStatus_t syevd_size(cusolverDnHandle_t h, int d, const float* a, const float* w, int* l) {
  return cusolverDnSsyevd_bufferSize(h, kJob, kFill, d, a, d, w, l);
}
cusolverStatus_t syevd_size(cusolverDnHandle_t h, int d, const double* a, const double* w, int* l) {
  return cusolverDnDsyevd_bufferSize(h, kJob, kFill, d, a, d, w, l);
}
cusolverStatus_t syevd(cusolverDnHandle_t h, int d, float* a, float* w, float* work, int l,
                       int* info) {
  return cusolverDnSsyevd(h, kJob, kFill, d, a, d, w, work, l, info);
}
cusolverStatus_t syevd(cusolverDnHandle_t h, int d, double* a, double* w, double* work, int l,
                       int* info) {
  return cusolverDnDsyevd(h, kJob, kFill, d, a, d, w, work, l, info);
}
cusolverStatus_t syevj_size(cusolverDnHandle_t h, int d, const float* a, const float* w, int* l,
                            syevjInfo_t p, int batch) {
  return cusolverDnSsyevjBatched_bufferSize(h, kJob, kFill, d, a, d, w, l, p, batch);
}
cusolverStatus_t syevj_size(cusolverDnHandle_t h, int d, const double* a, const double* w, int* l,
                            syevjInfo_t p, int batch) {
  return cusolverDnDsyevjBatched_bufferSize(h, kJob, kFill, d, a, d, w, l, p, batch);
}
cusolverStatus_t syevj(cusolverDnHandle_t h, int d, float* a, float* w, float* work, int l,
                       int* info, syevjInfo_t p, int batch) {
  return cusolverDnSsyevjBatched(h, kJob, kFill, d, a, d, w, work, l, info, p, batch);
}
cusolverStatus_t syevj(cusolverDnHandle_t h, int d, double* a, double* w, double* work, int l,
                       int* info, syevjInfo_t p, int batch) {
  return cusolverDnDsyevjBatched(h, kJob, kFill, d, a, d, w, work, l, info, p, batch);
}

template <typename T>
constexpr cudaDataType kDataType = sizeof(T) == sizeof(double) ? CUDA_R_64F : CUDA_R_32F;

bool fits_int(int64_t d, int64_t batch) { return d <= INT_MAX && batch <= INT_MAX; }

/// Bytes of `elements` values of T; the legacy API counts its workspace in elements.
template <typename T>
size_t bytes_of(int elements) {
  return static_cast<size_t>(elements < 1 ? 1 : elements) * sizeof(T);
}

template <typename T>
cusolverStatus_t xsyev_batched_size(cusolverDnHandle_t handle, const EighParams& params,
                                    const T* matrices, const T* eigenvalues, int64_t d,
                                    int64_t batch, EighWorkspace* workspace) {
#if SHAMPOO_HAS_XSYEV_BATCHED
  return cusolverDnXsyevBatched_bufferSize(handle, params.generic, kJob, kFill, d, kDataType<T>,
                                           matrices, d, kDataType<T>, eigenvalues, kDataType<T>,
                                           &workspace->device_bytes, &workspace->host_bytes, batch);
#else
  (void)handle, (void)params, (void)matrices, (void)eigenvalues, (void)d, (void)batch;
  (void)workspace;
  return CUSOLVER_STATUS_NOT_SUPPORTED;
#endif
}

template <typename T>
cusolverStatus_t xsyev_batched(cusolverDnHandle_t handle, const EighParams& params, T* matrices,
                               T* eigenvalues, int64_t d, int64_t batch, void* device_work,
                               void* host_work, const EighWorkspace& workspace, int* info) {
#if SHAMPOO_HAS_XSYEV_BATCHED
  return cusolverDnXsyevBatched(handle, params.generic, kJob, kFill, d, kDataType<T>, matrices, d,
                                kDataType<T>, eigenvalues, kDataType<T>, device_work,
                                workspace.device_bytes, host_work, workspace.host_bytes, info,
                                batch);
#else
  (void)handle, (void)params, (void)matrices, (void)eigenvalues, (void)d, (void)batch;
  (void)device_work, (void)host_work, (void)workspace, (void)info;
  return CUSOLVER_STATUS_NOT_SUPPORTED;
#endif
}

/// syevd on each matrix in turn, all with the same workspace (stream order serializes them).
template <typename T>
cusolverStatus_t syevd_each(cusolverDnHandle_t handle, T* matrices, T* eigenvalues, int64_t d,
                            int64_t batch, T* work, const EighWorkspace& workspace, int* info) {
  const auto lwork = static_cast<int>(workspace.device_bytes / sizeof(T));
  for (int64_t i = 0; i < batch; ++i) {
    const auto status = syevd(handle, static_cast<int>(d), matrices + i * d * d,
                              eigenvalues + i * d, work, lwork, info + i);
    if (status != CUSOLVER_STATUS_SUCCESS) return status;
  }
  return CUSOLVER_STATUS_SUCCESS;
}

}  // namespace

bool has_batched_eigh() { return SHAMPOO_HAS_XSYEV_BATCHED != 0; }

cusolverStatus_t set_jacobi_params(syevjInfo_t params, double tolerance, int max_sweeps) {
  if (tolerance > 0.0) {
    const auto status = cusolverDnXsyevjSetTolerance(params, tolerance);
    if (status != CUSOLVER_STATUS_SUCCESS) return status;
  }
  const auto status = cusolverDnXsyevjSetMaxSweeps(params, max_sweeps);
  if (status != CUSOLVER_STATUS_SUCCESS) return status;
  return cusolverDnXsyevjSetSortEig(params, 1);
}

template <typename T>
cusolverStatus_t eigh_stack_workspace(cusolverDnHandle_t handle, EighKernel kernel,
                                      const EighParams& params, const T* matrices,
                                      const T* eigenvalues, int64_t d, int64_t batch,
                                      EighWorkspace* workspace) {
  *workspace = EighWorkspace{};
  if (!fits_int(d, batch)) return CUSOLVER_STATUS_INVALID_VALUE;
  int lwork = 0;
  cusolverStatus_t status = CUSOLVER_STATUS_SUCCESS;
  switch (kernel) {
    case EighKernel::kBatchedJacobi:
      if (d > kMaxBatchedJacobiSize) return CUSOLVER_STATUS_INVALID_VALUE;
      status = syevj_size(handle, static_cast<int>(d), matrices, eigenvalues, &lwork, params.jacobi,
                          static_cast<int>(batch));
      workspace->device_bytes = bytes_of<T>(lwork);
      return status;
    case EighKernel::kBatched:
      return xsyev_batched_size<T>(handle, params, matrices, eigenvalues, d, batch, workspace);
    case EighKernel::kDivideAndConquer:
      status = syevd_size(handle, static_cast<int>(d), matrices, eigenvalues, &lwork);
      workspace->device_bytes = bytes_of<T>(lwork);
      return status;
  }
  return CUSOLVER_STATUS_INVALID_VALUE;
}

template <typename T>
cusolverStatus_t eigh_stack(cusolverDnHandle_t handle, EighKernel kernel, const EighParams& params,
                            T* matrices, T* eigenvalues, int64_t d, int64_t batch,
                            void* device_work, void* host_work, const EighWorkspace& workspace,
                            int* info) {
  if (batch == 0) return CUSOLVER_STATUS_SUCCESS;
  if (!fits_int(d, batch)) return CUSOLVER_STATUS_INVALID_VALUE;
  auto* work = static_cast<T*>(device_work);
  switch (kernel) {
    case EighKernel::kBatchedJacobi:
      return syevj(handle, static_cast<int>(d), matrices, eigenvalues, work,
                   static_cast<int>(workspace.device_bytes / sizeof(T)), info, params.jacobi,
                   static_cast<int>(batch));
    case EighKernel::kBatched:
      return xsyev_batched(handle, params, matrices, eigenvalues, d, batch, device_work, host_work,
                           workspace, info);
    case EighKernel::kDivideAndConquer:
      return syevd_each(handle, matrices, eigenvalues, d, batch, work, workspace, info);
  }
  return CUSOLVER_STATUS_INVALID_VALUE;
}

const char* cusolver_status_name(cusolverStatus_t status) {
  switch (status) {
    case CUSOLVER_STATUS_SUCCESS:
      return "CUSOLVER_STATUS_SUCCESS";
    case CUSOLVER_STATUS_NOT_INITIALIZED:
      return "CUSOLVER_STATUS_NOT_INITIALIZED";
    case CUSOLVER_STATUS_ALLOC_FAILED:
      return "CUSOLVER_STATUS_ALLOC_FAILED";
    case CUSOLVER_STATUS_INVALID_VALUE:
      return "CUSOLVER_STATUS_INVALID_VALUE";
    case CUSOLVER_STATUS_ARCH_MISMATCH:
      return "CUSOLVER_STATUS_ARCH_MISMATCH";
    case CUSOLVER_STATUS_EXECUTION_FAILED:
      return "CUSOLVER_STATUS_EXECUTION_FAILED";
    case CUSOLVER_STATUS_INTERNAL_ERROR:
      return "CUSOLVER_STATUS_INTERNAL_ERROR";
    case CUSOLVER_STATUS_NOT_SUPPORTED:
      return "CUSOLVER_STATUS_NOT_SUPPORTED";
    default:
      return "cusolver error";
  }
}

template cusolverStatus_t eigh_stack_workspace<float>(cusolverDnHandle_t, EighKernel,
                                                      const EighParams&, const float*, const float*,
                                                      int64_t, int64_t, EighWorkspace*);
template cusolverStatus_t eigh_stack_workspace<double>(cusolverDnHandle_t, EighKernel,
                                                       const EighParams&, const double*,
                                                       const double*, int64_t, int64_t,
                                                       EighWorkspace*);
template cusolverStatus_t eigh_stack<float>(cusolverDnHandle_t, EighKernel, const EighParams&,
                                            float*, float*, int64_t, int64_t, void*, void*,
                                            const EighWorkspace&, int*);
template cusolverStatus_t eigh_stack<double>(cusolverDnHandle_t, EighKernel, const EighParams&,
                                             double*, double*, int64_t, int64_t, void*, void*,
                                             const EighWorkspace&, int*);

}  // namespace shampoo::kernels::cuda
