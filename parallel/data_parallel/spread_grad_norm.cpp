#include "parallel/data_parallel/spread_grad_norm.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <cmath>

#include "parallel/communication/collectives.h"

namespace shampoo::detail {

double clip_spread_grad_norm_(c10d::ProcessGroup& group,
                              const std::vector<SpreadGradient>& gradients, double max_norm,
                              double norm_type, const char* who) {
  TORCH_CHECK(norm_type > 0.0, who, ": norm_type: got ", norm_type, ", expected > 0 or infinity");
  const bool inf_norm = std::isinf(norm_type);
  const auto n = static_cast<int64_t>(gradients.size());
  // Per parameter: its gradient's norm (on the rank that counts it) and 1 when it has a
  // gradient. Each entry has one non-zero contribution, so the all-reduced sum is exact and
  // every rank sees the norms one process would compute.
  auto local = at::zeros({2 * n}, at::TensorOptions().dtype(at::kDouble));
  at::NoGradGuard no_grad;
  for (int64_t i = 0; i < n; ++i) {
    const auto& grad = gradients[i].counted;
    if (!grad.defined()) continue;
    const auto norm = inf_norm ? grad.abs().max() : grad.norm(norm_type);
    local[i] = norm.to(at::kCPU, at::kDouble);
    local[n + i] = 1.0;
  }
  if (n > 0) {
    // Over the CPU backend: one small tensor (NCCL would need it on the GPU and gain nothing).
    std::vector<at::Tensor> tensors{local};
    start_all_reduce(group, tensors)->wait();
  }
  std::vector<at::Tensor> norms;
  std::vector<at::Tensor> held;
  const auto* values = local.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) {
    if (values[n + i] == 0.0) continue;
    // The norm in the gradient's dtype and on its device, as LibTorch computes it.
    norms.push_back(at::scalar_tensor(values[i], gradients[i].options.requires_grad(false)));
    if (gradients[i].held.defined()) held.push_back(gradients[i].held);
  }
  if (norms.empty()) return 0.0;
  at::Tensor total;
  if (inf_norm) {
    total = norms.size() == 1 ? norms[0] : at::max(at::stack(norms));
  } else {
    total = norms.size() == 1 ? norms[0] : at::stack(norms).norm(norm_type);
  }
  const auto coefficient = at::clamp(max_norm / (total + 1e-6), std::nullopt, 1.0);
  for (auto& grad : held) grad.mul_(coefficient.to(grad.device()));
  return total.item().toDouble();
}

}  // namespace shampoo::detail
