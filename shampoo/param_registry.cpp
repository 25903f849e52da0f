#include "shampoo/param_registry.h"

#include <c10/util/Exception.h>

#include <utility>

namespace shampoo::detail {

void ParamRegistry::check_new_params(const std::vector<at::Tensor>& new_params, size_t index,
                                     size_t first) const {
  std::unordered_map<const void*, size_t> seen;
  for (size_t i = 0; i < params.size(); ++i) {
    seen.emplace(params[i].param.unsafeGetTensorImpl(), static_cast<size_t>(params[i].group));
  }
  for (size_t i = first; i < new_params.size(); ++i) {
    const auto& p = new_params[i];
    TORCH_CHECK(p.defined(), "param group ", index, ": parameter ", i, " is undefined");
    TORCH_CHECK(p.is_floating_point(), "param group ", index, ": parameter ", i, " has dtype ",
                p.scalar_type(), ", expected a floating-point tensor");
    TORCH_CHECK(p.layout() == at::kStrided, "param group ", index, ": parameter ", i,
                " is sparse (layout ", p.layout(), "); DistributedShampoo needs dense parameters");
    TORCH_CHECK(p.scalar_type() == at::kFloat || p.scalar_type() == at::kDouble ||
                    p.scalar_type() == at::kBFloat16 || p.scalar_type() == at::kHalf,
                "param group ", index, ": parameter ", i, " has dtype ", p.scalar_type(),
                ", expected Float, Double, BFloat16 or Half");
    // One dtype per group: the group's blocks run one elementwise chain (groups of different
    // dtypes are fine, they never share a virtual group).
    TORCH_CHECK(p.scalar_type() == new_params[0].scalar_type(), "param group ", index,
                ": parameter ", i, ": dtype: got ", p.scalar_type(), ", expected ",
                new_params[0].scalar_type(),
                " (the dtype of parameter 0; the parameters of one param group share a dtype, put "
                "the ",
                p.scalar_type(), " parameters into a param group of their own)");
    TORCH_CHECK(p.is_leaf(), "param group ", index, ": parameter ", i,
                " is not a leaf tensor (can't optimize a non-leaf Tensor)");
    if (!params.empty() || i > 0) {
      const auto& device = params.empty() ? new_params[0].device() : params[0].param.device();
      TORCH_CHECK(p.device() == device, "param group ", index, ": parameter ", i, " is on ",
                  p.device(), " but other parameters are on ", device,
                  "; DistributedShampoo needs all parameters on one device");
    }
    const auto [it, inserted] = seen.emplace(p.unsafeGetTensorImpl(), index);
    TORCH_CHECK(inserted, "param group ", index, ": parameter ", i, " is already in param group ",
                it->second, " (a tensor may belong to one group only)");
  }
}

void ParamRegistry::add(const std::vector<at::Tensor>& new_params, int64_t group,
                        std::vector<BlockPlan> plans) {
  if (group == static_cast<int64_t>(group_sizes.size())) {
    group_sizes.push_back(static_cast<int64_t>(new_params.size()));
  } else {
    TORCH_INTERNAL_ASSERT(group >= 0 && group < static_cast<int64_t>(group_sizes.size()));
    group_sizes[group] += static_cast<int64_t>(new_params.size());
  }
  for (size_t i = 0; i < new_params.size(); ++i) {
    ParamEntry entry;
    entry.param = new_params[i];
    entry.group = group;
    entry.plan = std::move(plans[i]);
    entry.first_block = static_cast<int64_t>(blocks.size());
    const auto param_index = static_cast<int64_t>(params.size());
    lookup_[new_params[i].unsafeGetTensorImpl()] = param_index;
    for (size_t b = 0; b < entry.plan.blocks.size(); ++b) {
      BlockEntry block;
      block.id = BlockId{param_index, static_cast<int64_t>(b)};
      block.param = param_index;
      block.shape = entry.plan.blocks[b].sizes;
      block.numel = entry.plan.blocks[b].numel;
      blocks.push_back(block);
    }
    params.push_back(std::move(entry));
  }
}

int64_t ParamRegistry::index_of(const at::Tensor& param) const {
  const auto it = lookup_.find(param.unsafeGetTensorImpl());
  return it == lookup_.end() ? -1 : it->second;
}

}  // namespace shampoo::detail
