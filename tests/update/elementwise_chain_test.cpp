// The fused elementwise chain against a plain ATen formulation of docs/math.md steps 1, 2 (the
// diagonal statistics), 4 and 5-8, for every direction mode, with per-block scalars; the CPU's
// tiled loops against the per-element formulas bit for bit; the fused pass against pre + post;
// on CUDA the kernels against the CPU path.
#include "update/elementwise_chain.h"

#include <ATen/Context.h>

#include <cmath>
#include <cstring>
#include <random>

#include "support/test_support.h"
#include "update/elementwise_chain_cpu.h"

namespace {

using shampoo::detail::ChainBlockTensors;
using shampoo::kernels::ChainScalars;
using shampoo::kernels::DirectionMode;
using shampoo::testing::all_close;
using shampoo::testing::bit_equal;

struct BlockCase {
  at::Tensor grad, param, filter, diagonal, momentum, preconditioned;
  bool graft_statistics = false;  ///< V given (Adam-like grafting) or not (SGD grafting)
  ChainScalars s;
};

/// Scalars for block i of a test: every feature on or off depending on i.
ChainScalars scalars_for(int i, DirectionMode mode) {
  ChainScalars s;
  s.l2_weight_decay = (i % 2 == 0) ? 0.01 * (i + 1) : 0.0;
  s.beta1 = (i % 3 == 0) ? 0.0 : 0.8 + 0.01 * i;
  s.beta3 = (i % 4 == 1) ? 0.5 : s.beta1;
  s.separate_beta3 = s.beta1 != 0.0 && s.beta3 != s.beta1;
  s.filter_bias_correction = s.beta1 != 0.0 ? 1.0 - s.beta3 * std::pow(s.beta1, 2.0) : 1.0;
  s.diagonal_beta2 = 0.99;
  s.diagonal_weight = 0.01;
  s.diagonal_bias_correction = 1.0 - std::pow(0.99, 3.0);
  s.diagonal_epsilon = 1e-8;
  s.direction_mode = static_cast<int32_t>(mode);
  s.decoupled_weight_decay = (i % 2 == 1) ? 0.02 : 0.0;
  s.momentum = (i % 3 == 2) ? 0.0 : 0.9;
  s.dampening = (i % 4 == 3) ? 0.1 : 0.0;
  s.nesterov = i % 2;
  s.lr = 0.01 * (i + 1);
  return s;
}

std::vector<BlockCase> make_blocks(at::ScalarType dtype, DirectionMode mode, at::Device device) {
  std::vector<BlockCase> out;
  const std::vector<int64_t> sizes{1, 7, 40000, 333, 16384, 5};  // spans several chunks
  for (int i = 0; i < static_cast<int>(sizes.size()); ++i) {
    const auto o = at::TensorOptions().dtype(dtype).device(device);
    BlockCase b;
    b.grad = at::randn({sizes[i]}, o);
    b.param = at::randn({sizes[i]}, o);
    b.filter = at::randn({sizes[i]}, o) * 0.1;
    b.diagonal = at::rand({sizes[i]}, o);
    b.momentum = at::randn({sizes[i]}, o) * 0.1;
    b.preconditioned = at::randn({sizes[i]}, o);
    b.graft_statistics = i % 5 != 0;
    b.s = scalars_for(i, mode);
    out.push_back(b);
  }
  return out;
}

/// Fresh copies of every block's tensors on `device` (copies on the same device too).
std::vector<BlockCase> copy_blocks(const std::vector<BlockCase>& blocks, const at::Device& device) {
  const auto copy = [&](const at::Tensor& t) {
    return t.to(device, t.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
  };
  std::vector<BlockCase> out;
  for (const auto& x : blocks) {
    out.push_back({copy(x.grad), copy(x.param), copy(x.filter), copy(x.diagonal), copy(x.momentum),
                   copy(x.preconditioned), x.graft_statistics, x.s});
  }
  return out;
}

at::Tensor lerp_ref(const at::Tensor& a, const at::Tensor& b, double w) { return a + w * (b - a); }

/// docs/math.md in float64; returns {param, filter, diagonal, momentum, filtered} after the step.
std::vector<at::Tensor> reference(const BlockCase& c) {
  auto d = [](const at::Tensor& t) { return t.to(at::kDouble).cpu(); };
  const auto& s = c.s;
  auto w = d(c.param);
  auto g = d(c.grad) + s.l2_weight_decay * w;
  auto v = d(c.diagonal);
  if (c.graft_statistics) v = v * s.diagonal_beta2 + s.diagonal_weight * g * g;
  auto m = d(c.filter);
  at::Tensor filtered = g;
  if (s.beta1 != 0.0) {
    const auto m_prev = m;
    m = lerp_ref(m_prev, g, 1.0 - s.beta1);
    filtered = s.separate_beta3 ? lerp_ref(m_prev, g, 1.0 - s.beta3) : m;
    filtered = filtered / s.filter_bias_correction;
  }
  at::Tensor graft = filtered;
  if (c.graft_statistics) {
    graft = filtered / ((v / s.diagonal_bias_correction).sqrt() + s.diagonal_epsilon);
  }
  at::Tensor p;
  const auto pre = d(c.preconditioned);
  switch (static_cast<DirectionMode>(s.direction_mode)) {
    case DirectionMode::kDiagonal:
      p = graft;
      break;
    case DirectionMode::kGraftNorm:
      p = pre * (graft.norm().item<double>() / (pre.norm().item<double>() + 1e-16));
      break;
    case DirectionMode::kSign:
      p = filtered.sign();
      break;
    default:
      p = pre;
  }
  p = p + s.decoupled_weight_decay * w;
  auto b = d(c.momentum);
  if (s.momentum != 0.0) {
    b = s.momentum * b + (1.0 - s.dampening) * p;
    p = s.nesterov ? (1.0 - s.dampening) * p + s.momentum * b : b;
  }
  return {w - s.lr * p, m, v, b, filtered};
}

/// The chain over `blocks`: pre, norms and post, or (`fused`) the fused pass, which has no G′ and Ḡ
/// (`filtered` stays empty).
void run_chain(std::vector<BlockCase>& blocks, bool in_place, std::vector<at::Tensor>& updates,
               std::vector<at::Tensor>& filtered, bool fused = false) {
  std::vector<ChainBlockTensors> chain;
  updates.clear();
  filtered.clear();
  for (auto& b : blocks) {
    ChainBlockTensors c;
    c.grad = b.grad;
    c.param = b.param;
    if (!fused) {
      c.gradient_out = at::empty_like(b.grad);
      c.filtered_out = at::empty_like(b.grad);
      filtered.push_back(c.filtered_out);
    }
    if (b.s.beta1 != 0.0) c.filter_state = b.filter;
    if (b.graft_statistics) c.diagonal_state = b.diagonal;
    if (b.s.momentum != 0.0) c.momentum_state = b.momentum;
    c.preconditioned = b.preconditioned;
    if (in_place) {
      c.param_out = b.param;
    } else {
      c.update_out = at::empty_like(b.grad);
      updates.push_back(c.update_out);
    }
    c.scalars = b.s;
    chain.push_back(c);
  }
  if (fused) {
    shampoo::detail::run_chain_fused(chain);
    return;
  }
  shampoo::detail::run_chain_pre(chain);
  shampoo::detail::run_chain_norms(chain);
  shampoo::detail::run_chain_post(chain);
}

struct ChainCase {
  at::ScalarType dtype;
  DirectionMode mode;
};

class ElementwiseChain : public ::testing::TestWithParam<ChainCase> {};

TEST_P(ElementwiseChain, MatchesReferenceFormulas) {
  const auto [dtype, mode] = GetParam();
  at::manual_seed(3);
  auto blocks = make_blocks(dtype, mode, at::kCPU);
  std::vector<std::vector<at::Tensor>> expected;
  for (const auto& b : blocks) expected.push_back(reference(b));
  std::vector<at::Tensor> updates, filtered;
  run_chain(blocks, /*in_place=*/true, updates, filtered);
  const auto tol = shampoo::testing::tolerance_for(dtype);
  for (size_t i = 0; i < blocks.size(); ++i) {
    EXPECT_TRUE(all_close(blocks[i].param, expected[i][0], tol)) << "param, block " << i;
    if (blocks[i].s.beta1 != 0.0) {
      EXPECT_TRUE(all_close(blocks[i].filter, expected[i][1], tol)) << "filter, block " << i;
    }
    EXPECT_TRUE(all_close(blocks[i].diagonal, expected[i][2], tol)) << "diagonal, block " << i;
    if (blocks[i].s.momentum != 0.0) {
      EXPECT_TRUE(all_close(blocks[i].momentum, expected[i][3], tol)) << "momentum, block " << i;
    }
    EXPECT_TRUE(all_close(filtered[i], expected[i][4], tol)) << "filtered, block " << i;
  }
}

TEST_P(ElementwiseChain, UpdateOutEqualsInPlaceApplyBitForBit) {
  const auto [dtype, mode] = GetParam();
  at::manual_seed(4);
  auto a = make_blocks(dtype, mode, at::kCPU);
  auto b = copy_blocks(a, at::kCPU);
  std::vector<at::Tensor> updates, filtered;
  run_chain(a, /*in_place=*/true, updates, filtered);
  run_chain(b, /*in_place=*/false, updates, filtered);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(shampoo::testing::bit_equal(a[i].param, b[i].param.add(updates[i])));
  }
}

TEST_P(ElementwiseChain, CudaKernelsMatchCpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  if (!shampoo::detail::chain_has_cuda_kernels()) GTEST_SKIP() << "built without CUDA kernels";
  const auto [dtype, mode] = GetParam();
  at::manual_seed(5);
  auto cpu = make_blocks(dtype, mode, at::kCPU);
  auto gpu = copy_blocks(cpu, at::kCUDA);
  std::vector<at::Tensor> updates, filtered;
  run_chain(cpu, true, updates, filtered);
  run_chain(gpu, true, updates, filtered);
  const auto tol = shampoo::testing::tolerance_for(dtype);
  for (size_t i = 0; i < cpu.size(); ++i) {
    EXPECT_TRUE(all_close(gpu[i].param.cpu(), cpu[i].param, tol)) << "block " << i;
    EXPECT_TRUE(all_close(gpu[i].diagonal.cpu(), cpu[i].diagonal, tol)) << "block " << i;
    EXPECT_TRUE(all_close(gpu[i].momentum.cpu(), cpu[i].momentum, tol)) << "block " << i;
  }
}

// The ratios formed on the device (no host round trip) are the host's bits: the same partials,
// added in the same order, through the same formula.
TEST_P(ElementwiseChain, CudaRatiosOnTheDeviceEqualTheHostsBitForBit) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  if (!shampoo::detail::chain_has_cuda_kernels()) GTEST_SKIP() << "built without CUDA kernels";
  const auto [dtype, mode] = GetParam();
  at::manual_seed(6);
  auto device_ratios = make_blocks(dtype, mode, at::kCUDA);
  auto host_ratios = copy_blocks(device_ratios, at::kCUDA);
  ASSERT_TRUE(shampoo::detail::chain_norms_on_device());
  std::vector<at::Tensor> updates, filtered;
  run_chain(device_ratios, true, updates, filtered);
  shampoo::detail::set_chain_norms_on_device(false);
  run_chain(host_ratios, true, updates, filtered);
  shampoo::detail::set_chain_norms_on_device(true);
  for (size_t i = 0; i < device_ratios.size(); ++i) {
    EXPECT_TRUE(shampoo::testing::bit_equal(device_ratios[i].param, host_ratios[i].param))
        << "block " << i;
    EXPECT_TRUE(shampoo::testing::bit_equal(device_ratios[i].momentum, host_ratios[i].momentum))
        << "block " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, ElementwiseChain,
                         ::testing::Values(ChainCase{at::kFloat, DirectionMode::kPreconditioned},
                                           ChainCase{at::kFloat, DirectionMode::kDiagonal},
                                           ChainCase{at::kFloat, DirectionMode::kGraftNorm},
                                           ChainCase{at::kFloat, DirectionMode::kSign},
                                           ChainCase{at::kDouble, DirectionMode::kPreconditioned},
                                           ChainCase{at::kDouble, DirectionMode::kDiagonal},
                                           ChainCase{at::kDouble, DirectionMode::kGraftNorm},
                                           ChainCase{at::kDouble, DirectionMode::kSign}),
                         [](const auto& info) {
                           return std::string(info.param.dtype == at::kFloat ? "Float" : "Double") +
                                  "_mode" + std::to_string(static_cast<int>(info.param.mode));
                         });

// ----------------------------------------------------------------------------------------------
// The CPU's tiled loops against the per-element loops, and the fused pass against pre + post.
// ----------------------------------------------------------------------------------------------

/// One block of a random case: which tensors exist, how they alias, its scalars.
struct TileCase {
  int64_t numel = 0;
  bool l2 = false, filter = false, diagonal = false, momentum = false, averaging = false;
  bool preconditioned = false;
  bool in_place = true;         ///< param_out = param, else update_out
  bool gradient_out = true;     ///< G' written (pre pass)
  bool alias_filtered = false;  ///< filtered_out is gradient_out (no filter)
  bool alias_grad = false;      ///< grad is gradient_out (a column block copied in)
  bool alias_update = false;    ///< update_out is filtered_out (staging)
  ChainScalars s;
};

TileCase random_case(std::mt19937& rng) {
  auto coin = [&] { return std::uniform_int_distribution<int>(0, 1)(rng) == 1; };
  auto pick = [&](std::vector<double> values) {
    return values[std::uniform_int_distribution<size_t>(0, values.size() - 1)(rng)];
  };
  TileCase c;
  c.numel = static_cast<int64_t>(pick({1, 3, 255, 256, 257, 700, 16387}));
  c.l2 = coin();
  c.filter = coin();
  c.diagonal = coin();
  c.momentum = coin();
  c.averaging = !c.momentum && coin();
  c.in_place = coin();
  c.gradient_out = coin();
  c.alias_filtered = !c.filter && c.gradient_out && coin();
  c.alias_grad = c.gradient_out && coin();
  c.alias_update = !c.in_place && coin();
  auto& s = c.s;
  s.direction_mode = static_cast<int32_t>(pick({0, 1, 2, 3}));
  c.preconditioned = s.direction_mode == static_cast<int32_t>(DirectionMode::kGraftNorm) ||
                     (s.direction_mode == 0 && coin());
  s.l2_weight_decay = c.l2 ? 0.03 : 0.0;
  // Weights 1 − β on both sides of 0.5: torch.lerp's two formulas.
  s.beta1 = c.filter ? pick({0.9, 0.3}) : 0.0;
  s.separate_beta3 = c.filter && coin();
  s.beta3 = s.separate_beta3 ? pick({0.95, 0.2}) : s.beta1;
  s.filter_bias_correction = c.filter && coin() ? 1.0 - s.beta3 * 0.81 : 1.0;
  s.diagonal_beta2 = pick({0.999, 1.0});
  s.diagonal_weight = pick({0.001, 1.0});
  s.diagonal_bias_correction = pick({1.0, 0.0297});
  s.diagonal_epsilon = pick({1e-8, 0.0});
  s.graft_ratio = 0.7;
  s.decoupled_weight_decay = coin() ? 0.02 : 0.0;
  s.momentum = c.momentum ? 0.9 : 0.0;
  s.dampening = coin() ? 0.1 : 0.0;
  s.nesterov = coin() ? 1 : 0;
  s.lr = 0.01;
  s.output_updated_param = !c.in_place && coin() ? 1 : 0;
  s.averaging = c.averaging ? 1 : 0;
  s.average_decay = 0.999;
  s.average_step = 0.28;
  s.average_pull = 0.1;
  return c;
}

/// The tensors of a case, and the kernel block over them; copy() duplicates every tensor (keeping
/// the aliasing).
template <typename T>
struct TileTensors {
  TileCase c;
  at::Tensor grad, param, gradient_out, filtered_out, filter, diagonal, preconditioned, momentum,
      average, update_out;

