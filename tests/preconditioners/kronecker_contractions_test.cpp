// Stacked Kronecker contractions against an einsum reference in float64.
#include "preconditioners/kronecker_contractions.h"

#include <cstdlib>
#include <string>

#include "support/test_support.h"

namespace {

using shampoo::detail::block_multiply_along_dim;
using shampoo::detail::block_multiply_along_dim_out;
using shampoo::detail::stacked_multiply_along_dim;
using shampoo::detail::stacked_outer_product;
using shampoo::detail::stacked_outer_product_lower;
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

// From two panels of rows on (d ≥ 256) the product is computed one triangle at a time (as syrk):
// it is symmetric bit for bit (the upper triangle, diagonal blocks included, mirrors the lower),
// its lower triangle is the full product's, and it is the same for a block wherever it sits in a
// stack. Both orientations: dim 0 (X·Xᵀ of the rows) and the last dim (Xᵀ·X, panels of columns),
// a dim that is not a multiple of the panel, and a middle dim of a 3-D block.
// The lower triangle equals the full product bit for bit where BLAS sums a panel as it sums the
// whole product: MKL does so on AMD Zen 5 (its Zen kernels), and this test demands it on AMD
// CPUs (SHAMPOO_GRAM_BITS unset) or when SHAMPOO_GRAM_BITS=1. On Intel Xeons (the GPU machine's
// host, 2026-11-26; a development machine, 7497 of 1M elements an ulp or so apart) it does not,
// so there, or with SHAMPOO_GRAM_BITS=0, it checks the float32 tolerance instead.
TEST(SymmetricGram, LowerTriangleIsTheFullProductBitForBit) {
  const char* bits_env = std::getenv("SHAMPOO_GRAM_BITS");
#if defined(__x86_64__)
  const bool amd = __builtin_cpu_is("amd");
#else
  const bool amd = false;
#endif
  const bool bits = bits_env == nullptr ? amd : std::string(bits_env) != "0";
  at::manual_seed(21);
  for (const auto& shape : std::vector<std::vector<int64_t>>{
           {512, 300}, {300, 512}, {257, 64}, {385, 33}, {700, 5}, {1024, 784}, {3, 260, 4}}) {
    const auto block = at::randn(shape);
    for (int64_t dim = 0; dim < block.dim(); ++dim) {
      if (block.size(dim) < 256) continue;
      const auto x = block.movedim(dim, 0).reshape({block.size(dim), -1});
      const auto full = at::mm(x, x.t());
      const auto ours = stacked_outer_product(block.unsqueeze(0), dim)[0];
      if (bits) {
        EXPECT_TRUE(bit_equal(ours.tril(), full.tril())) << "dim " << dim;
      } else {
        const double scale = full.abs().max().item<double>();
        EXPECT_TRUE(at::allclose(ours.tril(), full.tril(), 1e-5, 1e-5 * scale)) << "dim " << dim;
      }
      EXPECT_TRUE(bit_equal(ours, ours.t())) << "dim " << dim;
      const auto stacked = at::stack({at::randn(shape), block});
      EXPECT_TRUE(bit_equal(stacked_outer_product(stacked, dim)[1], ours)) << "dim " << dim;
    }
  }
}

// The lower-only products (the factor updates' path) hold the full products' lower triangle bit
// for bit on the CPU, the same panel products written straight into the stack without their
// mirror: matrix and 3-D blocks, dims from one panel to several, and stacks whose slots do not
// start on a 64-byte boundary (d = 257, 385: each slot then goes through a fresh matrix).
TEST(SymmetricGram, LowerOnlyProductsHoldTheFullProductsLowerTriangle) {
  at::manual_seed(22);
  for (const auto& shape : std::vector<std::vector<int64_t>>{
           {512, 300}, {300, 512}, {257, 64}, {385, 33}, {40, 24}, {3, 260, 4}}) {
    std::vector<int64_t> stacked{3};
    stacked.insert(stacked.end(), shape.begin(), shape.end());
    const auto blocks = at::randn(stacked);
    for (int64_t dim = 0; dim < static_cast<int64_t>(shape.size()); ++dim) {
      const auto full = stacked_outer_product(blocks, dim);
      const auto lower = stacked_outer_product_lower(blocks, dim);
      ASSERT_EQ(lower.sizes(), full.sizes());
      for (int64_t i = 0; i < 3; ++i) {
        EXPECT_TRUE(bit_equal(lower[i].tril(), full[i].tril()))
            << "shape " << at::IntArrayRef(shape) << " dim " << dim << " block " << i;
      }
    }
  }
}

// The product written into a given tensor equals the returned one bit for bit: into fresh memory,
// into the block itself (the product must not read what it has overwritten), into a slot that does
// not start on a 64-byte boundary, and along a middle dim.
TEST(BlockMultiplyOut, EqualsTheReturnedProductWhereverItIsWritten) {
  at::manual_seed(23);
  for (const auto& shape : std::vector<std::vector<int64_t>>{{64, 48}, {33, 7}, {5, 6, 7}}) {
    for (int64_t dim = 0; dim < static_cast<int64_t>(shape.size()); ++dim) {
      const auto block = at::randn(shape);
      const auto matrix = at::randn({shape[dim], shape[dim]});
      const auto expected = block_multiply_along_dim(block, matrix, dim);
      auto fresh = at::empty(shape);
      block_multiply_along_dim_out(fresh, block, matrix, dim);
      EXPECT_TRUE(bit_equal(fresh, expected)) << "fresh, dim " << dim;
      auto in_place = block.clone();
      block_multiply_along_dim_out(in_place, in_place, matrix, dim);
      EXPECT_TRUE(bit_equal(in_place, expected)) << "in place, dim " << dim;
      auto storage = at::empty({block.numel() + 1});
      auto shifted = storage.narrow(0, 1, block.numel()).view(shape);
      block_multiply_along_dim_out(shifted, block, matrix, dim);
      EXPECT_TRUE(bit_equal(shifted, expected)) << "shifted, dim " << dim;
    }
  }
}

class StackIndependence
    : public ::testing::TestWithParam<std::tuple<std::vector<int64_t>, at::ScalarType>> {};

TEST_P(StackIndependence, BlockResultDoesNotDependOnItsStack) {
  // Odd sizes, matrix-vector shapes and float64 are where batched BLAS on this CPU rounds
  // differently per batch; the contractions must not.
  const auto [shape, dtype] = GetParam();
  std::vector<int64_t> stacked{6};
  stacked.insert(stacked.end(), shape.begin(), shape.end());
  const auto g = at::randn(stacked, dtype);
  for (int64_t dim = 0; dim < static_cast<int64_t>(shape.size()); ++dim) {
    const auto m = at::randn({6, shape[dim], shape[dim]}, dtype);
    const auto all = stacked_multiply_along_dim(g, m, dim);
    const auto outer = stacked_outer_product(g, dim);
    for (int64_t first = 0; first < 6; ++first) {
      const auto part = stacked_multiply_along_dim(g.narrow(0, first, 6 - first),
                                                   m.narrow(0, first, 6 - first), dim);
      const auto part_outer = stacked_outer_product(g.narrow(0, first, 6 - first), dim);
      for (int64_t i = first; i < 6; ++i) {
        EXPECT_TRUE(bit_equal(part[i - first], all[i])) << "dim " << dim << " block " << i;
        EXPECT_TRUE(bit_equal(part_outer[i - first], outer[i])) << "dim " << dim << " block " << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, StackIndependence,
    ::testing::Combine(::testing::Values(std::vector<int64_t>{33}, std::vector<int64_t>{7},
                                         std::vector<int64_t>{40, 24}, std::vector<int64_t>{33, 1},
                                         std::vector<int64_t>{7, 9}, std::vector<int64_t>{101, 3},
                                         std::vector<int64_t>{5, 7, 3}),
                       ::testing::Values(at::kFloat, at::kDouble)));

}  // namespace
