#include "preconditioners/cuda/cusolver_eigh.h"

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

}  // namespace

template <typename T>
cusolverStatus_t eigh_stack_workspace(cusolverDnHandle_t handle, int d, int batch,
                                      bool batched_jacobi, syevjInfo_t params, int* lwork) {
  if (batched_jacobi) {
    if (d > kMaxBatchedJacobiSize) return CUSOLVER_STATUS_INVALID_VALUE;
    return syevj_size(handle, d, static_cast<const T*>(nullptr), static_cast<const T*>(nullptr),
                      lwork, params, batch);
  }
  return syevd_size(handle, d, static_cast<const T*>(nullptr), static_cast<const T*>(nullptr),
                    lwork);
}

template <typename T>
cusolverStatus_t eigh_stack(cusolverDnHandle_t handle, T* matrices, T* eigenvalues, int d,
                            int batch, T* work, int lwork, int* info, bool batched_jacobi,
                            syevjInfo_t params) {
  if (batch == 0) return CUSOLVER_STATUS_SUCCESS;
  if (batched_jacobi) {
    return syevj(handle, d, matrices, eigenvalues, work, lwork, info, params, batch);
  }
  const long long stride = static_cast<long long>(d) * d;
  for (int i = 0; i < batch; ++i) {
    const auto status = syevd(handle, d, matrices + i * stride,
                              eigenvalues + static_cast<long long>(i) * d, work, lwork, info + i);
    if (status != CUSOLVER_STATUS_SUCCESS) return status;
  }
  return CUSOLVER_STATUS_SUCCESS;
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

template cusolverStatus_t eigh_stack_workspace<float>(cusolverDnHandle_t, int, int, bool,
                                                      syevjInfo_t, int*);
template cusolverStatus_t eigh_stack_workspace<double>(cusolverDnHandle_t, int, int, bool,
                                                       syevjInfo_t, int*);
template cusolverStatus_t eigh_stack<float>(cusolverDnHandle_t, float*, float*, int, int, float*,
                                            int, int*, bool, syevjInfo_t);
template cusolverStatus_t eigh_stack<double>(cusolverDnHandle_t, double*, double*, int, int,
                                             double*, int, int*, bool, syevjInfo_t);

}  // namespace shampoo::kernels::cuda
