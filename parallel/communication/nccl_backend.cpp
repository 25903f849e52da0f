// The NCCL backend of c10d, for CUDA tensors. Compiled against the CUDA toolkit's nccl.h, which
// must be the NCCL version LibTorch was built with (2.28 for torch 2.11); like gloo_backend.cpp
// it only calls ProcessGroupNCCL's out-of-line constructor and keeps the result as a Backend.
#include <c10/util/Exception.h>

#include "parallel/communication/process_group.h"
#include "shampoo/config.h"

#if SHAMPOO_WITH_CUDA
#define USE_C10D_NCCL 1
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace shampoo::detail {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout) {
#if SHAMPOO_WITH_CUDA
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
#else
  TORCH_CHECK(false,
              "NCCL process group requested, but DistributedShampoo was built without "
              "CUDA (SHAMPOO_ENABLE_CUDA)");
#endif
}

}  // namespace shampoo::detail
