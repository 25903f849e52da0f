#include "update/cuda/elementwise_chain_cuda.h"

namespace shampoo::kernels::cuda {
namespace {

constexpr int kThreads = 256;

/// The elements [begin, end) of a work item that CUDA block `blockIdx.x` covers: its part
/// blockIdx.x % kItemParts of item blockIdx.x / kItemParts (parts of equal length but the last).
struct PartRange {
  int64_t begin;
  int64_t end;
};

__device__ __forceinline__ PartRange part_range(const ChainWorkItem& item) {
  const int64_t part = blockIdx.x % kItemParts;
  const int64_t length = (item.end - item.begin + kItemParts - 1) / kItemParts;
  const int64_t begin = item.begin + part * length;
  return {begin, begin + length < item.end ? begin + length : item.end};
}

/// The pre (kPost false) or post pass: kItemParts CUDA blocks per work item.
template <typename T, bool kPost>
__global__ void chain_pass_kernel(const ChainBlock<T>* blocks, const ChainWorkItem* items) {
  const ChainWorkItem item = items[blockIdx.x / kItemParts];
  ChainBlock<T> b = blocks[item.block];
  if constexpr (kPost) {
    if (b.graft_ratio_device != nullptr) b.s.graft_ratio = *b.graft_ratio_device;
  }
  const PartRange range = part_range(item);
  for (int64_t i = range.begin + threadIdx.x; i < range.end; i += blockDim.x) {
    if constexpr (kPost) {
      chain_post_element(b, i);
    } else {
      chain_pre_element(b, i);
    }
  }
}

/// kItemParts CUDA blocks per work item, each a fixed-shape tree reduction of its part, so the
/// partials depend only on the items, not on the launch.
template <typename T>
__global__ void chain_norms_kernel(const ChainBlock<T>* blocks, const ChainWorkItem* items,
                                   double* partials) {
  __shared__ double p_shared[kThreads];
  __shared__ double g_shared[kThreads];
  const ChainWorkItem item = items[blockIdx.x / kItemParts];
  const ChainBlock<T> b = blocks[item.block];
  const PartRange range = part_range(item);
  double p_sq = 0.0, g_sq = 0.0;
  for (int64_t i = range.begin + threadIdx.x; i < range.end; i += blockDim.x) {
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

/// One thread per block of the chain: its partials summed in order, as the host sums them, then
/// the grafting ratio. Blocks without partials (first_part[b] == first_part[b + 1]) are skipped.
__global__ void graft_ratio_kernel(const double* partials, const int64_t* first_part,
                                   int64_t num_blocks, double* ratios) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= num_blocks || first_part[b] == first_part[b + 1]) return;
  // Loads kAhead parts ahead (independent loads in flight), then adds them in order.
  constexpr int kAhead = 8;
  double p_sq = 0.0, g_sq = 0.0;
  int64_t e = first_part[b];
  const int64_t end = first_part[b + 1];
  for (; e + kAhead <= end; e += kAhead) {
    double p[kAhead], g[kAhead];
#pragma unroll
    for (int k = 0; k < kAhead; ++k) {
      p[k] = partials[2 * (e + k)];
      g[k] = partials[2 * (e + k) + 1];
    }
#pragma unroll
    for (int k = 0; k < kAhead; ++k) {
      p_sq += p[k];
      g_sq += g[k];
    }
  }
  for (; e < end; ++e) {
    p_sq += partials[2 * e];
    g_sq += partials[2 * e + 1];
  }
  ratios[b] = graft_ratio(p_sq, g_sq);
}

cudaError_t check_grid(int64_t num_items) {
  // kItemParts CUDA blocks per work item; the grid's x dimension allows 2^31 - 1 blocks.
  return num_items > 2147483647LL / kItemParts ? cudaErrorInvalidConfiguration : cudaSuccess;
}

template <typename T, bool kPost>
cudaError_t launch_chain_pass(const ChainBlock<T>* blocks, const ChainWorkItem* items,
                              int64_t num_items, cudaStream_t stream) {
  if (num_items == 0) return cudaSuccess;
  if (auto e = check_grid(num_items); e != cudaSuccess) return e;
  chain_pass_kernel<T, kPost>
      <<<static_cast<unsigned>(num_items * kItemParts), kThreads, 0, stream>>>(blocks, items);
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
  chain_norms_kernel<T><<<static_cast<unsigned>(num_items * kItemParts), kThreads, 0, stream>>>(
      blocks, items, partials);
  return cudaGetLastError();
}

cudaError_t launch_graft_ratios(const double* partials, const int64_t* first_part,
                                int64_t num_blocks, double* ratios, cudaStream_t stream) {
  if (num_blocks == 0) return cudaSuccess;
  const int64_t grid = (num_blocks + kThreads - 1) / kThreads;
  if (grid > 2147483647LL) return cudaErrorInvalidConfiguration;
  graft_ratio_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(partials, first_part,
                                                                           num_blocks, ratios);
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
