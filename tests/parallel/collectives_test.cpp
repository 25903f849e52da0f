// The collective helpers of every mode (parallel/communication/collectives.h): the one agreement
// hash, the broadcast from rank 0, and the start_* functions through which every folder reaches
// c10d's collectives.
#include "parallel/communication/collectives.h"

#include <shampoo/shampoo.h>

#include <cmath>

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
    const auto all = shampoo::detail::gather_int64(*group, {fingerprint({7, rank == 2 ? 9 : 8})});
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

// Each start_* function at world 3 (ranks as threads, Gloo) against the values c10d's collective
// defines, with values that tell the ranks apart (rank r contributes powers of 10 shifted by r).
TEST(Collectives, EachStartsItsCollectiveWithC10dsResult) {
  using namespace shampoo::detail;
  run_ranks(3, [](int rank, const Group& group) {
    const auto mine = [rank](int64_t n) {
      return at::arange(n, at::kDouble).add(1).mul(std::pow(10.0, rank));
    };
    std::vector<at::Tensor> sum{mine(4)};
    start_all_reduce(*group, sum)->wait();
    EXPECT_TRUE(at::equal(sum[0], at::arange(4, at::kDouble).add(1).mul(111.0)));

    std::vector<at::Tensor> reduced{mine(4)};
    start_reduce(*group, reduced, 2)->wait();
    if (rank == 2) EXPECT_TRUE(at::equal(reduced[0], sum[0]));

    std::vector<at::Tensor> broadcast{mine(3)};
    start_broadcast(*group, broadcast, 1)->wait();
    EXPECT_TRUE(at::equal(broadcast[0], at::arange(3, at::kDouble).add(1).mul(10.0)));

    auto input = mine(2);
    auto gathered = at::empty({6}, at::kDouble);
    start_all_gather(*group, gathered, input)->wait();
    EXPECT_TRUE(at::equal(gathered, at::tensor({1.0, 2.0, 10.0, 20.0, 100.0, 200.0})));

    auto whole = mine(6);
    auto piece = at::empty({2}, at::kDouble);
    start_reduce_scatter(*group, piece, whole)->wait();
    EXPECT_TRUE(
        at::equal(piece, at::arange(2 * rank, 2 * rank + 2, at::kDouble).add(1).mul(111.0)));

    // Rank r sends i + 1 elements to rank i (its values 10^r·(1..)); rank i receives i + 1 from
    // each rank, in rank order.
    auto send = mine(6);
    std::vector<int64_t> send_split{1, 2, 3};
    std::vector<int64_t> receive_split(3, rank + 1);
    auto received = at::empty({3 * (rank + 1)}, at::kDouble);
    start_all_to_all(*group, received, send, receive_split, send_split)->wait();
    const int64_t first = rank * (rank + 1) / 2;  // where rank's piece starts in `send`
    std::vector<at::Tensor> expected;
    for (int from = 0; from < 3; ++from) {
      expected.push_back(
          at::arange(first, first + rank + 1, at::kDouble).add(1).mul(std::pow(10.0, from)));
    }
    EXPECT_TRUE(at::equal(received, at::cat(expected)));
    // The caller's splits are its own after the call (Gloo moves from the lists it is given):
    // full sharding reads them again to place what it received.
    EXPECT_EQ(send_split, (std::vector<int64_t>{1, 2, 3}));
    EXPECT_EQ(receive_split, std::vector<int64_t>(3, rank + 1));
  });
}

}  // namespace
