// Stacked Kronecker contractions against an einsum reference in float64.
#include "support/test_support.h"

#include "preconditioners/kronecker_contractions.h"

namespace {

using shampoo::detail::stacked_multiply_along_dim;
using shampoo::detail::stacked_outer_product;
using shampoo::testing::all_close;
using shampoo::testing::bit_equal;

const std::string kLetters = "abcdef";

/// Reference: blocks [n, d0, ..., dk] contracted with themselves over every dim but `dim`.
at::Tensor reference_outer(const at::Tensor& g, int64_t dim) {
  const int64_t order = g.dim() - 1;
  std::string left = "z", right = "z";
  for (int64_t k = 0; k < order; ++k) {
    left += kLetters[k];
    right += k == dim ? 'y' : kLetters[k];
  }
  return at::einsum(left + "," + right + "->z" + kLetters[dim] + "y", {g, g});
}

/// Reference: out[..., i, ...] = sum_j M[i, j] in[..., j, ...] along `dim`.
at::Tensor reference_multiply(const at::Tensor& g, const at::Tensor& m, int64_t dim) {
  const int64_t order = g.dim() - 1;
  std::string in = "z", out = "z";
  for (int64_t k = 0; k < order; ++k) {
    in += k == dim ? 'y' : kLetters[k];
    out += kLetters[k];
  }
  return at::einsum(std::string("z") + kLetters[dim] + "y," + in + "->" + out, {m, g});
}

class Contractions : public ::testing::TestWithParam<std::vector<int64_t>> {};

TEST_P(Contractions, MatchEinsum) {
  const auto shape = GetParam();
  std::vector<int64_t> stacked{3};
  stacked.insert(stacked.end(), shape.begin(), shape.end());
  const auto g = at::randn(stacked, at::kDouble);
  for (int64_t dim = 0; dim < static_cast<int64_t>(shape.size()); ++dim) {
    EXPECT_TRUE(all_close(stacked_outer_product(g, dim), reference_outer(g, dim), {1e-12, 1e-12}))
        << "outer product along dim " << dim;
    const auto m = at::randn({3, shape[dim], shape[dim]}, at::kDouble);
    EXPECT_TRUE(all_close(stacked_multiply_along_dim(g, m, dim), reference_multiply(g, m, dim),
                          {1e-12, 1e-12}))
        << "multiply along dim " << dim;
    EXPECT_TRUE(all_close(stacked_multiply_along_dim(g, m, dim, /*transpose=*/true),
                          reference_multiply(g, m.transpose(1, 2), dim), {1e-12, 1e-12}))
        << "transposed multiply along dim " << dim;
  }
}

INSTANTIATE_TEST_SUITE_P(Orders, Contractions,
                         ::testing::Values(std::vector<int64_t>{5}, std::vector<int64_t>{4, 6},
                                           std::vector<int64_t>{3, 4, 5},
                                           std::vector<int64_t>{2, 3, 2, 4}));

TEST(Contractions, BlockResultIndependentOfItsStack) {
  const auto g = at::randn({6, 40, 24});
  const auto m = at::randn({6, 24, 24});
  const auto all = stacked_multiply_along_dim(g, m, 1);
  const auto outer = stacked_outer_product(g, 0);
  for (int64_t i = 0; i < 6; ++i) {
    EXPECT_TRUE(bit_equal(stacked_multiply_along_dim(g.narrow(0, i, 1), m.narrow(0, i, 1), 1)[0],
                          all[i]));
    EXPECT_TRUE(bit_equal(stacked_outer_product(g.narrow(0, i, 1), 0)[0], outer[i]));
  }
}

}  // namespace
