#include "parallel/optimizers/loss_scaling.h"

#include <c10/util/Exception.h>

namespace shampoo {
namespace {

[[noreturn]] void unsupported(const char* caller, const char* what) {
  TORCH_CHECK(false, caller, ": this wrapper does not support ", what,
              " with a gradient scaler (see its documentation for the scaler calls it takes)");
}

}  // namespace

std::vector<at::Tensor> ScaledStepping::gradients_to_unscale(const char* caller) {
  unsupported(caller, "unscaling its gradients after backward");
}

void ScaledStepping::scaled_step() { unsupported("GradScaler::step", "a scaled step"); }

void ScaledStepping::skip_scaled_step() { unsupported("GradScaler::step", "a skipped step"); }

void ScaledStepping::unscaled_step() { unsupported("GradScaler::step", "a step"); }

void ScaledStepping::set_backward_unscaler(BackwardUnscaler* /*unscaler*/) {
  unsupported("GradScaler::attach", "unscaling in backward");
}

}  // namespace shampoo
