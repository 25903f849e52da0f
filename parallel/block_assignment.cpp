#include "parallel/block_assignment.h"

#include <c10/util/Exception.h>

#include <algorithm>
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
  for (const size_t block : order) {
    // min_element returns the first (lowest) rank among equal loads.
    const auto rank =
        static_cast<int>(std::min_element(loads.begin(), loads.end()) - loads.begin());
    owners[block] = rank;
    loads[rank] += costs[block];
  }
  return owners;
}

}  // namespace shampoo::detail
