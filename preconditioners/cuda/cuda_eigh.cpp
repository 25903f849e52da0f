#include "preconditioners/cuda/cuda_eigh.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <unordered_map>

#include "preconditioners/cuda/cusolver_eigh.h"

namespace shampoo::detail {
namespace {

void check(cusolverStatus_t status, const char* what) {
  TORCH_CHECK(status == CUSOLVER_STATUS_SUCCESS, "cuSOLVER ", what,
              " failed: ", kernels::cuda::cusolver_status_name(status));
}

/// This thread's cuSOLVER handle for the current device, bound to the current stream. Handles
/// are expensive to create, so each thread keeps one per device (LibTorch's own handle pool
/// lives in libtorch_cuda_linalg, which the C++ distribution does not link).
cusolverDnHandle_t current_handle() {
  struct Handles {
    std::unordered_map<int, cusolverDnHandle_t> by_device;
    ~Handles() {
      for (auto& [device, handle] : by_device) cusolverDnDestroy(handle);
    }
  };
  thread_local Handles handles;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  auto& handle = handles.by_device[stream.device_index()];
  if (handle == nullptr) check(cusolverDnCreate(&handle), "cusolverDnCreate");
  check(cusolverDnSetStream(handle, stream.stream()), "cusolverDnSetStream");
  return handle;
}

/// Owns a syevjInfo_t (batched Jacobi parameters).
class JacobiParams {
 public:
  JacobiParams() { check(cusolverDnCreateSyevjInfo(&params_), "cusolverDnCreateSyevjInfo"); }
  ~JacobiParams() { cusolverDnDestroySyevjInfo(params_); }
  JacobiParams(const JacobiParams&) = delete;
  JacobiParams& operator=(const JacobiParams&) = delete;
  syevjInfo_t get() const { return params_; }

 private:
  syevjInfo_t params_ = nullptr;
};

template <typename T>
CudaEighResult run(const at::Tensor& stack, bool batched_jacobi) {
  const int n = static_cast<int>(stack.size(0));
  const int d = static_cast<int>(stack.size(1));
  const bool jacobi = batched_jacobi && d <= kernels::cuda::kMaxBatchedJacobiSize;
  auto handle = current_handle();
  JacobiParams params;
  CudaEighResult result;
  result.eigenvectors = stack.clone(at::MemoryFormat::Contiguous);  // decomposed in place
  result.eigenvalues = at::empty({n, d}, stack.options());
  int lwork = 0;
  check(kernels::cuda::eigh_stack_workspace<T>(handle, d, n, jacobi, params.get(), &lwork),
        "workspace query");
  auto work = at::empty({std::max(lwork, 1)}, stack.options());
  auto info = at::zeros({n}, stack.options().dtype(at::kInt));
  check(kernels::cuda::eigh_stack<T>(handle, result.eigenvectors.data_ptr<T>(),
                                     result.eigenvalues.data_ptr<T>(), d, n, work.data_ptr<T>(),
                                     lwork, info.data_ptr<int>(), jacobi, params.get()),
        jacobi ? "syevjBatched" : "syevd");
  // Column-major eigenvectors: read row-major, eigenvector j is row j; transpose to columns.
  result.eigenvectors = result.eigenvectors.transpose(1, 2);
  const auto host_info = info.cpu();
  const int* codes = host_info.data_ptr<int>();
  result.converged.resize(n);
  for (int i = 0; i < n; ++i) result.converged[i] = codes[i] == 0;
  return result;
}

}  // namespace

CudaEighResult cuda_eigh(const at::Tensor& stack, bool batched_jacobi) {
  TORCH_CHECK(stack.is_cuda() && stack.dim() == 3 && stack.size(1) == stack.size(2),
              "cuda_eigh: expected a CUDA stack [n, d, d], got ", stack.sizes(), " on ",
              stack.device());
  const c10::cuda::CUDAGuard guard(stack.device());
  if (stack.scalar_type() == at::kDouble) return run<double>(stack, batched_jacobi);
  TORCH_CHECK(stack.scalar_type() == at::kFloat, "cuda_eigh: dtype ", stack.scalar_type(),
              " is not supported (Float or Double)");
  return run<float>(stack, batched_jacobi);
}

/// CUDA: cuSOLVER on the whole stack (batched Jacobi for small blocks), then a float64 retry of
/// the matrices that did not converge or came out non-finite.
Decomposition decompose_cuda(const at::Tensor& stack, bool retry_double_precision) {
  const int64_t n = stack.size(0);
  Decomposition out(n);
  auto first = cuda_eigh(stack);
  const auto finite = at::logical_and(at::isfinite(first.eigenvalues).all(1),
                                      at::isfinite(first.eigenvectors).flatten(1).all(1))
                          .cpu();
  const bool* finite_row = finite.data_ptr<bool>();
  out.eigenvalues = first.eigenvalues;
  out.eigenvectors = first.eigenvectors;
  for (int64_t i = 0; i < n; ++i) {
    if (first.converged[i] && finite_row[i]) continue;
    if (retry_double_precision && stack.scalar_type() != at::kDouble) {
      ++out.retried;
      auto retry = cuda_eigh(stack.narrow(0, i, 1).to(at::kDouble), /*batched_jacobi=*/false);
      if (retry.converged[0] && at::isfinite(retry.eigenvectors).all().item<bool>()) {
        out.in_double[i] = true;
        out.eigenvalues_double[i] = retry.eigenvalues[0];
        out.eigenvectors_double[i] = retry.eigenvectors[0];
        continue;
      }
    }
    out.failed[i] = true;
  }
  return out;
}

}  // namespace shampoo::detail
