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

template <typename T>
std::vector<double> launch_chain_norms_cuda(const std::vector<kernels::ChainBlock<T>>& blocks,
                                            const std::vector<kernels::ChainWorkItem>& items,
                                            const at::Device& device) {
  const c10::cuda::CUDAGuard guard(device);
  const DeviceTables<T> tables(blocks, items, device);
  at::Tensor partials =
      at::empty({2 * tables.num_items}, at::TensorOptions().dtype(at::kDouble).device(device));
  C10_CUDA_CHECK(kernels::cuda::launch_chain_norms(tables.blocks(), tables.items(),
                                                   tables.num_items, partials.data_ptr<double>(),
                                                   c10::cuda::getCurrentCUDAStream()));
  const at::Tensor host = partials.cpu();
  const double* data = host.data_ptr<double>();
  return std::vector<double>(data, data + 2 * tables.num_items);
}

#define SHAMPOO_INSTANTIATE_CHAIN_LAUNCH(T)                                                   \
  template void launch_chain_pass_cuda<T>(bool, const std::vector<kernels::ChainBlock<T>>&,   \
                                          const std::vector<kernels::ChainWorkItem>&,         \
                                          const at::Device&);                                 \
  template std::vector<double> launch_chain_norms_cuda<T>(                                    \
      const std::vector<kernels::ChainBlock<T>>&, const std::vector<kernels::ChainWorkItem>&, \
      const at::Device&);
SHAMPOO_INSTANTIATE_CHAIN_LAUNCH(float)
SHAMPOO_INSTANTIATE_CHAIN_LAUNCH(double)
#undef SHAMPOO_INSTANTIATE_CHAIN_LAUNCH

}  // namespace shampoo::detail
