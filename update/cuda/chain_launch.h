#pragma once
/// CUDA side of the elementwise chain's launcher (update/elementwise_chain.cpp): copies the block
/// table and the work items to the device (pinned staging, asynchronous on the current stream),
/// launches one kernel per pass and converts launch errors into c10::Error. Defined only in
/// builds with CUDA (SHAMPOO_WITH_CUDA).

#include <ATen/ATen.h>

#include <vector>

#include "update/elementwise_chain_kernels.h"

namespace shampoo::detail {

/// The pre pass (`pre`) or the post pass over `items` of `blocks`, on `device`.
template <typename T>
void launch_chain_pass_cuda(bool pre, const std::vector<kernels::ChainBlock<T>>& blocks,
                            const std::vector<kernels::ChainWorkItem>& items,
                            const at::Device& device);

/// The norm pass over `items`, on the host: {Σ P², Σ P_graft²} per part of an item, the parts of
/// item j at [j · parts, (j + 1) · parts) with parts = size / (2 · items.size()).
template <typename T>
std::vector<double> launch_chain_norms_cuda(const std::vector<kernels::ChainBlock<T>>& blocks,
                                            const std::vector<kernels::ChainWorkItem>& items,
                                            const at::Device& device);

/// The norm pass and the grafting ratios without leaving the device: a double tensor of
/// blocks.size() ratios on `device`, the ratio of every block with items (`items` in block order),
/// 1 for the others; each the bits of the host's graft_ratio of the same partials summed in order.
template <typename T>
at::Tensor launch_graft_ratios_cuda(const std::vector<kernels::ChainBlock<T>>& blocks,
                                    const std::vector<kernels::ChainWorkItem>& items,
                                    const at::Device& device);

}  // namespace shampoo::detail