  static TileTensors make(const TileCase& c, at::ScalarType dtype) {
    const auto o = at::TensorOptions().dtype(dtype);
    TileTensors t;
    t.c = c;
    t.param = at::randn({c.numel}, o);
    t.gradient_out = c.gradient_out ? at::randn({c.numel}, o) : at::Tensor();
    t.grad = c.alias_grad ? t.gradient_out : at::randn({c.numel}, o);
    // Ḡ as a pre pass would leave it (the post pass alone reads it).
    t.filtered_out = c.alias_filtered ? t.gradient_out : at::randn({c.numel}, o);
    if (c.filter) t.filter = at::randn({c.numel}, o) * 0.1;
    if (c.diagonal) t.diagonal = at::rand({c.numel}, o);
    if (c.preconditioned) t.preconditioned = at::randn({c.numel}, o);
    if (c.momentum) t.momentum = at::randn({c.numel}, o) * 0.1;
    if (c.averaging) t.average = at::randn({c.numel}, o);
    if (!c.in_place) t.update_out = c.alias_update ? t.filtered_out : at::empty({c.numel}, o);
    return t;
  }

  TileTensors copy() const {
    TileTensors t = *this;
    auto dup = [](const at::Tensor& x) { return x.defined() ? x.clone() : x; };
    t.param = dup(param);
    t.gradient_out = dup(gradient_out);
    t.grad = c.alias_grad ? t.gradient_out : dup(grad);
    t.filtered_out = c.alias_filtered ? t.gradient_out : dup(filtered_out);
    t.filter = dup(filter);
    t.diagonal = dup(diagonal);
    t.preconditioned = dup(preconditioned);
    t.momentum = dup(momentum);
    t.average = dup(average);
    t.update_out = c.in_place ? at::Tensor() : (c.alias_update ? t.filtered_out : dup(update_out));
    return t;
  }

