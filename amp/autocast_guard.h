#pragma once
/// Automatic mixed precision for C++ forward passes: the RAII counterpart of Python's
/// `torch.autocast(device_type, dtype)` (LibTorch has none). While the guard lives, ops that
/// autocast lists (matmuls, convolutions, ...) on `device` run in `dtype` (bf16 or fp16), the
/// others in float32, as in Python.
///
///   {
///     shampoo::AutocastGuard autocast(at::kCUDA, at::kHalf);
///     loss = loss_fn(model->forward(x), y);   // forward in fp16 where safe
///   }
///   scaler.scale(loss).backward();            // backward outside the guard, as in Python
///
/// Guards nest; each restores the enabled flag and dtype that were in force before it, and the
/// outermost one clears autocast's cache of cast weights when it ends. Thread-local, like
/// autocast itself.

#include <ATen/ATen.h>

namespace shampoo {

class AutocastGuard {
 public:
  /// `device`: CPU or CUDA. `dtype`: BFloat16 or Half (Half on the CPU needs a torch that
  /// supports it; 2.11 does). `enabled` false: a guard that changes nothing (one code path for
  /// --amp off and on).
  AutocastGuard(at::DeviceType device, at::ScalarType dtype, bool enabled = true);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  at::DeviceType device_;
  bool active_;
  bool previous_enabled_ = false;
  at::ScalarType previous_dtype_ = at::kFloat;
};

}  // namespace shampoo
