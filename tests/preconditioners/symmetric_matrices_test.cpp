// Packed symmetric storage (preconditioners/symmetric_matrices.h): the layout, pack and unpack as
// exact copies in every dtype, the mirrored dense layout, and checkpoint entries in either layout.
// Compact stacks (CompactState): bfloat16 and 8-bit entries, their error bounds, exact
// re-encoding of decoded values (checkpoints), and their bytes.
#include "preconditioners/symmetric_matrices.h"

#include <gtest/gtest.h>

#include <limits>
#include <map>
#include <string>

#include "support/test_support.h"

namespace {

using shampoo::CompactState;
using shampoo::detail::decay_add_packed_;
using shampoo::detail::kCompactGroup;
using shampoo::detail::mirror_lower_;
using shampoo::detail::pack_lower;
using shampoo::detail::packed_size;
using shampoo::detail::Rows;
using shampoo::detail::SymmetricMatrices;
using shampoo::detail::unpack_symmetric;
using shampoo::testing::bit_equal;

/// The lower triangle of `a` [..., d, d] mirrored onto the upper one, from ATen's tril.
at::Tensor mirrored(const at::Tensor& a) {
  const auto lower = a.tril();
  return lower + lower.tril(-1).transpose(-2, -1);
}

TEST(SymmetricLayout, PacksTheLowerTriangleRowByRow) {
  const auto a = at::arange(16, at::kFloat).view({4, 4});
  const auto packed = pack_lower(a);
  // (0,0), (1,0..1), (2,0..2), (3,0..3).
  const auto expected = at::tensor({0.f, 4.f, 5.f, 8.f, 9.f, 10.f, 12.f, 13.f, 14.f, 15.f});
  EXPECT_TRUE(bit_equal(packed, expected));
  EXPECT_TRUE(bit_equal(unpack_symmetric(packed, 4), mirrored(a)));
}

class SymmetricRoundTrip
    : public ::testing::TestWithParam<std::tuple<at::ScalarType, int64_t /*d*/>> {};

TEST_P(SymmetricRoundTrip, UnpackOfPackIsTheMirroredUpperTriangle) {
  const auto [dtype, d] = GetParam();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  // Not symmetric on purpose: the upper triangle must not leak into either layout.
  const auto a = at::randn({3, 2, d, d}, gen).to(dtype);
  const auto packed = pack_lower(a);
  ASSERT_EQ(packed.sizes(), (at::IntArrayRef{3, 2, packed_size(d)}));
  const auto unpacked = unpack_symmetric(packed, d);
  EXPECT_TRUE(bit_equal(unpacked, mirrored(a)));
  auto in_place = a.clone();
  mirror_lower_(in_place);
  EXPECT_TRUE(bit_equal(in_place, mirrored(a)));
  // A symmetric matrix survives pack and unpack unchanged.
  EXPECT_TRUE(bit_equal(unpack_symmetric(pack_lower(unpacked), d), unpacked));
  // Into a reused tensor: the same bits, every entry written (it starts as NaN).
  auto into = at::full({3, 2, d, d}, std::numeric_limits<double>::quiet_NaN(), a.options());
  shampoo::detail::unpack_symmetric_into(into, packed);
  EXPECT_TRUE(bit_equal(into, mirrored(a)));
}

TEST(SymmetricLayout, UnpackKeepsTheBitsOfNaNsAndSubnormals) {
  // A copy, no arithmetic: NaN payloads, −0 and subnormals come out as they went in.
  const int64_t d = 40;
  auto bits = at::randint(0, 1 << 30, {d, d}, at::kInt);
  bits[3][1] = 0x7fc01234;                            // a quiet NaN with a payload
  bits[20][7] = std::numeric_limits<int32_t>::min();  // −0: the sign bit alone
  bits[39][38] = 0x00000001;                          // the smallest subnormal
  bits[35][2] = 0x7fa00001;                           // a signalling NaN
  const auto a = bits.view(at::kFloat);
  const auto unpacked = unpack_symmetric(pack_lower(a), d);
  EXPECT_TRUE(at::equal(unpacked.view(at::kInt), mirrored(bits)));
  auto in_place = a.clone();
  mirror_lower_(in_place);
  EXPECT_TRUE(at::equal(in_place.view(at::kInt), mirrored(bits)));
}

INSTANTIATE_TEST_SUITE_P(
    DtypesAndSizes, SymmetricRoundTrip,
    ::testing::Combine(::testing::Values(at::kFloat, at::kDouble, at::kBFloat16, at::kHalf),
                       // Around the CPU copies' 8×8 register blocks and 32-row bands:
                       // partial blocks on the diagonal and at the right edge, short bands.
                       ::testing::Values(1, 2, 5, 8, 9, 31, 33, 64, 129, 200)),
    [](const auto& info) {
      return shampoo::testing::test_name(std::string(c10::toString(std::get<0>(info.param))) + "_" +
                                         std::to_string(std::get<1>(info.param)));
    });

TEST(SymmetricLayout, SymmetricPartHasTheBitsOfTheAtenExpression) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    for (const int64_t d : {1, 2, 5, 31, 32, 33, 100, 130}) {
      auto a = at::randn({3, d, d}, gen).to(dtype) * 1e3;
      // Entries whose sum overflows (the diagonal's x + x too), a NaN and infinities.
      const double big = dtype == at::kFloat ? 3e38 : 1.7e308;
      a[0][0][0] = big;
      a[1][d - 1][0] = big;
      a[1][0][d - 1] = big;
      a[2][d / 2][d / 3] = std::numeric_limits<double>::quiet_NaN();
      a[2][d - 1][d - 1] = -std::numeric_limits<double>::infinity();
      const auto expected = (a + a.transpose(-2, -1)) * 0.5;
      auto in_place = a.clone();
      const auto out = shampoo::detail::symmetric_part(in_place);
      EXPECT_TRUE(out.is_same(in_place)) << "a contiguous CPU stack is changed in place";
      EXPECT_TRUE(bit_equal(out, expected)) << c10::toString(dtype) << " d " << d;
      // A transposed view goes through ATen.
      EXPECT_TRUE(bit_equal(shampoo::detail::symmetric_part(a.transpose(-2, -1)), expected));
    }
  }
}