  std::vector<at::Tensor> all() const {
    std::vector<at::Tensor> out;
    for (const auto& x : {grad, param, gradient_out, filtered_out, filter, diagonal, momentum,
                          average, update_out}) {
      out.push_back(x.defined() ? x : at::zeros({0}));
    }
    return out;
  }

  /// `fused`: no G' and Ḡ (as the fused pass runs).
  shampoo::kernels::ChainBlock<T> block(bool fused) const {
    auto p = [](const at::Tensor& x) { return x.defined() ? x.data_ptr<T>() : nullptr; };
    shampoo::kernels::ChainBlock<T> b;
    b.numel = c.numel;
    b.grad = p(grad);
    b.param = p(param);
    b.gradient_out = fused ? nullptr : p(gradient_out);
    b.filtered_out = fused ? nullptr : p(filtered_out);
    b.filter_state = p(filter);
    b.diagonal_state = p(diagonal);
    b.preconditioned = p(preconditioned);
    b.momentum_state = p(momentum);
    b.average_state = p(average);
    b.param_out = c.in_place ? p(param) : nullptr;
    b.update_out = p(update_out);
    b.s = c.s;
    return b;
  }
};

template <typename T>
void check_tiles_equal_elements(at::ScalarType dtype, shampoo::kernels::ChainIsa isa) {
  namespace k = shampoo::kernels;
  const auto tiles = k::chain_tiles<T>(isa);
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    const auto c = random_case(rng);
    at::manual_seed(trial);
    const auto a = TileTensors<T>::make(c, dtype);
    const auto pre_element = a.copy();
    const auto pre_tiles = a.copy();
    k::chain_pre_range(pre_element.block(false), 0, c.numel);
    tiles.pre(pre_tiles.block(false), 0, c.numel);
    ASSERT_TRUE(bit_equal(pre_tiles.all(), pre_element.all())) << "pre pass, case " << trial;
    const auto post_element = a.copy();
    const auto post_tiles = a.copy();
    k::chain_post_range(post_element.block(false), 0, c.numel);
    tiles.post(post_tiles.block(false), 0, c.numel);
    ASSERT_TRUE(bit_equal(post_tiles.all(), post_element.all())) << "post pass, case " << trial;
    if (c.preconditioned) {
      double element_sums[2] = {0.0, 0.0};
      double tile_sums[2] = {0.0, 0.0};
      k::chain_norm_range(a.block(false), 0, c.numel, element_sums[0], element_sums[1]);
      tiles.norms(a.block(false), 0, c.numel, tile_sums[0], tile_sums[1]);
      ASSERT_EQ(std::memcmp(tile_sums, element_sums, sizeof(tile_sums)), 0)
          << "norm pass, case " << trial << ": " << tile_sums[0] << ", " << tile_sums[1]
          << " against " << element_sums[0] << ", " << element_sums[1];
      continue;  // the fused pass has no matrix preconditioner
    }
    const auto fused_element = a.copy();
    const auto fused_tiles = a.copy();
    k::chain_fused_range(fused_element.block(true), 0, c.numel);
    tiles.fused(fused_tiles.block(true), 0, c.numel);
    ASSERT_TRUE(bit_equal(fused_tiles.all(), fused_element.all())) << "fused pass, case " << trial;
  }
}

