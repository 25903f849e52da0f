#include "examples/trainer_device.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>

namespace shampoo::examples {

CudaInfo query_cuda() {
  CudaInfo info;
  info.available = torch::cuda::is_available();
  info.device_count = info.available ? static_cast<int64_t>(torch::cuda::device_count()) : 0;
  return info;
}

c10::Device resolve_device(DeviceChoice choice, int local_rank, const CudaInfo& cuda) {
  if (choice == DeviceChoice::kCpu || (choice == DeviceChoice::kAuto && !cuda.available)) {
    return c10::Device(c10::kCPU);
  }
  const std::string flag = "--device " + device_choice_name(choice);
  TORCH_CHECK(cuda.available, flag,
              ": no CUDA device is available (torch::cuda::is_available() is false); use "
              "--device cpu or auto");
  TORCH_CHECK(local_rank >= 0 && local_rank < cuda.device_count, flag, ": LOCAL_RANK ", local_rank,
              " needs CUDA device ", local_rank, ", but this node has ", cuda.device_count, " (0..",
              cuda.device_count - 1,
              "); start at most that many ranks per node (torchrun --nproc-per-node ",
              cuda.device_count, ") or use --device cpu");
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
}

void make_current(c10::Device device) {
  if (!device.is_cuda()) return;
  // Through c10's device-guard registry: no CUDA header in the examples, which also build
  // against a CPU-only LibTorch.
  c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(device);
}

std::string device_name(c10::Device device) { return device.str(); }

}  // namespace shampoo::examples
