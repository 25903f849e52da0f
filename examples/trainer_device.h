#pragma once
/// The device the trainer runs on (--device auto|cpu|cuda), resolved against the CUDA devices of
/// this machine: one GPU per rank under torchrun (GPU LOCAL_RANK of the node).

#include <c10/core/Device.h>

#include <cstdint>
#include <string>

#include "examples/trainer_config.h"

namespace shampoo::examples {

/// What LibTorch reports about CUDA on this machine.
struct CudaInfo {
  bool available = false;    ///< torch::cuda::is_available()
  int64_t device_count = 0;  ///< torch::cuda::device_count()
};

/// This machine's CUDA devices, as LibTorch sees them.
CudaInfo query_cuda();

/// The device of the process with LOCAL_RANK `local_rank` (0 outside torchrun): `kCuda` is
/// cuda:local_rank, `kAuto` the same when CUDA is available and cpu otherwise, `kCpu` cpu. Throws
/// c10::Error naming --device, its value and what is allowed when CUDA is asked for and absent,
/// or when local_rank ≥ the number of CUDA devices (more ranks on the node than GPUs).
c10::Device resolve_device(DeviceChoice choice, int local_rank, const CudaInfo& cuda);

/// Makes `device` the current CUDA device of this process (NCCL communicators and CUDA
/// allocations of this rank go there); nothing for the CPU.
void make_current(c10::Device device);

/// "cpu" or "cuda:N", as written in the log and the metrics CSV.
std::string device_name(c10::Device device);

}  // namespace shampoo::examples
