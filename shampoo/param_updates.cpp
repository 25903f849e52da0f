#include "shampoo/param_updates.h"

#include "shampoo/step_scalars.h"
#include "shampoo/virtual_group.h"

namespace shampoo::detail {
namespace {

/// Views that a run can hold together: one storage, the same sizes, strides, dtype and device.
bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  return a.is_alias_of(b) && a.scalar_type() == b.scalar_type() && a.device() == b.device() &&
         a.sizes() == b.sizes() && a.strides() == b.strides();
}

/// The views first, first + spacing, ..., first + (count − 1)·spacing (elements) as one tensor.
at::Tensor run_view(const at::Tensor& first, int64_t count, int64_t spacing) {
  std::vector<int64_t> sizes{count};
  std::vector<int64_t> strides{spacing};
  sizes.insert(sizes.end(), first.sizes().begin(), first.sizes().end());
  strides.insert(strides.end(), first.strides().begin(), first.strides().end());
  return first.as_strided(sizes, strides, first.storage_offset());
}

}  // namespace

StridedRuns merge_strided_runs(const std::vector<at::Tensor>& to,
                               const std::vector<at::Tensor>& from) {
  TORCH_INTERNAL_ASSERT(to.size() == from.size());
  StridedRuns out;
  size_t i = 0;
  while (i < to.size()) {
    // Extend the run from pair i while the next pair lies one spacing further on both sides.
    size_t end = i + 1;
    int64_t to_spacing = 0, from_spacing = 0;
    while (end < to.size() && same_layout(to[i], to[end]) && same_layout(from[i], from[end])) {
      const int64_t dt = to[end].storage_offset() - to[end - 1].storage_offset();
      const int64_t df = from[end].storage_offset() - from[end - 1].storage_offset();
      if (dt <= 0 || df <= 0) break;
      if (end == i + 1) {
        to_spacing = dt;
        from_spacing = df;
      } else if (dt != to_spacing || df != from_spacing) {
        break;
      }
      ++end;
    }
    const auto count = static_cast<int64_t>(end - i);
    if (count == 1) {
      out.to.push_back(to[i]);
      out.from.push_back(from[i]);
    } else {
      out.to.push_back(run_view(to[i], count, to_spacing));
      out.from.push_back(run_view(from[i], count, from_spacing));
    }
    i = end;
  }
  return out;
}

void copy_in_runs(const std::vector<at::Tensor>& to, const std::vector<at::Tensor>& from) {
  const auto runs = merge_strided_runs(to, from);
  for (size_t i = 0; i < runs.to.size(); ++i) runs.to[i].copy_(runs.from[i]);
}

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
  if (!apply_to_.empty()) {
    // Column blocks of one matrix in one add (a non-contiguous view is one launch either way).
    const auto runs = merge_strided_runs(apply_to_, apply_from_);
    at::_foreach_add_(runs.to, runs.from);
  }
  copy_in_runs(cast_to_, cast_from_);
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
  if (!add_to.empty()) {
    const auto runs = merge_strided_runs(add_to, add_from);
    at::_foreach_add_(runs.to, runs.from);
  }
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