class SymmetricStack : public ::testing::TestWithParam<bool /*packed*/> {};

TEST_P(SymmetricStack, BothLayoutsHoldTheSameMatrices) {
  const bool packed = GetParam();
  const int64_t n = 4, d = 6;
  SymmetricMatrices stack(n, d, at::TensorOptions().dtype(at::kFloat), packed,
                          /*identity=*/true);
  EXPECT_EQ(stack.bytes(), n * (packed ? packed_size(d) : d * d) * 4);
  EXPECT_TRUE(bit_equal(stack.dense_row(2), at::eye(d)));
  const auto value = at::randn({d, d});
  stack.assign_row(1, value);
  EXPECT_TRUE(bit_equal(stack.dense_row(1), mirrored(value)));
  Rows rows;
  rows.rows = {1, 3};
  const auto dense = stack.dense(rows);
  EXPECT_TRUE(bit_equal(dense[0], mirrored(value)));
  EXPECT_TRUE(bit_equal(dense[1], at::eye(d)));
  const auto max_abs = stack.max_abs();
  EXPECT_EQ(max_abs[1].item<double>(), mirrored(value).abs().max().item<double>());
  EXPECT_EQ(max_abs[0].item<double>(), 1.0);
}

TEST_P(SymmetricStack, ImportsEitherLayoutAndNamesBadShapes) {
  const bool packed = GetParam();
  const int64_t d = 5;
  SymmetricMatrices stack(2, d, at::TensorOptions().dtype(at::kFloat), packed, false);
  const auto value = at::randn({d, d});
  // A dense entry (checkpoints written before packing, or by an unpacked optimizer).
  stack.import_row(0, value, "root_0", "block 0");
  EXPECT_TRUE(bit_equal(stack.dense_row(0), mirrored(value)));
  // A packed entry.
  stack.import_row(1, pack_lower(value * 2), "root_0", "block 1");
  EXPECT_TRUE(bit_equal(stack.dense_row(1), mirrored(value * 2)));
  // What export gives is the stored layout, and it imports into the other layout unchanged.
  SymmetricMatrices other(1, d, at::TensorOptions().dtype(at::kFloat), !packed, false);
  other.import_row(0, stack.export_row(1), "root_0", "block 1");
  EXPECT_TRUE(bit_equal(other.dense_row(0), stack.dense_row(1)));
  shampoo::testing::expect_error(
      [&] {
        stack.import_row(0, at::zeros({d, d + 1}), "factor_1", "parameter 3 block 0");
      },
      {"parameter 3 block 0", "factor_1", "[5, 6]", "[5, 5]", "[15]"});
}