TEST(ElementwiseChainTiles, TiledLoopsEqualPerElementFormulasBitForBit) {
  // Every instruction set this build has and this CPU runs (on x86-64: baseline, AVX2, AVX-512).
  const auto isas = shampoo::kernels::chain_isas_available();
  EXPECT_EQ(isas.back(), shampoo::kernels::chain_isa());
  for (const auto isa : isas) {
    SCOPED_TRACE(shampoo::kernels::chain_isa_name(isa));
    check_tiles_equal_elements<float>(at::kFloat, isa);
    check_tiles_equal_elements<double>(at::kDouble, isa);
  }
}

TEST(ElementwiseChainTiles, FusedPassEqualsPreThenPostBitForBit) {
  for (const auto mode :
       {DirectionMode::kPreconditioned, DirectionMode::kDiagonal, DirectionMode::kSign}) {
    for (const bool in_place : {true, false}) {
      at::manual_seed(6);
      auto a = make_blocks(at::kFloat, mode, at::kCPU);
      std::vector<BlockCase> b;
      for (const auto& x : a) {
        b.push_back({x.grad.clone(), x.param.clone(), x.filter.clone(), x.diagonal.clone(),
                     x.momentum.clone(), at::Tensor(), x.graft_statistics, x.s});
      }
      std::vector<at::Tensor> updates, filtered, fused_updates;
      for (auto& x : a) x.preconditioned = at::Tensor();
      run_chain(a, in_place, updates, filtered);  // pre, norms (none), post
      run_chain(b, in_place, fused_updates, filtered, /*fused=*/true);
      for (size_t i = 0; i < a.size(); ++i) {
        const auto where = "mode " + std::to_string(static_cast<int>(mode)) + ", block " +
                           std::to_string(i) + (in_place ? ", in place" : ", update out");
        EXPECT_TRUE(bit_equal(b[i].param, a[i].param)) << where;
        EXPECT_TRUE(bit_equal(b[i].filter, a[i].filter)) << where;
        EXPECT_TRUE(bit_equal(b[i].diagonal, a[i].diagonal)) << where;
        EXPECT_TRUE(bit_equal(b[i].momentum, a[i].momentum)) << where;
        if (!in_place) {
          EXPECT_TRUE(bit_equal(fused_updates[i], updates[i])) << where;
        }
      }
    }
  }
}

