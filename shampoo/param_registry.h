#pragma once
/// The parameters and blocks a DistributedShampoo has registered: per parameter its param group,
/// block plan and first block; per block its id, shape, owner and virtual group; per param group
/// its size. Parameters keep their registration order and blocks their parameters' order, so
/// indices are stable for the optimizer's life (checkpoints and the Distributor use them).

#include <ATen/ATen.h>

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "distributor/block_plan.h"
#include "shampoo/virtual_group.h"

namespace shampoo::detail {

struct ParamRegistry {
  std::vector<ParamEntry> params;
  std::vector<BlockEntry> blocks;
  std::vector<int64_t> group_sizes;

  /// Checks the parameters of param group `index` from position `first` on (those not yet
  /// registered; 0 for a new group) before anything is registered: dense floating-point leaves of
  /// one dtype (Float, Double, BFloat16, Half; the group's parameter 0 sets it), on the device of
  /// the others, in no other group. Errors name the group, the parameter and what is allowed.
  void check_new_params(const std::vector<at::Tensor>& group_params, size_t index,
                        size_t first = 0) const;
  /// Registers parameters of param group `group` (a new group, the next index, or parameters
  /// appended to a registered one) with their block plans (owners unset).
  void add(const std::vector<at::Tensor>& new_params, int64_t group, std::vector<BlockPlan> plans);
  /// Index of `param` among the registered parameters, or -1.
  int64_t index_of(const at::Tensor& param) const;

 private:
  std::unordered_map<const void*, int64_t> lookup_;  // TensorImpl -> index in params
};

}  // namespace shampoo::detail
