// The collective helpers of every mode (parallel/collectives.h): the one agreement hash and the
// broadcast from rank 0.
#include "parallel/collectives.h"

#include <shampoo/shampoo.h>

#include "support/test_support.h"

namespace {

using shampoo::detail::fingerprint;
using shampoo::detail::Fingerprint;
using shampoo::testing::run_ranks;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

TEST(AgreementHash, EqualListsAgreeAndAnyDifferenceShows) {
  const std::vector<int64_t> values{3, -1, 1LL << 40, 0};
  EXPECT_EQ(fingerprint(values), fingerprint(std::vector<int64_t>(values)));
  EXPECT_GE(fingerprint(values), 0);
  auto other = values;
  other[2] += 1;
  EXPECT_NE(fingerprint(values), fingerprint(other));
  EXPECT_NE(fingerprint({}), fingerprint({0}));
  EXPECT_NE(fingerprint({1, 2}), fingerprint({2, 1}));
  // Lists end: [[1, 2], [3]] and [[1], [2, 3]] hash apart.
  EXPECT_NE(Fingerprint().add_list({1, 2}).add_list({3}).value(),
            Fingerprint().add_list({1}).add_list({2, 3}).value());
}

TEST(AgreementHash, TheRanksSeeWhoDiffers) {
  run_ranks(3, [](int rank, const Group& group) {
    const auto all =
        shampoo::detail::gather_int64(*group, {fingerprint({7, rank == 2 ? 9 : 8})});
    ASSERT_EQ(all.size(), 3u);
    EXPECT_EQ(shampoo::detail::first_differing_rank(all), std::optional<int>(2));
    const auto same = shampoo::detail::gather_int64(*group, {fingerprint({7, 8})});
    EXPECT_EQ(shampoo::detail::first_differing_rank(same), std::nullopt);
  });
}

TEST(BroadcastFromRankZero, EveryRankGetsRankZerosValuesInPlace) {
  run_ranks(3, [](int rank, const Group& group) {
    // Two dtypes and a non-contiguous tensor: one broadcast per dtype, written in place.
    auto a = at::full({2, 3}, static_cast<float>(rank));
    auto b = at::full({4}, static_cast<double>(rank + 10));
    auto base = at::full({3, 2}, static_cast<float>(rank + 20));
    auto c = base.t();
    shampoo::detail::broadcast_from_rank_zero(*group, {a, b, c}, "test: ", "the broadcast");
    EXPECT_TRUE(at::equal(a, at::zeros({2, 3})));
    EXPECT_TRUE(at::equal(b, at::full({4}, 10.0, at::kDouble)));
    EXPECT_TRUE(at::equal(base, at::full({3, 2}, 20.0f)));
  });
}

}  // namespace
