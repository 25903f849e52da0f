#pragma once
/// CUDA kernel layer of the elementwise chain (no LibTorch): block tables and work items in
/// device memory, one launch per pass for all blocks of a virtual group. Per-element math is the
/// same inline code as the CPU path (update/elementwise_chain_kernels.h).

#include <cuda_runtime_api.h>

#include <cstdint>

#include "update/elementwise_chain_kernels.h"

namespace shampoo::kernels::cuda {

using shampoo::kernels::ChainWorkItem;

/// Pre pass over every work item. `blocks` and `items` point to device memory.
template <typename T>
cudaError_t launch_chain_pre(const ChainBlock<T>* blocks, const ChainWorkItem* items,
                             int64_t num_items, cudaStream_t stream);

/// Norm pass: partials[2 * i] = Σ P², partials[2 * i + 1] = Σ P_graft² over work item i (device
/// memory, double). The caller combines the items of a block in order.
template <typename T>
cudaError_t launch_chain_norms(const ChainBlock<T>* blocks, const ChainWorkItem* items,
                               int64_t num_items, double* partials, cudaStream_t stream);

/// Post pass over every work item.
template <typename T>
cudaError_t launch_chain_post(const ChainBlock<T>* blocks, const ChainWorkItem* items,
                              int64_t num_items, cudaStream_t stream);

}  // namespace shampoo::kernels::cuda