INSTANTIATE_TEST_SUITE_P(Layouts, SymmetricStack, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "packed" : "dense"; });

/// Random symmetric matrices [n, d, d] with entries over several orders of magnitude and a
/// dominant diagonal (as inverse roots have).
at::Tensor symmetric_stack(int64_t n, int64_t d, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto a = at::randn({n, d, d}, gen) * at::exp(at::randn({n, d, d}, gen) * 2);
  return mirrored(a) + at::eye(d) * 10;
}

class CompactStack : public ::testing::TestWithParam<std::tuple<CompactState, bool /*packed*/>> {};

TEST_P(CompactStack, DecodesWithinItsBoundAndReencodesExactly) {
  const auto [compact, packed] = GetParam();
  const int64_t n = 3, d = 37;
  const auto values = symmetric_stack(n, d, 5);
  SymmetricMatrices stack(n, d, at::TensorOptions().dtype(at::kFloat), packed, false, compact);
  for (int64_t r = 0; r < n; ++r) stack.assign_row(r, values[r]);
  const auto decoded = stack.dense(Rows::every(n));
  ASSERT_EQ(decoded.scalar_type(), at::kFloat);
  EXPECT_TRUE(bit_equal(decoded, mirrored(decoded)));  // symmetric
  const auto error = (decoded - values).abs();
  if (compact == CompactState::kBfloat16) {
    EXPECT_TRUE(bit_equal(decoded, values.to(at::kBFloat16).to(at::kFloat)));
  } else {
    // The diagonal exact; elsewhere at most half a step of its group's scale, which is below
    // max|x| / 127 · 2 (the power of two rounds up): |error| ≤ max|offdiag| / 127.
    EXPECT_TRUE(bit_equal(decoded.diagonal(0, 1, 2), values.diagonal(0, 1, 2)));
    const auto off = values - at::diag_embed(values.diagonal(0, 1, 2));
    EXPECT_LE(error.max().item<double>(), off.abs().max().item<double>() / 127.0);
    EXPECT_GT(error.max().item<double>(), 0.0);
  }
  // What a checkpoint holds (decoded entries) encodes back to the same bytes.
  SymmetricMatrices copy(n, d, at::TensorOptions().dtype(at::kFloat), packed, false, compact);
  for (int64_t r = 0; r < n; ++r) copy.import_row(r, stack.export_row(r), "root0", "test");
  EXPECT_TRUE(bit_equal(copy.dense(Rows::every(n)), decoded));
  for (int64_t r = 0; r < n; ++r) EXPECT_TRUE(bit_equal(copy.export_row(r), stack.export_row(r)));
  EXPECT_TRUE(bit_equal(stack.max_abs(), decoded.abs().amax({1, 2}).to(at::kDouble)));
}