// ----------------------------------------------------------------------------------------------
// Views of rows (a column block of a matrix), read and written where they lie on the CPU.
// ----------------------------------------------------------------------------------------------

TEST(ElementwiseChainViews, TakesRowsOfContiguousElementsThatDoNotOverlap) {
  using shampoo::detail::chain_takes_view;
  using shampoo::detail::kChainMinRow;
  const auto m = at::randn({8, 200});
  EXPECT_TRUE(chain_takes_view(m));
  EXPECT_TRUE(chain_takes_view(m.narrow(1, 10, 100)));  // a column block
  EXPECT_TRUE(chain_takes_view(at::randn({4, 30, 150}).narrow(1, 5, 20).narrow(2, 10, 100)));
  EXPECT_FALSE(chain_takes_view(m.narrow(1, 0, kChainMinRow - 1)));      // rows too short
  EXPECT_FALSE(chain_takes_view(m.t()));                                 // a transpose
  EXPECT_FALSE(chain_takes_view(at::randn({1, 100}).expand({5, 100})));  // one row five times
  EXPECT_FALSE(chain_takes_view(m.as_strided({8, 100}, {50, 1})));       // rows overlap
  shampoo::detail::set_chain_views(false);
  EXPECT_FALSE(chain_takes_view(m.narrow(1, 10, 100)));
  EXPECT_TRUE(chain_takes_view(m));
  shampoo::detail::set_chain_views(true);
}

