// Gradient sharding (ZeRO-2) in real processes: a GoogleTest program launched by torchrun
// (CTest: --nproc-per-node 2 and 4, Gloo over loopback). Every rank joins through
// init_process_group_from_env and trains each optimizer kind unsharded and sharded side by side
// (parallel/sharding_runs.h): bit for bit equal at world 2; at world 4 the reduced gradients are
// within float32 rounding of the all-reduced ones (how many bit-identical is printed).
#include <gtest/gtest.h>
#include <shampoo/shampoo.h>

#include <chrono>
#include <iostream>

#include "parallel/collectives.h"
#include "parallel/sharding_runs.h"

namespace {

c10::intrusive_ptr<c10d::ProcessGroup>& process_group() {
  static c10::intrusive_ptr<c10d::ProcessGroup> group;
  return group;
}

using shampoo::testing::ShardingKind;

class TorchrunSharding : public ::testing::TestWithParam<ShardingKind> {};

TEST_P(TorchrunSharding, EqualsUnshardedDataParallelism) {
  const auto& group = process_group();
  const int rank = group->getRank();
  const int world = group->getSize();
  shampoo::testing::GradientAgreement agreement;
  shampoo::testing::check_sharded_equals_unsharded(GetParam(), rank, world, group, agreement);
  // Every rank's count, summed on every rank.
  const auto all = shampoo::detail::gather_int64(*group, {agreement.elements, agreement.bit_equal});
  int64_t elements = 0, same = 0;
  for (const auto& r : all) {
    elements += r[0];
    same += r[1];
  }
  if (rank == 0 && elements > 0) {
    std::cout << shampoo::testing::kind_name(GetParam()) << " world " << world << ": " << same
              << " of " << elements
              << " reduced gradient elements bit-identical to the all-reduced ones\n";
  }
  if (world == 2) {
    EXPECT_EQ(same, elements);
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, TorchrunSharding,
                         ::testing::Values(ShardingKind::kShampooRootInverse,
                                           ShardingKind::kShampooEigenvalueCorrected,
                                           ShardingKind::kShardedAdam,
                                           ShardingKind::kInBackwardShampoo),
                         [](const auto& info) { return shampoo::testing::kind_name(info.param); });

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  process_group() = shampoo::init_process_group_from_env(std::chrono::seconds(120));
  // Only rank 0 prints gtest's progress; every rank's failures still fail its exit code.
  if (process_group()->getRank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int result = RUN_ALL_TESTS();
  process_group().reset();
  return result;
}