TEST_P(CompactStack, IdentityStartAndZeros) {
  const auto [compact, packed] = GetParam();
  SymmetricMatrices eye(2, 5, at::TensorOptions().dtype(at::kFloat), packed, true, compact);
  EXPECT_TRUE(bit_equal(eye.dense(Rows::every(2)), at::eye(5).expand({2, 5, 5}).contiguous()));
  SymmetricMatrices zero(2, 5, at::TensorOptions().dtype(at::kFloat), packed, false, compact);
  zero.assign_row(1, at::zeros({5, 5}));
  EXPECT_TRUE(bit_equal(zero.dense(Rows::every(2)), at::zeros({2, 5, 5})));
}

INSTANTIATE_TEST_SUITE_P(
    Settings, CompactStack,
    ::testing::Combine(::testing::Values(CompactState::kBfloat16, CompactState::kInt8),
                       ::testing::Bool()),
    [](const auto& info) {
      return std::string(std::get<0>(info.param) == CompactState::kInt8 ? "int8" : "bf16") +
             (std::get<1>(info.param) ? "_packed" : "_dense");
    });

TEST(CompactStackBytes, ALargeRootInBfloat16AndEightBits) {
  const int64_t d = 1024;
  const auto options = at::TensorOptions().dtype(at::kFloat);
  const SymmetricMatrices full(1, d, options, true, false);
  const SymmetricMatrices bf16(1, d, options, true, false, CompactState::kBfloat16);
  const SymmetricMatrices int8(1, d, options, true, false, CompactState::kInt8);
  const int64_t p = packed_size(d);
  const int64_t groups = (p + kCompactGroup - 1) / kCompactGroup;
  EXPECT_EQ(full.bytes(), 4 * p);
  EXPECT_EQ(bf16.bytes(), 2 * p);
  EXPECT_EQ(int8.bytes(), groups * kCompactGroup + 4 * groups + 4 * d);
  EXPECT_LT(static_cast<double>(int8.bytes()) / static_cast<double>(full.bytes()), 0.27);
}

TEST(SymmetricLayoutCuda, MatchesTheCpuBitForBit) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const auto a = at::randn({3, 33, 33});
  const auto packed = pack_lower(a.cuda());
  EXPECT_TRUE(bit_equal(packed.cpu(), pack_lower(a)));
  EXPECT_TRUE(bit_equal(unpack_symmetric(packed, 33).cpu(), unpack_symmetric(pack_lower(a), 33)));
  auto mirrored_cuda = a.cuda();
  mirror_lower_(mirrored_cuda);
  EXPECT_TRUE(bit_equal(mirrored_cuda.cpu(), mirrored(a)));
  // Compact stacks decode to the same bits on either device.
  const auto values = symmetric_stack(2, 33, 9);
  for (const auto compact : {CompactState::kBfloat16, CompactState::kInt8}) {
    SymmetricMatrices cpu(2, 33, at::TensorOptions().dtype(at::kFloat), true, false, compact);
    SymmetricMatrices gpu(2, 33, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA), true,
                          false, compact);
    for (int64_t r = 0; r < 2; ++r) {
      cpu.assign_row(r, values[r]);
      gpu.assign_row(r, values[r].cuda());
    }
    EXPECT_TRUE(bit_equal(gpu.dense(Rows::every(2)).cpu(), cpu.dense(Rows::every(2))));
  }
}

/// Entries of every bit pattern class a copy must keep: normal values, ±0, ±inf and NaN.
at::Tensor awkward_values(at::IntArrayRef shape, at::ScalarType dtype) {
  auto a = at::randn(shape, at::kDouble);
  auto flat = a.view(-1);
  if (flat.numel() > 4) {
    flat[0] = -0.0;
    flat[1] = INFINITY;
    flat[2] = -INFINITY;
    flat[3] = NAN;
  }
  return dtype == at::kChar ? (a * 40).clamp(-127, 127).to(dtype) : a.to(dtype);
}

