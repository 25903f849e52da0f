#include "parallel/data_parallel/grad_ready_hooks.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <atomic>
#include <utility>
#include <vector>

namespace shampoo::detail {
namespace {

std::atomic<int64_t> next_handle{1};

class MultiplexedHook final : public torch::autograd::PostAccumulateGradHook {
 public:
  void operator()(const torch::autograd::Variable& tensor) override {
    // Copy: a callback may remove itself.
    const auto callbacks = callbacks_;
    for (const auto& [handle, callback] : callbacks) callback(tensor);
  }
  std::vector<std::pair<int64_t, GradReadyCallback>> callbacks_;
};

}  // namespace

int64_t add_grad_ready_callback(const at::Tensor& param, GradReadyCallback callback) {
  TORCH_CHECK(param.defined() && param.is_leaf() && param.requires_grad(),
              "gradient hooks need a leaf tensor that requires grad");
  auto& slot = torch::autograd::impl::post_acc_grad_hooks(param);
  if (!slot) {
    torch::autograd::impl::set_post_acc_grad_hooks(param, std::make_unique<MultiplexedHook>());
  }
  auto* hook =
      dynamic_cast<MultiplexedHook*>(torch::autograd::impl::post_acc_grad_hooks(param).get());
  TORCH_CHECK(hook != nullptr,
              "this tensor already has a post-accumulate-grad hook of another "
              "kind (a Python hook?); DistributedShampoo cannot add its own");
  const int64_t handle = next_handle++;
  hook->callbacks_.emplace_back(handle, std::move(callback));
  return handle;
}

void remove_grad_ready_callback(const at::Tensor& param, int64_t handle) {
  auto* hook =
      dynamic_cast<MultiplexedHook*>(torch::autograd::impl::post_acc_grad_hooks(param).get());
  if (hook == nullptr) return;
  auto& callbacks = hook->callbacks_;
  for (auto it = callbacks.begin(); it != callbacks.end(); ++it) {
    if (it->first == handle) {
      callbacks.erase(it);
      return;
    }
  }
}

}  // namespace shampoo::detail
