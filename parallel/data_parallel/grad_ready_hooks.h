#pragma once
/// Callbacks that run when a leaf tensor's gradient has been accumulated into .grad during
/// backward (autograd's post-accumulate-grad hook). Autograd keeps one such hook object per
/// tensor; this multiplexes it, so the gradient synchronizer and optimizer-in-backward can both
/// watch the same parameter.

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>

namespace shampoo::detail {

using GradReadyCallback = std::function<void(const at::Tensor& param)>;

/// Adds `callback` for `param` (a leaf that requires grad); callbacks run in the order added.
/// Returns a handle for remove_grad_ready_callback.
int64_t add_grad_ready_callback(const at::Tensor& param, GradReadyCallback callback);
void remove_grad_ready_callback(const at::Tensor& param, int64_t handle);

}  // namespace shampoo::detail
