#pragma once
/// CUDA kernel layer of the elementwise chain (no LibTorch): block tables and work items in
/// device memory, one launch per pass for all blocks of a virtual group. Per-element math is the
/// same inline code as the CPU path (update/elementwise_chain_kernels.h).

#include <cuda_runtime_api.h>

#include <cstdint>

#include "update/elementwise_chain_kernels.h"

namespace shampoo::kernels::cuda {

using shampoo::kernels::ChainWorkItem;

/// CUDA blocks per work item (each covers an equal part of the item): a step chunk's few hundred
/// items of kChainChunk elements fill an H100 (132 SMs) several times over only in parts.
inline constexpr int64_t kItemParts = 4;

/// Pre pass over every work item. `blocks` and `items` point to device memory.
template <typename T>
cudaError_t launch_chain_pre(const ChainBlock<T>* blocks, const ChainWorkItem* items,
                             int64_t num_items, cudaStream_t stream);

/// Norm pass: partials[2 * e] = Σ P², partials[2 * e + 1] = Σ P_graft² over part e % kItemParts
/// of work item e / kItemParts (device memory, double; 2 · kItemParts · num_items entries). The
/// caller combines the parts of a block in order.
template <typename T>
cudaError_t launch_chain_norms(const ChainBlock<T>* blocks, const ChainWorkItem* items,
                               int64_t num_items, double* partials, cudaStream_t stream);

/// ratios[b] = graft_ratio of the sums of parts [first_part[b], first_part[b + 1]) of
/// `partials`, added in order, for every block b with parts (others are left as they are). All
/// pointers to device memory; first_part has num_blocks + 1 entries.
cudaError_t launch_graft_ratios(const double* partials, const int64_t* first_part,
                                int64_t num_blocks, double* ratios, cudaStream_t stream);

/// Post pass over every work item.
template <typename T>
cudaError_t launch_chain_post(const ChainBlock<T>* blocks, const ChainWorkItem* items,
                              int64_t num_items, cudaStream_t stream);

}  // namespace shampoo::kernels::cuda
