#include "update/cuda/chain_launch.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstring>

#include "update/cuda/elementwise_chain_cuda.h"

namespace shampoo::detail {
namespace {

at::Tensor to_device_bytes(const void* data, size_t bytes, const at::Device& device) {
  auto host = at::empty({static_cast<int64_t>(bytes)},
                        at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), data, bytes);
  return host.to(device, /*non_blocking=*/true);
}

/// The block table and the work items in device memory.
template <typename T>
struct DeviceTables {
  DeviceTables(const std::vector<kernels::ChainBlock<T>>& kblocks,
               const std::vector<kernels::ChainWorkItem>& work, const at::Device& device)
      : block_bytes(to_device_bytes(kblocks.data(), kblocks.size() * sizeof(kblocks[0]), device)),
        item_bytes(to_device_bytes(work.data(), work.size() * sizeof(work[0]), device)),
        num_items(static_cast<int64_t>(work.size())) {}

  const kernels::ChainBlock<T>* blocks() const {
    return reinterpret_cast<const kernels::ChainBlock<T>*>(block_bytes.data_ptr());
  }
  const kernels::ChainWorkItem* items() const {
    return reinterpret_cast<const kernels::ChainWorkItem*>(item_bytes.data_ptr());
  }

  at::Tensor block_bytes;
  at::Tensor item_bytes;
  int64_t num_items;
};

}  // namespace

template <typename T>
void launch_chain_pass_cuda(bool pre, const std::vector<kernels::ChainBlock<T>>& blocks,
                            const std::vector<kernels::ChainWorkItem>& items,
                            const at::Device& device) {
  const c10::cuda::CUDAGuard guard(device);
  const DeviceTables<T> tables(blocks, items, device);
  const auto launch =
      pre ? kernels::cuda::launch_chain_pre<T> : kernels::cuda::launch_chain_post<T>;
  C10_CUDA_CHECK(
      launch(tables.blocks(), tables.items(), tables.num_items, c10::cuda::getCurrentCUDAStream()));
}

namespace {

/// The norm pass into device memory: 2 · kItemParts · num_items partials (see launch_chain_norms).
template <typename T>
at::Tensor norm_partials_on_device(const DeviceTables<T>& tables, const at::Device& device) {
  at::Tensor partials = at::empty({2 * kernels::cuda::kItemParts * tables.num_items},
                                  at::TensorOptions().dtype(at::kDouble).device(device));
  C10_CUDA_CHECK(kernels::cuda::launch_chain_norms(tables.blocks(), tables.items(),
                                                   tables.num_items, partials.data_ptr<double>(),
                                                   c10::cuda::getCurrentCUDAStream()));
  return partials;
}

}  // namespace

template <typename T>
std::vector<double> launch_chain_norms_cuda(const std::vector<kernels::ChainBlock<T>>& blocks,
                                            const std::vector<kernels::ChainWorkItem>& items,
                                            const at::Device& device) {
  const c10::cuda::CUDAGuard guard(device);
  const DeviceTables<T> tables(blocks, items, device);
  const at::Tensor host = norm_partials_on_device(tables, device).cpu();
  const double* data = host.data_ptr<double>();
  return std::vector<double>(data, data + host.numel());
}

template <typename T>
at::Tensor launch_graft_ratios_cuda(const std::vector<kernels::ChainBlock<T>>& blocks,
                                    const std::vector<kernels::ChainWorkItem>& items,
                                    const at::Device& device) {
  const c10::cuda::CUDAGuard guard(device);
  const auto num_blocks = static_cast<int64_t>(blocks.size());
  // Each block's parts, in order: items come in block order.
  std::vector<int64_t> first_part(blocks.size() + 1, 0);
  for (size_t j = 0; j < items.size(); ++j) {
    TORCH_INTERNAL_ASSERT(j == 0 || items[j].block >= items[j - 1].block,
                          "chain norms: work items out of block order");
    first_part[static_cast<size_t>(items[j].block) + 1] += kernels::cuda::kItemParts;
  }
  for (size_t b = 0; b < blocks.size(); ++b) first_part[b + 1] += first_part[b];
  const DeviceTables<T> tables(blocks, items, device);
  const at::Tensor partials = norm_partials_on_device(tables, device);
  const auto first =
      to_device_bytes(first_part.data(), first_part.size() * sizeof(int64_t), device);
  // Blocks without parts keep 1, the ratio of a block that is not grafted.
  auto ratios = at::ones({num_blocks}, at::TensorOptions().dtype(at::kDouble).device(device));
  C10_CUDA_CHECK(kernels::cuda::launch_graft_ratios(
      partials.data_ptr<double>(), reinterpret_cast<const int64_t*>(first.data_ptr()), num_blocks,
      ratios.data_ptr<double>(), c10::cuda::getCurrentCUDAStream()));
  return ratios;
}

#define SHAMPOO_INSTANTIATE_CHAIN_LAUNCH(T)                                                   \
  template void launch_chain_pass_cuda<T>(bool, const std::vector<kernels::ChainBlock<T>>&,   \
                                          const std::vector<kernels::ChainWorkItem>&,         \
                                          const at::Device&);                                 \
  template std::vector<double> launch_chain_norms_cuda<T>(                                    \
      const std::vector<kernels::ChainBlock<T>>&, const std::vector<kernels::ChainWorkItem>&, \
      const at::Device&);                                                                     \
  template at::Tensor launch_graft_ratios_cuda<T>(const std::vector<kernels::ChainBlock<T>>&, \
                                                  const std::vector<kernels::ChainWorkItem>&, \
                                                  const at::Device&);
SHAMPOO_INSTANTIATE_CHAIN_LAUNCH(float)
SHAMPOO_INSTANTIATE_CHAIN_LAUNCH(double)
#undef SHAMPOO_INSTANTIATE_CHAIN_LAUNCH

}  // namespace shampoo::detail