/// A parameter or gradient block cut from a larger tensor: the view and what it is cut from.
struct CutBlock {
  at::Tensor whole, view;
};

/// Block i's view in `whole`: a column block of a 300×260 matrix (rows of 200, several work items
/// of whole rows, the last one short) or a 3-D block with two sliced dimensions.
at::Tensor cut_block_view(const at::Tensor& whole, int i) {
  return i % 2 == 0 ? whole.narrow(1, 30, 200) : whole.narrow(1, 5, 20).narrow(2, 10, 100);
}

CutBlock cut_block(int i, at::ScalarType dtype) {
  const auto o = at::TensorOptions().dtype(dtype);
  auto whole = i % 2 == 0 ? at::randn({300, 260}, o) : at::randn({4, 30, 150}, o);
  return {whole, cut_block_view(whole, i)};
}

TEST(ElementwiseChainViews, ViewsGiveTheBitsOfContiguousCopiesAndTouchNothingElse) {
  for (const auto dtype : {at::kFloat, at::kDouble}) {
    for (const auto mode : {DirectionMode::kPreconditioned, DirectionMode::kDiagonal,
                            DirectionMode::kGraftNorm, DirectionMode::kSign}) {
      for (const int pass : {0, 1, 2}) {  // pre + norms + post in place; with update_out; fused
        const bool fused = pass == 2;
        if (fused && mode == DirectionMode::kGraftNorm) continue;
        const auto where = std::string(dtype == at::kFloat ? "float" : "double") + ", mode " +
                           std::to_string(static_cast<int>(mode)) + ", pass " +
                           std::to_string(pass);
        at::manual_seed(20 + pass);
        std::vector<BlockCase> views, copies;
        std::vector<CutBlock> params, grads;
        std::vector<at::Tensor> params_before;
        for (int i = 0; i < 6; ++i) {
          params.push_back(cut_block(i, dtype));
          // Blocks 0-3 read the gradient in place too; 4 and 5 only the parameter.
          grads.push_back(i < 4 ? cut_block(i, dtype) : CutBlock{});
          params_before.push_back(params.back().whole.clone());
          const auto& view = params.back().view;
          const auto o = view.options();
          BlockCase b;
          b.grad = i < 4 ? grads.back().view : at::randn(view.sizes(), o);
          b.param = view;
          b.filter = at::randn(view.sizes(), o) * 0.1;
          b.diagonal = at::rand(view.sizes(), o);
          b.momentum = at::randn(view.sizes(), o) * 0.1;
          if (!fused) b.preconditioned = at::randn(view.sizes(), o);
          b.graft_statistics = i % 3 != 2;
          b.s = scalars_for(i, mode);
          views.push_back(b);
        }
        for (const auto& b : views) {
          const auto dup = [](const at::Tensor& t) {
            return t.defined() ? t.clone(at::MemoryFormat::Contiguous) : t;
          };
          copies.push_back({dup(b.grad), dup(b.param), dup(b.filter), dup(b.diagonal),
                            dup(b.momentum), dup(b.preconditioned), b.graft_statistics, b.s});
        }
        std::vector<at::Tensor> view_updates, view_filtered, copy_updates, copy_filtered;
        run_chain(views, pass != 1, view_updates, view_filtered, fused);
        run_chain(copies, pass != 1, copy_updates, copy_filtered, fused);
        for (size_t i = 0; i < views.size(); ++i) {
          const auto block = where + ", block " + std::to_string(i);
          // The whole tensor: the view holds the copy's result, every other element its own.
          auto expected = params_before[i].clone();
          if (pass != 1) {
            cut_block_view(expected, static_cast<int>(i)).copy_(copies[i].param);
          }
          EXPECT_TRUE(bit_equal(params[i].whole, expected)) << block;
          EXPECT_TRUE(bit_equal(views[i].filter, copies[i].filter)) << block;
          EXPECT_TRUE(bit_equal(views[i].diagonal, copies[i].diagonal)) << block;
          EXPECT_TRUE(bit_equal(views[i].momentum, copies[i].momentum)) << block;
          if (!fused) {
            EXPECT_TRUE(bit_equal(view_filtered[i], copy_filtered[i])) << block;
          }
          if (pass == 1) {
            EXPECT_TRUE(bit_equal(view_updates[i], copy_updates[i])) << block;
          }
          if (i < 4) {  // read only
            EXPECT_TRUE(bit_equal(views[i].grad, copies[i].grad)) << block;
          }
        }
      }
    }
  }
}

