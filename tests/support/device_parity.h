#pragma once
/// CUDA ≡ CPU for an optimizer setting: the same run on both devices, compared after every step.

#include <ATen/ATen.h>

#include <functional>
#include <string>
#include <vector>

#include "shampoo/shampoo_options.h"
#include "support/test_support.h"

namespace shampoo::testing {

/// Sets the gradients of the CPU parameters for step t (1-based).
using GradientSetter = std::function<void(const std::vector<at::Tensor>& params, int t)>;

/// Copies of `params` (float32, on the CPU) on the GPU, one DistributedShampoo with `options` on
/// each, `steps` steps with the gradients `set_grads` gives the CPU side (copied to the GPU); after
/// every step every parameter within `tolerance` (a gtest failure naming `name`, the step and the
/// parameter). Call only when a GPU is available (the test skips itself otherwise).
void expect_cuda_matches_cpu(const std::vector<at::Tensor>& params, const ShampooOptions& options,
                             int steps, const GradientSetter& set_grads, Tolerance tolerance,
                             const std::string& name);

}  // namespace shampoo::testing
