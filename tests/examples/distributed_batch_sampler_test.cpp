// The trainer's DistributedBatchSampler: the ranks' slices of a global batch are disjoint, their
// union is the global batch of one process with the whole batch, and the order depends only on
// (seed, epoch).
#include "examples/distributed_batch_sampler.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <string>

namespace {

using shampoo::examples::DistributedBatchSampler;

TEST(DistributedBatchSampler, RanksSplitTheGlobalBatchOfOneProcess) {
  const DistributedBatchSampler one(/*num_examples=*/103, /*local_batch_size=*/12, 1, 0, 5);
  const DistributedBatchSampler rank0(103, 4, 3, 0, 5);
  const DistributedBatchSampler rank1(103, 4, 3, 1, 5);
  const DistributedBatchSampler rank2(103, 4, 3, 2, 5);
  ASSERT_EQ(one.batches_per_epoch(), 8);  // 103 / 12, the partial batch dropped
  ASSERT_EQ(rank1.batches_per_epoch(), 8);
  for (int64_t epoch = 1; epoch <= 2; ++epoch) {
    const auto order = one.epoch_order(epoch);
    EXPECT_TRUE(at::equal(order, rank2.epoch_order(epoch)));
    EXPECT_TRUE(at::equal(std::get<0>(order.sort()), at::arange(103, at::kLong)));
    for (int64_t b = 0; b < 8; ++b) {
      const auto joined = at::cat(
          {rank0.local_batch(order, b), rank1.local_batch(order, b), rank2.local_batch(order, b)});
      EXPECT_TRUE(at::equal(joined, one.local_batch(order, b))) << "batch " << b;
    }
  }
  EXPECT_FALSE(at::equal(one.epoch_order(1), one.epoch_order(2)));
  const DistributedBatchSampler other_seed(103, 12, 1, 0, 6);
  EXPECT_FALSE(at::equal(one.epoch_order(1), other_seed.epoch_order(1)));
}

TEST(DistributedBatchSampler, FewerExamplesThanOneGlobalBatchIsAnError) {
  try {
    DistributedBatchSampler(15, 8, 2, 0, 1);
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(e.msg().find("the training set holds 15 examples, fewer than one global batch of "
                           "16 (8 per rank x 2 ranks)"),
              std::string::npos)
        << e.msg();
  }
}

}  // namespace
