#include "support/device_parity.h"

#include <gtest/gtest.h>
#include <shampoo/shampoo.h>

namespace shampoo::testing {

void expect_cuda_matches_cpu(const std::vector<at::Tensor>& params, const ShampooOptions& options,
                             int steps, const GradientSetter& set_grads, Tolerance tolerance,
                             const std::string& name) {
  std::vector<at::Tensor> cpu, gpu;
  for (const auto& p : params) {
    cpu.push_back(p.detach().clone().requires_grad_());
    gpu.push_back(p.detach().to(at::kCUDA).requires_grad_());
  }
  DistributedShampoo on_cpu(cpu, options);
  DistributedShampoo on_gpu(gpu, options);
  for (int t = 1; t <= steps; ++t) {
    set_grads(cpu, t);
    for (size_t i = 0; i < gpu.size(); ++i) gpu[i].mutable_grad() = cpu[i].grad().to(at::kCUDA);
    on_cpu.step();
    on_gpu.step();
    for (size_t i = 0; i < cpu.size(); ++i) {
      ASSERT_TRUE(all_close(gpu[i].detach().cpu(), cpu[i].detach(), tolerance))
          << name << " step " << t << " parameter " << i;
    }
  }
}

}  // namespace shampoo::testing
