// The fused elementwise chain against a plain ATen formulation of docs/math.md steps 1, 2 (the
// diagonal statistics), 4 and 5-8, for every direction mode, with per-block scalars; on CUDA the
// kernels against the CPU path.
#include "update/elementwise_chain.h"

#include <ATen/Context.h>

#include <cmath>

#include "support/test_support.h"

namespace {

using shampoo::detail::ChainBlockTensors;
using shampoo::kernels::ChainScalars;
using shampoo::kernels::DirectionMode;
using shampoo::testing::all_close;

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
    case DirectionMode::kGraft:
      p = graft;
      break;
    case DirectionMode::kGraftNorm:
      p = pre * (graft.norm().item<double>() / (pre.norm().item<double>() + 1e-16));
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

void run_chain(std::vector<BlockCase>& blocks, bool in_place, std::vector<at::Tensor>& updates,
               std::vector<at::Tensor>& filtered) {
  std::vector<ChainBlockTensors> chain;
  updates.clear();
  filtered.clear();
  for (auto& b : blocks) {
    ChainBlockTensors c;
    c.grad = b.grad;
    c.param = b.param;
    c.gradient_out = at::empty_like(b.grad);
    c.filtered_out = at::empty_like(b.grad);
    filtered.push_back(c.filtered_out);
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
  std::vector<BlockCase> b;
  for (const auto& x : a) {
    b.push_back({x.grad.clone(), x.param.clone(), x.filter.clone(), x.diagonal.clone(),
                 x.momentum.clone(), x.preconditioned.clone(), x.graft_statistics, x.s});
  }
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
  std::vector<BlockCase> gpu;
  for (const auto& x : cpu) {
    gpu.push_back({x.grad.cuda(), x.param.cuda(), x.filter.cuda(), x.diagonal.cuda(),
                   x.momentum.cuda(), x.preconditioned.cuda(), x.graft_statistics, x.s});
  }
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

INSTANTIATE_TEST_SUITE_P(Modes, ElementwiseChain,
                         ::testing::Values(ChainCase{at::kFloat, DirectionMode::kPreconditioned},
                                           ChainCase{at::kFloat, DirectionMode::kGraft},
                                           ChainCase{at::kFloat, DirectionMode::kGraftNorm},
                                           ChainCase{at::kDouble, DirectionMode::kPreconditioned},
                                           ChainCase{at::kDouble, DirectionMode::kGraft},
                                           ChainCase{at::kDouble, DirectionMode::kGraftNorm}),
                         [](const auto& info) {
                           return std::string(info.param.dtype == at::kFloat ? "Float" : "Double") +
                                  "_mode" + std::to_string(static_cast<int>(info.param.mode));
                         });

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
}

}  // namespace
