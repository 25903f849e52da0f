#include "shampoo/param_updates.h"

#include "shampoo/step_scalars.h"
#include "shampoo/virtual_group.h"

namespace shampoo::detail {

void StepUpdates::route(int64_t block, const at::Tensor& param_view, const at::Tensor& staging,
                        ChainBlockTensors& c) {
  const bool distributed = distributor_.distributed();
  // The parameter is read only for weight decay and to write updated values; a copy only for a
  // block the chain cannot take where it lies (a column block of a matrix on CUDA).
  const bool takes_view = chain_takes_view(param_view);
  if (!distributed && takes_view) {
    c.param = param_view;
    c.param_out = param_view;
    return;
  }
  if (chain_reads_param(c.scalars)) c.param = takes_view ? param_view : param_view.contiguous();
  const auto buffer = [&] { return staging.defined() ? staging : at::empty_like(c.grad); };
  if (!distributed) {
    c.update_out = buffer();
    apply_to_.push_back(param_view);
    apply_from_.push_back(c.update_out.view(param_view.sizes()));
    return;
  }
  auto slot = distributor_.slot(block);
  if (slot.scalar_type() == param_view.scalar_type()) {
    c.update_out = slot;
  } else {
    c.update_out = buffer();
    cast_to_.push_back(slot);
    cast_from_.push_back(c.update_out.reshape(-1));
  }
  distributor_.mark_updated(block);
}

void StepUpdates::finish() {
  if (!apply_to_.empty()) at::_foreach_add_(apply_to_, apply_from_);
  for (size_t i = 0; i < cast_to_.size(); ++i) cast_to_[i].copy_(cast_from_[i]);
}

void apply_received(const Distributor& distributor, const std::vector<ParamEntry>& params,
                    const std::vector<BlockEntry>& blocks) {
  std::vector<at::Tensor> add_to, add_from;
  std::vector<std::vector<at::Tensor>> views(params.size());
  std::vector<at::Tensor> work(params.size());  // what the views are of (write_back)
  for (int64_t b = 0; b < static_cast<int64_t>(blocks.size()); ++b) {
    if (!distributor.received_updated(b)) continue;
    const auto& block = blocks[b];
    auto& param_views = views[block.param];
    if (param_views.empty()) {
      work[block.param] = work_tensor(params[block.param].param);
      param_views = block_views(work[block.param], params[block.param].plan);
    }
    auto view = param_views[block.id.block];
    auto received = distributor.received(b).view(view.sizes());
    if (distributor.communicate_params()) {
      view.copy_(received);
    } else {
      add_to.push_back(view);
      add_from.push_back(received.scalar_type() == view.scalar_type()
                             ? received
                             : received.to(view.scalar_type()));
    }
  }
  if (!add_to.empty()) at::_foreach_add_(add_to, add_from);
  for (size_t p = 0; p < params.size(); ++p) {
    if (work[p].defined()) write_back(params[p].param, work[p]);
  }
}

void restore_params(const std::vector<std::pair<at::Tensor, at::Tensor>>& saved) {
  for (const auto& [param, copy] : saved) {
    // A parameter whose storage full sharding released since the step (its owner sent the
    // stepped rows to every rank) is not written: the wrapper puts back the rows itself.
    if (param.sizes() != copy.sizes()) continue;
    param.copy_(copy);
  }
}

}  // namespace shampoo::detail
