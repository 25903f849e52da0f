#include "parallel/data_parallel/backward_pass.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

namespace shampoo::detail {

bool BackwardPass::abandoned() const {
  return open_ && torch::autograd::get_current_graph_task_id() != task_;
}

bool BackwardPass::open(const std::function<void()>& at_end, bool may_step) {
  const int task = torch::autograd::get_current_graph_task_id();
  if (open_ && task == task_) return false;
  open_ = true;
  task_ = task;
  stepping_ = may_step && next_steps();
  torch::autograd::Engine::get_default_engine().queue_callback(at_end);
  return true;
}

void BackwardPass::end() {
  open_ = false;
  stepping_ = false;
  ++passes_;
  ++since_step_;
}

}  // namespace shampoo::detail
