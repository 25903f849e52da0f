#pragma once
/// Gradient clipping by global norm when the gradients are spread over the ranks of a process
/// group (gradient sharding, full sharding): the result of torch::nn::utils::clip_grad_norm_ on
/// the full gradients, bit for bit.

#include <ATen/ATen.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

namespace shampoo::detail {

/// One parameter's part in a clipping spread over ranks.
struct SpreadGradient {
  /// Its gradient on the one rank that counts its norm (undefined on the others, and where it
  /// has no gradient).
  at::Tensor counted;
  /// Its gradient where this rank holds a copy to scale (undefined elsewhere).
  at::Tensor held;
  /// The parameter's dtype and device: the norm's, as LibTorch computes it.
  at::TensorOptions options;
};

/// Every rank computes the norms of the gradients it counts; one all-reduce (over the group's CPU
/// backend) of the per-parameter norms gives every rank the norms one process would compute, and
/// each rank scales what it holds by min(1, max_norm / (total + 1e-6)). Returns the total norm
/// (0 when no parameter has a gradient). `norm_type` > 0 or infinity; errors start with `who`.
/// Collective: every rank passes the parameters in the same order.
double clip_spread_grad_norm_(c10d::ProcessGroup& group,
                              const std::vector<SpreadGradient>& gradients, double max_norm,
                              double norm_type, const char* who);

}  // namespace shampoo::detail
