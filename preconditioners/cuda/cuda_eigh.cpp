#include "preconditioners/cuda/cuda_eigh.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <unordered_map>

#include "preconditioners/cuda/cusolver_eigh.h"
#include "preconditioners/cuda/eigh_lanes.h"

namespace shampoo::detail {
namespace {

namespace cusolver = shampoo::kernels::cuda;
using cusolver::EighKernel;

/// Batched Jacobi: cuSOLVER's defaults (tolerance machine epsilon, 100 sweeps), as
/// torch::linalg_eigh used them. Should a float32 matrix stop at the sweep limit with ‖off(A)‖ at
/// rounding level just above ε·‖A‖ (none of bench_cuda's stacks did), decompose_cuda checks its
/// accuracy instead of discarding it.
constexpr double kJacobiTolerance = 0.0;  // 0: cuSOLVER's default
constexpr int kJacobiMaxSweeps = 100;

/// Accept a decomposition that cuSOLVER reports as not converged when ‖AQ − QΛ‖_F/‖A‖_F and
/// ‖QᵀQ − I‖_F are below this many d·ε: the form of LAPACK's eigensolver test ratios, with
/// their usual threshold.
constexpr double kAcceptedTestRatio = 30.0;

void check(cusolverStatus_t status, const char* what) {
  TORCH_CHECK(status == CUSOLVER_STATUS_SUCCESS, "cuSOLVER ", what,
              " failed: ", cusolver::cusolver_status_name(status));
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

/// This thread's parameter objects of the routines (host-side settings, not tied to a device),
/// created once rather than per call.
const cusolver::EighParams& eigh_params() {
  struct Owned {
    cusolver::EighParams params;
    Owned() {
      check(cusolverDnCreateSyevjInfo(&params.jacobi), "cusolverDnCreateSyevjInfo");
      check(cusolver::set_jacobi_params(params.jacobi, kJacobiTolerance, kJacobiMaxSweeps),
            "syevjBatched parameters");
      check(cusolverDnCreateParams(&params.generic), "cusolverDnCreateParams");
    }
    ~Owned() {
      if (params.jacobi != nullptr) cusolverDnDestroySyevjInfo(params.jacobi);
      if (params.generic != nullptr) cusolverDnDestroyParams(params.generic);
    }
  };
  thread_local Owned owned;
  return owned.params;
}

const char* kernel_name(EighKernel kernel) {
  switch (kernel) {
    case EighKernel::kBatchedJacobi:
      return "syevjBatched";
    case EighKernel::kBatched:
      return "XsyevBatched";
    case EighKernel::kDivideAndConquer:
      return "syevd";
  }
  return "eigh";
}

/// The automatic choice. bench_cuda on an H100 (CUDA 13, float32), median ms and peak MiB
/// allocated above the input:
///   256×16:  syevjBatched 0.11, XsyevBatched 0.18, linalg_eigh 0.23 (77 MiB);
///   64×32:   syevjBatched 0.17, XsyevBatched 0.27, linalg_eigh 0.27;
///   16×256:  syevd on 8 threaded lanes 17, one by one 32, XsyevBatched (whole stack or one
///            chunk of 16) 2.9, linalg_eigh 75;
///   78×1024: syevd on 8 threaded lanes 607 (445 MiB), one by one 847, XsyevBatched in chunks of
///            16 331 (642 MiB), of 8 743, whole stack 153 (1609 MiB), linalg_eigh 850 (329 MiB).
/// syevjBatched reported every matrix of those stacks converged (its float32 results had
/// numerical bugs before cuSOLVER 11.1.2, CUDA 11.3.1). Above 32 the default stays divide and
/// conquer per matrix: XsyevBatched on a whole stack gives a matrix a result that depends on the
/// batch, and in fixed chunks it costs a call of ~65 ms at 1024 even for one matrix (padded), so
/// it only pays for stacks of many blocks, at 1.4× the memory: a choice left to the caller.
std::atomic<CudaEighMethod> large_eigh_method{CudaEighMethod::kAuto};

CudaEighMethod resolve(CudaEighMethod method, int64_t n, int64_t d) {
  if (method != CudaEighMethod::kAuto) return method;
  if (d <= cusolver::kMaxBatchedJacobiSize) return CudaEighMethod::kBatchedJacobi;
  const auto large = large_eigh_method.load();
  if (large != CudaEighMethod::kAuto) return large;
  return n > 1 ? CudaEighMethod::kConcurrent : CudaEighMethod::kSequential;
}

at::Tensor byte_buffer(int64_t bytes, const at::Tensor& like) {
  return at::empty({std::max<int64_t>(bytes, 1)}, like.options().dtype(at::kByte));
}

/// One kernel call (or syevd loop) on `batch` matrices at these device pointers, on the current
/// stream; `like` gives the device of the workspace.
template <typename T>
void call_on_current_stream(EighKernel kernel, T* vectors, T* values, int* info, int64_t d,
                            int64_t batch, const at::Tensor& like) {
  const auto handle = current_handle();
  const auto& params = eigh_params();
  cusolver::EighWorkspace workspace;
  check(cusolver::eigh_stack_workspace<T>(handle, kernel, params, vectors, values, d, batch,
                                          &workspace),
        "workspace query");
  const auto device_work = byte_buffer(static_cast<int64_t>(workspace.device_bytes), like);
  // Host workspace released after the call, as torch::linalg_eigh does with it.
  std::vector<unsigned char> host_work(workspace.host_bytes);
  check(cusolver::eigh_stack<T>(handle, kernel, params, vectors, values, d, batch,
                                device_work.data_ptr(), host_work.data(), workspace, info),
        kernel_name(kernel));
}

template <typename T>
void run_on_current_stream(CudaEighResult& r, EighKernel kernel, int64_t n, int64_t d) {
  call_on_current_stream<T>(kernel, r.eigenvectors.data_ptr<T>(), r.eigenvalues.data_ptr<T>(),
                            r.info.data_ptr<int>(), d, n, r.info);
}

/// XsyevBatched on chunks of exactly kBatchedChunk matrices, the last one padded with identity
/// matrices: XsyevBatched's result for a matrix depends on the size of its batch (cuda_test saw
/// up to 3e-4 in float32 eigenvectors of 1024×1024 between batches of 1, 2 and 5), not on its
/// place in the batch nor on the other matrices (cuda_test checks both), so every matrix goes
/// through a batch of the same size.
template <typename T>
void run_batched_chunks(CudaEighResult& r, int64_t n, int64_t d) {
  const int64_t chunk = kBatchedChunk;
  const int64_t full = n / chunk * chunk;
  T* vectors = r.eigenvectors.data_ptr<T>();
  T* values = r.eigenvalues.data_ptr<T>();
  int* info = r.info.data_ptr<int>();
  for (int64_t start = 0; start < full; start += chunk) {
    call_on_current_stream<T>(EighKernel::kBatched, vectors + start * d * d, values + start * d,
                              info + start, d, chunk, r.info);
  }
  const int64_t rest = n - full;
  if (rest == 0) return;
  auto padded = at::eye(d, r.eigenvalues.options()).expand({chunk, d, d}).contiguous();
  padded.narrow(0, 0, rest).copy_(r.eigenvectors.narrow(0, full, rest));
  auto padded_values = at::empty({chunk, d}, r.eigenvalues.options());
  auto padded_info = at::empty({chunk}, r.info.options());
  call_on_current_stream<T>(EighKernel::kBatched, padded.data_ptr<T>(), padded_values.data_ptr<T>(),
                            padded_info.data_ptr<int>(), d, chunk, r.info);
  r.eigenvectors.narrow(0, full, rest).copy_(padded.narrow(0, 0, rest));
  r.eigenvalues.narrow(0, full, rest).copy_(padded_values.narrow(0, 0, rest));
  r.info.narrow(0, full, rest).copy_(padded_info.narrow(0, 0, rest));
}

/// Divide and conquer with the matrices spread over lanes (eigh_lanes.h). Each lane has its own
/// workspace, allocated here on the caller's stream: the caller's stream waits for every lane
/// before it goes on, so the caching allocator may hand the memory out again once this returns,
/// and no workspace stays allocated between root computations.
template <typename T>
void run_concurrent(CudaEighResult& r, int64_t n, int64_t d, LaneFeeding feeding) {
  const auto& params = eigh_params();
  T* vectors = r.eigenvectors.data_ptr<T>();
  T* values = r.eigenvalues.data_ptr<T>();
  int* info = r.info.data_ptr<int>();
  cusolver::EighWorkspace workspace;
  check(cusolver::eigh_stack_workspace<T>(current_handle(), EighKernel::kDivideAndConquer, params,
                                          vectors, values, d, 1, &workspace),
        "workspace query");
  const int lanes = static_cast<int>(std::min<int64_t>(kMaxEighLanes, n));
  constexpr int64_t kAlignment = 256;  // each lane's workspace on its own aligned slice
  const int64_t stride =
      (static_cast<int64_t>(workspace.device_bytes) + kAlignment - 1) / kAlignment * kAlignment;
  const auto device_work = byte_buffer(stride * lanes, r.info);
  auto* base = static_cast<unsigned char*>(device_work.data_ptr());
  const auto status =
      run_on_lanes(c10::cuda::getCurrentCUDAStream(), n, lanes, feeding,
                   [&](int lane, cusolverDnHandle_t handle, int64_t i) {
                     return cusolver::eigh_stack<T>(
                         handle, EighKernel::kDivideAndConquer, params, vectors + i * d * d,
                         values + i * d, d, 1, base + lane * stride, nullptr, workspace, info + i);
                   });
  check(status, "syevd (concurrent lanes)");
}

template <typename T>
void run(CudaEighResult& r, CudaEighMethod method, int64_t n, int64_t d) {
  switch (method) {
    case CudaEighMethod::kBatchedJacobi:
      TORCH_CHECK(d <= cusolver::kMaxBatchedJacobiSize, "cuda_eigh: batched Jacobi: d: got ", d,
                  ", expected at most ", cusolver::kMaxBatchedJacobiSize);
      return run_on_current_stream<T>(r, EighKernel::kBatchedJacobi, n, d);
    case CudaEighMethod::kBatched:
      TORCH_CHECK(cusolver::has_batched_eigh(),
                  "cuda_eigh: XsyevBatched needs cuSOLVER 11.7.1 or newer");
      return run_on_current_stream<T>(r, EighKernel::kBatched, n, d);
    case CudaEighMethod::kBatchedChunks:
      TORCH_CHECK(cusolver::has_batched_eigh(),
                  "cuda_eigh: XsyevBatched needs cuSOLVER 11.7.1 or newer");
      return run_batched_chunks<T>(r, n, d);
    case CudaEighMethod::kSequential:
      return run_on_current_stream<T>(r, EighKernel::kDivideAndConquer, n, d);
    case CudaEighMethod::kConcurrent:
      return run_concurrent<T>(r, n, d, LaneFeeding::kThreadPerLane);
    case CudaEighMethod::kConcurrentStreams:
      return run_concurrent<T>(r, n, d, LaneFeeding::kCallingThread);
    case CudaEighMethod::kAuto:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "cuda_eigh: unresolved method");
}

/// Decomposes without waiting for the device: `converged` is left empty.
CudaEighResult launch(const at::Tensor& stack, CudaEighMethod method) {
  TORCH_CHECK(stack.is_cuda() && stack.dim() == 3 && stack.size(1) == stack.size(2),
              "cuda_eigh: expected a CUDA stack [n, d, d], got ", stack.sizes(), " on ",
              stack.device());
  TORCH_CHECK(stack.scalar_type() == at::kFloat || stack.scalar_type() == at::kDouble,
              "cuda_eigh: dtype ", stack.scalar_type(), " is not supported (Float or Double)");
  const c10::cuda::CUDAGuard guard(stack.device());
  const int64_t n = stack.size(0);
  const int64_t d = stack.size(1);
  CudaEighResult r;
  r.eigenvectors = stack.clone(at::MemoryFormat::Contiguous);  // decomposed in place
  r.eigenvalues = at::empty({n, d}, stack.options());
  r.info = at::empty({n}, stack.options().dtype(at::kInt));  // every routine writes all of it
  if (n > 0 && d > 0) {
    if (stack.scalar_type() == at::kDouble) {
      run<double>(r, resolve(method, n, d), n, d);
    } else {
      run<float>(r, resolve(method, n, d), n, d);
    }
  }
  // Column-major eigenvectors: read row-major, eigenvector j is row j; transpose to columns.
  r.eigenvectors = r.eigenvectors.transpose(1, 2);
  return r;
}

std::vector<bool> to_host_bools(const at::Tensor& flags) {
  const auto host = flags.to(at::kCPU, at::kBool).contiguous();
  const bool* data = host.data_ptr<bool>();
  return std::vector<bool>(data, data + host.numel());
}

/// For the matrices `rows` that cuSOLVER did not report as converged: whether they are accurate
/// to working precision anyway (kAcceptedTestRatio), with eigenvalues ascending. In float64.
std::vector<bool> accurate_anyway(const at::Tensor& stack, const CudaEighResult& r,
                                  const std::vector<int64_t>& rows) {
  const auto index = at::tensor(rows, at::TensorOptions().dtype(at::kLong)).to(stack.device());
  const auto a = stack.index_select(0, index).to(at::kDouble);
  const auto q = r.eigenvectors.index_select(0, index).to(at::kDouble);
  const auto w = r.eigenvalues.index_select(0, index).to(at::kDouble);
  const int64_t d = stack.size(1);
  const double eps = stack.scalar_type() == at::kDouble ? std::numeric_limits<double>::epsilon()
                                                        : std::numeric_limits<float>::epsilon();
  const double bound = kAcceptedTestRatio * static_cast<double>(d) * eps;
  const auto scale = a.flatten(1).norm(2, 1).clamp_min(std::numeric_limits<double>::min());
  const auto residual = (at::bmm(a, q) - q * w.unsqueeze(1)).flatten(1).norm(2, 1) / scale;
  const auto orthogonality =
      (at::bmm(q.transpose(1, 2), q) - at::eye(d, a.options())).flatten(1).norm(2, 1);
  const auto ascending = (w.narrow(1, 1, d - 1) >= w.narrow(1, 0, d - 1)).all(1);
  return to_host_bools(
      (residual <= bound).logical_and(orthogonality <= bound).logical_and(ascending));
}

}  // namespace

void set_large_eigh_method_for_benchmarks(CudaEighMethod method) {
  TORCH_CHECK(method == CudaEighMethod::kAuto || method == CudaEighMethod::kBatchedChunks,
              "set_large_eigh_method_for_benchmarks: expected kAuto or kBatchedChunks");
  large_eigh_method.store(method);
}

CudaEighResult cuda_eigh(const at::Tensor& stack, CudaEighMethod method) {
  auto result = launch(stack, method);
  result.converged = to_host_bools(result.info.eq(0));
  return result;
}

std::vector<bool> usable_decompositions(const at::Tensor& stack, const CudaEighResult& r) {
  // A NaN or infinity anywhere in a matrix's results makes their sum non-finite: two reductions
  // instead of a finiteness test of every entry (small stacks pay per operation, not per entry).
  // A finite sum that overflows counts as non-finite too: such a matrix goes to float64.
  constexpr int kNotFinite = std::numeric_limits<int>::min();
  const auto total = r.eigenvalues.sum(1).add_(r.eigenvectors.sum({1, 2}));
  const auto state = at::where(at::isfinite(total), r.info, kNotFinite).to(at::kCPU);
  const int* codes = state.data_ptr<int>();
  std::vector<bool> ok(static_cast<size_t>(state.numel()));
  std::vector<int64_t> unconverged;  // finite, info ≠ 0
  for (int64_t i = 0; i < state.numel(); ++i) {
    ok[i] = codes[i] == 0;
    if (codes[i] != 0 && codes[i] != kNotFinite) unconverged.push_back(i);
  }
  if (unconverged.empty()) return ok;
  const auto accurate = accurate_anyway(stack, r, unconverged);
  for (size_t k = 0; k < unconverged.size(); ++k) ok[unconverged[k]] = accurate[k];
  return ok;
}

Decomposition decompose_cuda(const at::Tensor& stack, bool retry_double_precision,
                             CudaEighMethod method) {
  const int64_t n = stack.size(0);
  Decomposition out(n);
  const auto first = launch(stack, method);
  out.eigenvalues = first.eigenvalues;
  out.eigenvectors = first.eigenvectors;
  const auto ok = usable_decompositions(stack, first);
  std::vector<int64_t> rest;
  for (int64_t i = 0; i < n; ++i) {
    if (!ok[i]) rest.push_back(i);
  }
  if (rest.empty()) return out;
  if (!retry_double_precision || stack.scalar_type() == at::kDouble) {
    for (const auto i : rest) out.failed[i] = true;
    return out;
  }
  // All together, by divide and conquer: a different algorithm from a failed batched Jacobi, and
  // a matrix's float64 result does not depend on which others failed with it.
  out.retried = static_cast<int64_t>(rest.size());
  const auto index = at::tensor(rest, at::TensorOptions().dtype(at::kLong)).to(stack.device());
  const auto in_double = stack.index_select(0, index).to(at::kDouble);
  const auto retry = launch(
      in_double, rest.size() > 1 ? CudaEighMethod::kConcurrent : CudaEighMethod::kSequential);
  const auto retry_ok = usable_decompositions(in_double, retry);
  for (size_t k = 0; k < rest.size(); ++k) {
    const auto i = rest[k];
    if (!retry_ok[k]) {
      out.failed[i] = true;
      continue;
    }
    out.in_double[i] = true;
    out.eigenvalues_double[i] = retry.eigenvalues[static_cast<int64_t>(k)];
    out.eigenvectors_double[i] = retry.eigenvectors[static_cast<int64_t>(k)];
  }
  return out;
}

}  // namespace shampoo::detail
