// Blocking (docs/math.md): squeeze, merge small dims, split; blocks are views of the parameter.
#include "distributor/block_plan.h"

#include "support/test_support.h"

namespace {

using shampoo::detail::make_block_plan;
using shampoo::detail::merge_small_dims;
using Shape = std::vector<int64_t>;

TEST(MergeSmallDims, ExamplesFromNumerics) {
  EXPECT_EQ(merge_small_dims({1, 2, 5, 1}, 10), (Shape{10}));
  EXPECT_EQ(merge_small_dims({32, 3, 64, 64}, 8192), (Shape{96, 4096}));
  EXPECT_EQ(merge_small_dims({10, 5}, 1024), (Shape{50}));  // a 10x5 weight is one vector
}

TEST(MergeSmallDims, EdgeCases) {
  EXPECT_EQ(merge_small_dims({}, 1024), (Shape{1}));
  EXPECT_EQ(merge_small_dims({1, 1}, 1024), (Shape{1}));
  EXPECT_EQ(merge_small_dims({3, 0, 4}, 1024), (Shape{0}));
  EXPECT_EQ(merge_small_dims({7}, 4), (Shape{7}));  // never split here, only merged
  EXPECT_EQ(merge_small_dims({4, 5, 6}, 30), (Shape{4, 30}));
  EXPECT_EQ(merge_small_dims({4, 5, 6}, 29), (Shape{20, 6}));
  EXPECT_EQ(merge_small_dims({4, 5, 6}, 1), (Shape{4, 5, 6}));
  // Without merging only size-1 dims go.
  EXPECT_EQ(merge_small_dims({1, 2, 5, 1}, 10, /*merge=*/false), (Shape{2, 5}));
  // Target order 2 keeps two dims.
  EXPECT_EQ(merge_small_dims({2, 3, 4}, 1024, true, 2), (Shape{2, 12}));
}

TEST(BlockPlan, SplitsEveryDimIntoChunks) {
  const auto plan = make_block_plan({1000, 3000}, 1024, true);
  EXPECT_EQ(plan.merged_shape, (Shape{1000, 3000}));
  ASSERT_EQ(plan.blocks.size(), 3u);
  EXPECT_EQ(plan.blocks[0].sizes, (Shape{1000, 1024}));
  EXPECT_EQ(plan.blocks[1].sizes, (Shape{1000, 1024}));
  EXPECT_EQ(plan.blocks[2].sizes, (Shape{1000, 952}));
  EXPECT_EQ(plan.blocks[2].offsets, (Shape{0, 2048}));
  const auto grid = make_block_plan({5, 7}, 3, true);
  ASSERT_EQ(grid.blocks.size(), 6u);  // 2 x 3 chunks, row-major
  EXPECT_EQ(grid.blocks[1].offsets, (Shape{0, 3}));
  EXPECT_EQ(grid.blocks[3].offsets, (Shape{3, 0}));
  EXPECT_EQ(grid.blocks[5].sizes, (Shape{2, 1}));
  EXPECT_TRUE(make_block_plan({0, 4}, 8, true).blocks.empty());
}

TEST(BlockPlan, BlocksAreViewsOfTheParameter) {
  auto param = at::arange(5 * 7, at::kFloat).view({5, 7});
  const auto plan = make_block_plan(param.sizes(), 3, true);
  auto views = shampoo::detail::block_views(param, plan);
  ASSERT_EQ(views.size(), 6u);
  EXPECT_TRUE(at::equal(views[4], param.narrow(0, 3, 2).narrow(1, 3, 3)));
  views[4].fill_(-1);
  EXPECT_EQ(param[4][5].item<float>(), -1.0f);
  // Every element is in exactly one block.
  int64_t total = 0;
  for (const auto& v : views) total += v.numel();
  EXPECT_EQ(total, param.numel());
}

TEST(BlockPlan, MergedParameterBlocks) {
  auto param = at::zeros({32, 3, 5, 5});
  const auto plan = make_block_plan(param.sizes(), 100, true);
  EXPECT_EQ(plan.merged_shape, (Shape{32, 75}));  // 5*5*3 = 75 <= 100, 75*32 > 100
  auto views = shampoo::detail::block_views(param, plan);
  ASSERT_EQ(views.size(), 1u);
  views[0].fill_(2.0);
  EXPECT_EQ(param.sum().item<float>(), 2.0f * param.numel());
}

}  // namespace
