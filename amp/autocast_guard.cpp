#include "amp/autocast_guard.h"

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>

namespace shampoo {

AutocastGuard::AutocastGuard(at::DeviceType device, at::ScalarType dtype, bool enabled)
    : device_(device), active_(enabled) {
  if (!active_) return;
  TORCH_CHECK(device == at::kCPU || device == at::kCUDA, "AutocastGuard: device: got ", device,
              ", expected CPU or CUDA");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "AutocastGuard: dtype: got ", dtype,
              ", expected BFloat16 or Half");
  previous_enabled_ = at::autocast::is_autocast_enabled(device_);
  previous_dtype_ = at::autocast::get_autocast_dtype(device_);
  at::autocast::set_autocast_enabled(device_, true);
  at::autocast::set_autocast_dtype(device_, dtype);
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  if (!active_) return;
  // As Python's autocast.__exit__: the cache of cast weights lives for the outermost region.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_, previous_enabled_);
  at::autocast::set_autocast_dtype(device_, previous_dtype_);
}

}  // namespace shampoo
