#include "update/cuda/elementwise_chain_cuda.h"

namespace shampoo::kernels::cuda {
namespace {

constexpr int kThreads = 256;

/// The pre (kPost false) or post pass: one CUDA block per work item.
template <typename T, bool kPost>
__global__ void chain_pass_kernel(const ChainBlock<T>* blocks, const ChainWorkItem* items) {
  const ChainWorkItem item = items[blockIdx.x];
  const ChainBlock<T> b = blocks[item.block];
  for (int64_t i = item.begin + threadIdx.x; i < item.end; i += blockDim.x) {
    if constexpr (kPost) {
      chain_post_element(b, i);
    } else {
      chain_pre_element(b, i);
    }
  }
}

/// One CUDA block per work item; a fixed-shape tree reduction, so the result depends only on
/// the item, not on the launch.
template <typename T>
__global__ void chain_norms_kernel(const ChainBlock<T>* blocks, const ChainWorkItem* items,
                                   double* partials) {
  __shared__ double p_shared[kThreads];
  __shared__ double g_shared[kThreads];
  const ChainWorkItem item = items[blockIdx.x];
  const ChainBlock<T> b = blocks[item.block];
  double p_sq = 0.0, g_sq = 0.0;
  for (int64_t i = item.begin + threadIdx.x; i < item.end; i += blockDim.x) {
    chain_norm_element(b, i, p_sq, g_sq);
  }
  p_shared[threadIdx.x] = p_sq;
  g_shared[threadIdx.x] = g_sq;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      p_shared[threadIdx.x] += p_shared[threadIdx.x + stride];
      g_shared[threadIdx.x] += g_shared[threadIdx.x + stride];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    partials[2 * blockIdx.x] = p_shared[0];
    partials[2 * blockIdx.x + 1] = g_shared[0];
  }
}

cudaError_t check_grid(int64_t num_items) {
  // One CUDA block per work item; the grid's x dimension allows 2^31 - 1 blocks.
  return num_items > 2147483647LL ? cudaErrorInvalidConfiguration : cudaSuccess;
}

template <typename T, bool kPost>
cudaError_t launch_chain_pass(const ChainBlock<T>* blocks, const ChainWorkItem* items,
                              int64_t num_items, cudaStream_t stream) {
  if (num_items == 0) return cudaSuccess;
  if (auto e = check_grid(num_items); e != cudaSuccess) return e;
  chain_pass_kernel<T, kPost>
      <<<static_cast<unsigned>(num_items), kThreads, 0, stream>>>(blocks, items);
  return cudaGetLastError();
}

}  // namespace

template <typename T>
cudaError_t launch_chain_pre(const ChainBlock<T>* blocks, const ChainWorkItem* items,
                             int64_t num_items, cudaStream_t stream) {
  return launch_chain_pass<T, false>(blocks, items, num_items, stream);
}

template <typename T>
cudaError_t launch_chain_norms(const ChainBlock<T>* blocks, const ChainWorkItem* items,
                               int64_t num_items, double* partials, cudaStream_t stream) {
  if (num_items == 0) return cudaSuccess;
  if (auto e = check_grid(num_items); e != cudaSuccess) return e;
  chain_norms_kernel<T>
      <<<static_cast<unsigned>(num_items), kThreads, 0, stream>>>(blocks, items, partials);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_chain_post(const ChainBlock<T>* blocks, const ChainWorkItem* items,
                              int64_t num_items, cudaStream_t stream) {
  return launch_chain_pass<T, true>(blocks, items, num_items, stream);
}

#define SHAMPOO_INSTANTIATE(T)                                                                    \
  template cudaError_t launch_chain_pre<T>(const ChainBlock<T>*, const ChainWorkItem*, int64_t,   \
                                           cudaStream_t);                                         \
  template cudaError_t launch_chain_norms<T>(const ChainBlock<T>*, const ChainWorkItem*, int64_t, \
                                             double*, cudaStream_t);                              \
  template cudaError_t launch_chain_post<T>(const ChainBlock<T>*, const ChainWorkItem*, int64_t,  \
                                            cudaStream_t);
SHAMPOO_INSTANTIATE(float)
SHAMPOO_INSTANTIATE(double)
#undef SHAMPOO_INSTANTIATE

}  // namespace shampoo::kernels::cuda