// The CUDA pack and unpack kernels (index arithmetic, tiles of 32 through shared memory): the
// CPU's bits for sizes around the tile edges and a factor-sized one, in 1-, 2-, 4- and 8-byte
// dtypes, several matrices per call.
TEST(SymmetricLayoutCuda, KernelsMatchTheCpuAtTileEdgesAndEveryElementSize) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  for (const auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kChar}) {
    for (const int64_t d : {1, 2, 31, 32, 33, 63, 64, 65, 100, 1024}) {
      const int64_t n = d >= 1024 ? 2 : 3;
      SCOPED_TRACE(std::string(c10::toString(dtype)) + " d=" + std::to_string(d));
      const auto a = awkward_values({n, d, d}, dtype);
      const auto packed = pack_lower(a.cuda());
      ASSERT_TRUE(bit_equal(packed.cpu(), pack_lower(a)));
      ASSERT_TRUE(bit_equal(unpack_symmetric(packed, d).cpu(), unpack_symmetric(pack_lower(a), d)));
    }
  }
  // A non-contiguous operand and a stack with extra leading dims.
  const auto a = at::randn({2, 3, 40, 40});
  const auto t = a.transpose(-2, -1);
  EXPECT_TRUE(bit_equal(pack_lower(t.cuda()).cpu(), pack_lower(t)));
  EXPECT_TRUE(bit_equal(unpack_symmetric(pack_lower(a).cuda(), 40).cpu(),
                        unpack_symmetric(pack_lower(a), 40)));
}

/// The packed factor update (one pass) against the ATen sequence it replaces (weight·outer, pack,
/// beta2·stored, +), bit for bit, in float and double, for per-row beta2 and weight, on `device`.
void expect_decay_add_equals_aten(const at::Device& device) {
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    for (const int64_t d : {1, 7, 33, 257, 1024}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + " d=" + std::to_string(d));
      const int64_t n = 3;
      const auto options = at::TensorOptions().dtype(dtype).device(device);
      const auto stored = at::randn({n, packed_size(d)}, options);
      const auto outer = at::randn({n, d, d}, options);
      const auto beta2 = at::rand({n, 1}, options);
      const auto weight = at::rand({n, 1, 1}, options) * 2;
      auto expected = stored.clone();
      expected.mul_(beta2).add_(pack_lower(outer * weight));
      auto fused = stored.clone();
      ASSERT_TRUE(decay_add_packed_(fused, outer, beta2, weight));
      EXPECT_TRUE(bit_equal(fused.cpu(), expected.cpu()));
      EXPECT_FALSE(bit_equal(fused.cpu(), stored.cpu()));
    }
  }
}

TEST(DecayAddPacked, EqualsTheAtenSequenceBitForBit) { expect_decay_add_equals_aten(at::kCPU); }

TEST(DecayAddPackedCuda, EqualsTheAtenSequenceBitForBit) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  expect_decay_add_equals_aten(at::kCUDA);
}

// Where the one pass does not apply, the function says so and leaves the entries alone: the
// caller's ATen sequence then runs (a dtype without the loop, mixed dtypes, a strided stack).
TEST(DecayAddPacked, DeclinesWhereItDoesNotApply) {
  auto stored_half = at::randn({2, packed_size(8)}).to(at::kHalf);
  const auto before_half = stored_half.clone();
  EXPECT_FALSE(decay_add_packed_(stored_half, at::randn({2, 8, 8}).to(at::kHalf),
                                 at::rand({2, 1}).to(at::kHalf),
                                 at::rand({2, 1, 1}).to(at::kHalf)));
  EXPECT_TRUE(bit_equal(stored_half, before_half));
  auto stored = at::randn({2, packed_size(8)});
  const auto before = stored.clone();
  EXPECT_FALSE(decay_add_packed_(stored, at::randn({2, 8, 8}, at::kDouble), at::rand({2, 1}),
                                 at::rand({2, 1, 1})));
  auto strided = at::randn({2, 2 * packed_size(8)}).narrow(1, 0, packed_size(8));
  EXPECT_FALSE(
      decay_add_packed_(strided, at::randn({2, 8, 8}), at::rand({2, 1}), at::rand({2, 1, 1})));
  EXPECT_TRUE(bit_equal(stored, before));
}

}  // namespace
