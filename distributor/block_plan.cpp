#include "distributor/block_plan.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>

namespace shampoo {

std::string BlockId::to_string() const { return c10::str("parameter ", param, " block ", block); }

std::string BlockId::key() const { return c10::str("p", param, "_b", block); }

}  // namespace shampoo

namespace shampoo::detail {

std::vector<int64_t> merge_small_dims(at::IntArrayRef shape, int64_t max_dim, bool merge,
                                      int64_t target_order) {
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return {0};
  std::vector<int64_t> squeezed;
  for (const int64_t d : shape) {
    if (d != 1) squeezed.push_back(d);
  }
  if (squeezed.empty()) return {1};
  if (!merge) return squeezed;
  // Walk from the last dim to the first, growing the front of `merged`.
  std::vector<int64_t> merged{squeezed.back()};
  for (int64_t i = static_cast<int64_t>(squeezed.size()) - 2; i >= 0; --i) {
    const int64_t dims_if_kept = static_cast<int64_t>(merged.size()) + i + 1;
    const int64_t product = merged.front() * squeezed[i];
    if (product <= max_dim && dims_if_kept > target_order) {
      merged.front() = product;
    } else {
      merged.insert(merged.begin(), squeezed[i]);
    }
  }
  return merged;
}

std::vector<int64_t> split_dim(int64_t size, int64_t max_dim) {
  TORCH_INTERNAL_ASSERT(max_dim >= 1);
  std::vector<int64_t> chunks;
  for (int64_t begin = 0; begin < size; begin += max_dim) {
    chunks.push_back(std::min(max_dim, size - begin));
  }
  return chunks;
}

int64_t BlockPlan::numel() const {
  int64_t n = 1;
  for (const int64_t d : param_shape) n *= d;
  return n;
}

BlockPlan make_block_plan(at::IntArrayRef shape, int64_t max_preconditioner_dim,
                          bool use_merge_dims, int64_t target_order) {
  BlockPlan plan;
  plan.param_shape = shape.vec();
  plan.merged_shape = merge_small_dims(shape, max_preconditioner_dim, use_merge_dims, target_order);
  if (plan.numel() == 0) return plan;
  const auto order = plan.merged_shape.size();
  std::vector<std::vector<int64_t>> chunks(order);
  for (size_t k = 0; k < order; ++k) {
    chunks[k] = split_dim(plan.merged_shape[k], max_preconditioner_dim);
  }
  // Row-major enumeration of the chunk grid (first dim outermost).
  std::vector<size_t> index(order, 0);
  while (true) {
    BlockSlice slice;
    slice.numel = 1;
    for (size_t k = 0; k < order; ++k) {
      int64_t offset = 0;
      for (size_t c = 0; c < index[k]; ++c) offset += chunks[k][c];
      slice.offsets.push_back(offset);
      slice.sizes.push_back(chunks[k][index[k]]);
      slice.numel *= chunks[k][index[k]];
    }
    plan.blocks.push_back(std::move(slice));
    int64_t k = static_cast<int64_t>(order) - 1;
    while (k >= 0 && ++index[k] == chunks[k].size()) {
      index[k] = 0;
      --k;
    }
    if (k < 0) break;
  }
  return plan;
}

std::vector<at::Tensor> block_views(const at::Tensor& tensor, const BlockPlan& plan) {
  TORCH_INTERNAL_ASSERT(tensor.sizes() == at::IntArrayRef(plan.param_shape), "tensor of shape ",
                        tensor.sizes(), " does not match the plan's ", plan.param_shape);
  std::vector<at::Tensor> views;
  if (plan.blocks.empty()) return views;
  const auto merged = tensor.reshape(plan.merged_shape);
  views.reserve(plan.blocks.size());
  for (const auto& slice : plan.blocks) {
    at::Tensor view = merged;
    for (size_t k = 0; k < slice.sizes.size(); ++k) {
      if (slice.sizes[k] != plan.merged_shape[k]) {
        view = view.narrow(static_cast<int64_t>(k), slice.offsets[k], slice.sizes[k]);
      }
    }
    views.push_back(view);
  }
  return views;
}

}  // namespace shampoo::detail
