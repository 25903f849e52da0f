// The ownership plan (docs/math.md "Distribution"): LPT by cost, ties to the lowest rank; the
// owner-major layout of one AllGather.
#include "parallel/communication/ownership_plan.h"

#include "support/test_support.h"

namespace {

using shampoo::detail::assign_owners;
using shampoo::detail::block_cost;
using shampoo::detail::OwnerMajorLayout;
using shampoo::detail::OwnershipPlan;

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

TEST(OwnershipPlan, ItemsAddedLaterKeepTheOwnersAndContinueTheLoads) {
  OwnershipPlan plan(2);
  EXPECT_EQ(plan.add({40, 100, 50, 60}), 0);
  EXPECT_EQ(plan.owners(), (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ(plan.add({64}), 4);
  EXPECT_EQ(plan.owner_of(4), 1);  // 110 < 140
  EXPECT_EQ(plan.loads(), (std::vector<int64_t>{140, 174}));
  EXPECT_EQ(plan.size(), 5);
}

TEST(OwnershipPlan, ItemsOwnedTogetherShareAnOwnerAndCostTheirSum) {
  OwnershipPlan plan(2);
  // Sets: {a: 64, 64}, {b: 256}, {c: 64}; placed b -> 0, a (128) -> 1, c -> 1 (128 < 256).
  plan.add_together({64, 256, 64, 64}, {7, 3, 7, 9});
  EXPECT_EQ(plan.owners(), (std::vector<int>{1, 0, 1, 1}));
  EXPECT_EQ(plan.loads(), (std::vector<int64_t>{256, 192}));
}

TEST(OwnerMajorLayout, SegmentsHoldEachOwnersValuesInItemOrder) {
  // Items 0 (3 values, rank 1), 1 (2, rank 0), 2 (4, rank 1) over 3 ranks.
  const OwnerMajorLayout layout(3, {3, 2, 4}, {1, 0, 1}, /*with_flags=*/false);
  EXPECT_EQ(layout.segment_size(), 7);
  EXPECT_EQ(layout.offset(0), 0);
  EXPECT_EQ(layout.offset(1), 0);
  EXPECT_EQ(layout.offset(2), 3);
  const auto receive = at::arange(3 * 7, at::kFloat);
  EXPECT_TRUE(at::equal(layout.in_receive(receive, 2), at::arange(10, 14, at::kFloat)));
  EXPECT_TRUE(at::equal(layout.in_receive(receive, 1), at::arange(0, 2, at::kFloat)));
  auto send = layout.make_send(at::kFloat);
  layout.in_send(send, 2).fill_(5);
  EXPECT_EQ(send.sum().item<float>(), 20.0f);
  EXPECT_TRUE(at::equal(send.narrow(0, 3, 4), at::full({4}, 5.0f)));
}

TEST(OwnerMajorLayout, FlagsFollowTheStatusWordOfEachSegment) {
  const OwnerMajorLayout layout(2, {3, 2, 4}, {1, 0, 1}, /*with_flags=*/true);
  // Rank 1: [status, flag of 0, flag of 2, values of 0 (3), values of 2 (4)].
  EXPECT_EQ(layout.flag(0), 1);
  EXPECT_EQ(layout.flag(2), 2);
  EXPECT_EQ(layout.flag(1), 1);
  EXPECT_EQ(layout.offset(0), 3);
  EXPECT_EQ(layout.offset(2), 6);
  EXPECT_EQ(layout.offset(1), 2);
  EXPECT_EQ(layout.header_size(), 3);
  EXPECT_EQ(layout.segment_size(), 10);
  EXPECT_EQ(layout.make_receive(at::kFloat).numel(), 20);
}

}  // namespace
