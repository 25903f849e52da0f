#pragma once
/// Owner assignment of blocks to ranks (docs/math.md "Distribution"): greedy longest-processing-
/// time. Blocks sorted by cost descending (stable), each given to the least-loaded rank (ties:
/// lowest rank). Deterministic: every rank computes the same map from the same inputs.

#include <cstdint>
#include <vector>

namespace shampoo::detail {

/// Cost of a block: its bytes in the communication dtype, rounded up to 64 bytes.
int64_t block_cost(int64_t numel, int64_t element_size);

/// Owners of blocks with the given costs over `world_size` ranks. `loads` (size world_size)
/// holds the ranks' loads before the call and is updated, so blocks added later (a new param
/// group) continue the same assignment without moving existing blocks.
std::vector<int> assign_owners(const std::vector<int64_t>& costs, int world_size,
                               std::vector<int64_t>& loads);

}  // namespace shampoo::detail
