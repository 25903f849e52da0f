#include "parallel/communication/ownership_plan.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <numeric>

namespace shampoo::detail {

int64_t block_cost(int64_t numel, int64_t element_size) {
  constexpr int64_t kAlignment = 64;
  const int64_t bytes = numel * element_size;
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

std::vector<int> assign_owners(const std::vector<int64_t>& costs, int world_size,
                               std::vector<int64_t>& loads) {
  TORCH_INTERNAL_ASSERT(world_size >= 1);
  TORCH_INTERNAL_ASSERT(static_cast<int>(loads.size()) == world_size);
  std::vector<size_t> order(costs.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return costs[a] > costs[b]; });
  std::vector<int> owners(costs.size(), 0);
  for (const size_t item : order) {
    // min_element returns the first (lowest) rank among equal loads.
    const auto rank =
        static_cast<int>(std::min_element(loads.begin(), loads.end()) - loads.begin());
    owners[item] = rank;
    loads[rank] += costs[item];
  }
  return owners;
}

OwnershipPlan::OwnershipPlan(int world_size)
    : world_size_(world_size), loads_(static_cast<size_t>(std::max(world_size, 1)), 0) {
  TORCH_INTERNAL_ASSERT(world_size >= 1, "OwnershipPlan over ", world_size, " ranks");
}

int64_t OwnershipPlan::add(const std::vector<int64_t>& costs) {
  const auto first = size();
  const auto owners = assign_owners(costs, world_size_, loads_);
  owners_.insert(owners_.end(), owners.begin(), owners.end());
  return first;
}

int64_t OwnershipPlan::add_together(const std::vector<int64_t>& costs,
                                    const std::vector<int64_t>& together) {
  TORCH_INTERNAL_ASSERT(costs.size() == together.size());
  std::vector<int64_t> set_of(costs.size());
  std::vector<int64_t> set_costs;
  std::map<int64_t, int64_t> index_of_set;
  for (size_t i = 0; i < costs.size(); ++i) {
    const auto [it, fresh] =
        index_of_set.emplace(together[i], static_cast<int64_t>(set_costs.size()));
    if (fresh) set_costs.push_back(0);
    set_of[i] = it->second;
    set_costs[it->second] += costs[i];
  }
  const auto first = size();
  const auto set_owners = assign_owners(set_costs, world_size_, loads_);
  for (const int64_t s : set_of) owners_.push_back(set_owners[s]);
  return first;
}

OwnerMajorLayout::OwnerMajorLayout(int world_size, const std::vector<int64_t>& numels,
                                   const std::vector<int>& owners, bool with_flags)
    : world_size_(world_size),
      owners_(owners),
      numels_(numels),
      offsets_(numels.size()),
      flags_(numels.size(), -1) {
  TORCH_INTERNAL_ASSERT(numels.size() == owners.size());
  std::vector<int64_t> header(world_size, with_flags ? 1 : 0);  // the status word
  std::vector<int64_t> values(world_size, 0);
  for (size_t i = 0; i < numels.size(); ++i) {
    TORCH_INTERNAL_ASSERT(owners[i] >= 0 && owners[i] < world_size, "owner ", owners[i]);
    if (with_flags) flags_[i] = header[owners[i]]++;
    values[owners[i]] += numels[i];
  }
  std::vector<int64_t> next(header);
  for (size_t i = 0; i < numels.size(); ++i) {
    offsets_[i] = next[owners[i]];
    next[owners[i]] += numels[i];
  }
  for (int r = 0; r < world_size; ++r) {
    segment_size_ = std::max(segment_size_, header[r] + values[r]);
    header_size_ = std::max(header_size_, header[r]);
  }
}

at::Tensor OwnerMajorLayout::make_send(const at::TensorOptions& options) const {
  return at::zeros({segment_size_}, options);
}

at::Tensor OwnerMajorLayout::make_receive(const at::TensorOptions& options) const {
  return at::zeros({world_size_ * segment_size_}, options);
}

at::Tensor OwnerMajorLayout::in_send(const at::Tensor& send, int64_t item) const {
  return send.narrow(0, offsets_[item], numels_[item]);
}

at::Tensor OwnerMajorLayout::in_receive(const at::Tensor& receive, int64_t item) const {
  return receive.narrow(0, owners_[item] * segment_size_ + offsets_[item], numels_[item]);
}

}  // namespace shampoo::detail
