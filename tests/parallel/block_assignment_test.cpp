// Owner assignment (docs/math.md "Distribution"): LPT by cost, ties to the lowest rank.
#include "parallel/block_assignment.h"

#include "support/test_support.h"

namespace {

using shampoo::detail::assign_owners;
using shampoo::detail::block_cost;

TEST(BlockAssignment, CostIsBytesRoundedUpTo64) {
  EXPECT_EQ(block_cost(1, 4), 64);
  EXPECT_EQ(block_cost(16, 4), 64);
  EXPECT_EQ(block_cost(17, 4), 128);
  EXPECT_EQ(block_cost(100, 2), 256);
  EXPECT_EQ(block_cost(0, 4), 0);
}

TEST(BlockAssignment, LongestProcessingTimeFirst) {
  std::vector<int64_t> loads(2, 0);
  // Sorted: 100 -> r0, 60 -> r1, 50 -> r1 (60 < 100), 40 -> r0 (100 < 110).
  const auto owners = assign_owners({40, 100, 50, 60}, 2, loads);
  EXPECT_EQ(owners, (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ(loads, (std::vector<int64_t>{140, 110}));
}

TEST(BlockAssignment, TiesGoToLowestRankAndOrderIsStable) {
  std::vector<int64_t> loads(3, 0);
  const auto owners = assign_owners({64, 64, 64, 64}, 3, loads);
  EXPECT_EQ(owners, (std::vector<int>{0, 1, 2, 0}));
}

TEST(BlockAssignment, MoreRanksThanBlocks) {
  std::vector<int64_t> loads(4, 0);
  const auto owners = assign_owners({128, 64}, 4, loads);
  EXPECT_EQ(owners, (std::vector<int>{0, 1}));
  EXPECT_EQ(loads[2], 0);
}

TEST(BlockAssignment, LaterBlocksContinueTheLoads) {
  std::vector<int64_t> loads(2, 0);
  assign_owners({256, 64}, 2, loads);
  const auto later = assign_owners({64}, 2, loads);
  EXPECT_EQ(later, (std::vector<int>{1}));  // rank 1 had 64, rank 0 had 256
}

}  // namespace