TEST(ElementwiseChainChecks, RejectsMismatchedTensors) {
  ChainBlockTensors c;
  c.grad = at::randn({4});
  c.param = at::randn({5});
  c.filtered_out = at::empty({4});
  EXPECT_THROW(shampoo::detail::run_chain_pre({c}), c10::Error);
  c.param = at::randn({4}, at::kDouble);
  EXPECT_THROW(shampoo::detail::run_chain_pre({c}), c10::Error);
  c.param = at::randn({8}).narrow(0, 0, 8).view({2, 4}).t().reshape({8}).narrow(0, 0, 4);
  c.grad = at::randn({8}).view({4, 2}).select(1, 0);  // not contiguous
  EXPECT_THROW(shampoo::detail::run_chain_pre({c}), c10::Error);
  // Rows shorter than the chain takes, and a view where only grad, param and param_out may be.
  c.param = at::Tensor();
  c.grad = at::randn({4, 20}).narrow(1, 0, 10);
  c.filtered_out = at::empty({4, 10});
  EXPECT_THROW(shampoo::detail::run_chain_pre({c}), c10::Error);
  c.grad = at::randn({2, 80}).narrow(1, 0, 70);
  c.filtered_out = at::empty({2, 90}).narrow(1, 0, 70);
  EXPECT_THROW(shampoo::detail::run_chain_pre({c}), c10::Error);
  c.filtered_out = at::empty({2, 70});
  EXPECT_NO_THROW(shampoo::detail::run_chain_pre({c}));
}

}  // namespace
