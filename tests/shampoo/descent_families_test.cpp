// The descent and diagonal preconditioner families (spectral descent, sign descent, SGD,
// AdaGrad, RMSprop and Adam as the main preconditioner) through DistributedShampoo:
// - an independent float64 reference of full steps written from docs/math.md (plain ATen, one
//   block at a time), compared after every step;
// - closed forms of one step (sign descent of a known block, spectral descent of a diagonal one);
// - the diagonal families against LibTorch's own optimizers (Adam, AdamW, Adagrad, RMSprop, SGD);
// - merged ≡ unmerged, world 2 ≡ one process, resumed ≡ uninterrupted, in backward ≡ ordinary
//   step, bit for bit; CUDA ≡ CPU (skipped without a GPU);
// - the chain's fused pass (the elementwise families without grafting, on the CPU) ≡ the three
//   passes with the list's own update and direction.
#include <shampoo/shampoo.h>
#include <torch/cuda.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <cmath>
#include <filesystem>
#include <functional>

#include "shampoo/virtual_group.h"
#include "support/device_parity.h"
#include "support/test_support.h"

namespace {

using shampoo::DistributedOptions;
using shampoo::DistributedShampoo;
using shampoo::ShampooOptions;
using shampoo::testing::all_close;
using shampoo::testing::bit_equal;
using shampoo::testing::clone_params;
using shampoo::testing::snapshot;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

constexpr int64_t kMaxDim = 6;

struct FamilyCase {
  std::string name;
  shampoo::PreconditionerConfig config;
};

void PrintTo(const FamilyCase& c, std::ostream* os) { *os << c.name; }

std::vector<FamilyCase> families() {
  using shampoo::OrthogonalizationMethod;
  return {
      {"spectral_newton_schulz", shampoo::SpectralDescentConfig{}},
      {"spectral_convergent_7",
       shampoo::SpectralDescentConfig{.num_iterations = 7, .coefficients = {3.0, -3.2, 1.2}}},
      {"spectral_svd_nuclear_aspect",
       shampoo::SpectralDescentConfig{.method = OrthogonalizationMethod::kSVD,
                                      .scale_by_nuclear_norm = true,
                                      .scale = shampoo::OrthogonalizationScale::kSqrtAspectRatio}},
      {"sign_one", shampoo::SignDescentConfig{}},
      {"sign_l1", shampoo::SignDescentConfig{shampoo::SignDescentScale::kL1Norm}},
      {"sgd", shampoo::SGDPreconditionerConfig{}},
      {"adagrad", shampoo::AdaGradPreconditionerConfig{1e-4}},
      {"rmsprop", shampoo::RMSpropPreconditionerConfig{0.9, 1e-4, false}},
      {"rmsprop_drop", shampoo::RMSpropPreconditionerConfig{0.9, 1e-4, true}},
      {"adam", shampoo::AdamPreconditionerConfig{0.95, 1e-4, false}},
      {"adam_drop", shampoo::AdamPreconditionerConfig{0.95, 1e-4, true}},
  };
}

bool spectral(const FamilyCase& c) {
  return std::holds_alternative<shampoo::SpectralDescentConfig>(c.config);
}

/// Parameters: a blocked matrix (6×10 → 6×6 and 6×4), a small matrix (spectral) or a vector split
/// in two blocks (others), and a 3-D weight that blocking merges to 4×6.
std::vector<at::Tensor> make_params(const FamilyCase& c, uint64_t seed,
                                    at::ScalarType dtype = at::kFloat) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const std::vector<int64_t> second =
      spectral(c) ? std::vector<int64_t>{5, 3} : std::vector<int64_t>{7};
  std::vector<at::Tensor> params;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{6, 10}, second, {4, 3, 2}}) {
    params.push_back(at::randn(shape, gen).to(dtype).requires_grad_());
  }
  return params;
}

/// Options under which every part of the step matters: β1 filtering with bias correction,
/// momentum, decoupled weight decay; the group's ε and β2 differ from the families' own.
ShampooOptions family_options(const FamilyCase& c) {
  return ShampooOptions::reference_defaults(0.05)
      .betas({0.9, 0.5})
      .epsilon(1e-3)
      .momentum(0.5)
      .weight_decay(1e-2)
      .max_preconditioner_dim(kMaxDim)
      .preconditioner(c.config);
}

void set_grads(const std::vector<at::Tensor>& params, int step) {
  shampoo::testing::set_random_grads(params, 700 + step);
}

// ----------------------------------------------------------------------------------------------
// The float64 reference (docs/math.md), written directly: one block at a time.
// ----------------------------------------------------------------------------------------------

/// Views of the blocks of a merged parameter: every dim cut into chunks of at most kMaxDim.
std::vector<at::Tensor> blocks_of(const at::Tensor& merged) {
  std::vector<at::Tensor> blocks{merged};
  for (int64_t d = 0; d < merged.dim(); ++d) {
    std::vector<at::Tensor> next;
    for (const auto& b : blocks) {
      for (int64_t start = 0; start < b.size(d); start += kMaxDim) {
        next.push_back(b.narrow(d, start, std::min(kMaxDim, b.size(d) - start)));
      }
    }
    blocks = std::move(next);
  }
  return blocks;
}

/// Shapes after blocking's merge (docs/math.md): 6×10, 5×3 or 7, and 4×3×2 → 4×6.
at::Tensor merged_view(const at::Tensor& t) { return t.dim() == 3 ? t.reshape({4, 6}) : t; }

/// Newton–Schulz as docs/math.md writes it: X ← a·X + b·(XXᵀ)X + c·(XXᵀ)²X from X/‖X‖_F.
at::Tensor reference_newton_schulz(const at::Tensor& g, const shampoo::SpectralDescentConfig& c) {
  auto x = g / std::max(g.norm().item<double>(), 1e-8);
  for (int64_t i = 0; i < c.num_iterations; ++i) {
    const auto a = at::mm(x, x.t());
    x = c.coefficients[0] * x + c.coefficients[1] * at::mm(a, x) +
        c.coefficients[2] * at::mm(a, at::mm(a, x));
  }
  return x;
}

at::Tensor reference_spectral(const at::Tensor& g, const shampoo::SpectralDescentConfig& c) {
  at::Tensor out;
  if (c.method == shampoo::OrthogonalizationMethod::kSVD) {
    const auto [u, s, vh] = at::linalg_svd(g, false);
    out = at::mm(u, vh) * (c.scale_by_nuclear_norm ? s.sum().item<double>() : 1.0);
  } else {
    out = reference_newton_schulz(g, c);
  }
  if (c.scale == shampoo::OrthogonalizationScale::kSqrtAspectRatio) {
    out = out * std::sqrt(std::max(1.0, double(g.size(0)) / double(g.size(1))));
  }
  return out;
}

/// The diagonal families' (β2, weight, bias correction, ε); has_state false for SGD.
struct Diagonal {
  bool has_state = false;
  double beta2 = 1.0, weight = 1.0, epsilon = 0.0;
  bool bias_correction = false;
};
Diagonal diagonal_of(const shampoo::PreconditionerConfig& config) {
  if (const auto* c = std::get_if<shampoo::AdaGradPreconditionerConfig>(&config)) {
    return {true, 1.0, 1.0, c->epsilon, false};
  }
  auto moving = [](const auto& c, bool adam) {
    const bool drop = c.drop_weighting_factor_on_gsquare;
    return Diagonal{true, c.beta2, drop ? 1.0 : 1.0 - c.beta2, c.epsilon, adam && !drop};
  };
  if (const auto* c = std::get_if<shampoo::RMSpropPreconditionerConfig>(&config)) {
    return moving(*c, false);
  }
  if (const auto* c = std::get_if<shampoo::AdamPreconditionerConfig>(&config)) {
    return moving(*c, true);
  }
  return {};
}

/// The direction P of one block from its filtered gradient (and V for the diagonal families).
at::Tensor reference_direction(const shampoo::PreconditionerConfig& config, const at::Tensor& g,
                               const at::Tensor& v, int64_t t) {
  if (const auto* c = std::get_if<shampoo::SpectralDescentConfig>(&config)) {
    return reference_spectral(g, *c);
  }
  if (const auto* c = std::get_if<shampoo::SignDescentConfig>(&config)) {
    const double scale =
        c->scale == shampoo::SignDescentScale::kL1Norm ? g.abs().sum().item<double>() : 1.0;
    return g.sign() * scale;
  }
  const auto d = diagonal_of(config);
  if (!d.has_state) return g;
  const double bc2 = d.bias_correction ? 1.0 - std::pow(d.beta2, double(t)) : 1.0;
  return g / ((v / bc2).sqrt() + d.epsilon);
}

struct ReferenceParam {
  at::Tensor w, v, m, b;  // parameter, second moment, filter, momentum (float64)
};

/// One step of docs/math.md for one parameter under family_options(c) (decoupled weight decay).
void reference_step(const ShampooOptions& o, ReferenceParam& p, const at::Tensor& grad, int64_t t) {
  const auto [beta1, unused] = o.betas();
  const auto d = diagonal_of(o.preconditioner());
  p.v = p.v * d.beta2 + d.weight * grad * grad;  // statistics from G′
  p.m = p.m + (1.0 - beta1) * (grad - p.m);      // lerp(M, G, 1 − β1)
  const auto filtered = p.m / (1.0 - std::pow(beta1, double(t)));
  auto direction = at::empty_like(filtered);
  const auto gm = merged_view(filtered), vm = merged_view(p.v), dm = merged_view(direction);
  const auto gb = blocks_of(gm), vb = blocks_of(vm), db = blocks_of(dm);
  for (size_t i = 0; i < gb.size(); ++i) {
    db[i].copy_(reference_direction(o.preconditioner(), gb[i], vb[i], t));
  }
  direction = direction + o.weight_decay() * p.w;
  p.b = o.momentum() * p.b + direction;
  p.w = p.w - o.lr() * p.b;
}

class FamilyReference : public ::testing::TestWithParam<FamilyCase> {};

TEST_P(FamilyReference, FullStepsMatchTheFloat64Reference) {
  const auto& c = GetParam();
  const auto options = family_options(c);
  auto params = make_params(c, 1, at::kDouble);
  std::vector<ReferenceParam> reference;
  for (const auto& p : params) {
    const auto w = p.detach().clone();
    reference.push_back({w, at::zeros_like(w), at::zeros_like(w), at::zeros_like(w)});
  }
  const auto start = snapshot(params);
  DistributedShampoo optimizer(params, options);
  for (int t = 1; t <= 6; ++t) {
    set_grads(params, t);
    optimizer.step();
    for (size_t i = 0; i < params.size(); ++i) {
      reference_step(options, reference[i], params[i].grad(), t);
      ASSERT_TRUE(all_close(params[i].detach(), reference[i].w))
          << c.name << " step " << t << " parameter " << i;
    }
  }
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_GT((params[i].detach() - start[i]).abs().max().item<double>(), 1e-2)
        << "parameter " << i;
  }
  EXPECT_EQ(optimizer.stats().amortized_computations, 0);
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyReference, ::testing::ValuesIn(families()),
                         [](const auto& info) { return info.param.name; });

// ----------------------------------------------------------------------------------------------
// Closed forms of one step (plain: no filter, momentum or weight decay).
// ----------------------------------------------------------------------------------------------

at::Tensor one_plain_step(const shampoo::PreconditionerConfig& config, const at::Tensor& w0,
                          const at::Tensor& grad) {
  auto w = w0.clone().requires_grad_();
  DistributedShampoo optimizer(
      {w}, ShampooOptions::reference_defaults(0.5).betas({0.0, 1.0}).preconditioner(config));
  w.mutable_grad() = grad;
  optimizer.step();
  return (w0 - w.detach()) / 0.5;  // the direction P
}

TEST(DescentClosedForm, SignDescentOfAKnownBlock) {
  const auto g = at::tensor({1.0, -2.0, 0.0, 3.0, -0.25, 0.5}).view({2, 3});
  const auto w0 = at::ones({2, 3}, at::kDouble);
  const auto signs = at::tensor({1.0, -1.0, 0.0, 1.0, -1.0, 1.0}).view({2, 3});
  EXPECT_TRUE(all_close(one_plain_step(shampoo::SignDescentConfig{}, w0, g), signs));
  // L1 scale: Σ|g| = 6.75.
  EXPECT_TRUE(all_close(
      one_plain_step(shampoo::SignDescentConfig{shampoo::SignDescentScale::kL1Norm}, w0, g),
      signs * 6.75));
}

TEST(DescentClosedForm, SpectralDescentOfADiagonalBlockIsItsSign) {
  const auto g = at::diag(at::tensor({2.0, -0.5, 1.0}));
  const auto w0 = at::zeros({3, 3}, at::kDouble);
  const auto sign = at::diag(at::tensor({1.0, -1.0, 1.0}));
  EXPECT_TRUE(all_close(
      one_plain_step(
          shampoo::SpectralDescentConfig{.method = shampoo::OrthogonalizationMethod::kSVD}, w0, g),
      sign));
  // Newton–Schulz with p(1) = 1 and enough iterations converges to the same (to 1e-9).
  const auto ns = one_plain_step(
      shampoo::SpectralDescentConfig{.num_iterations = 40, .coefficients = {3.0, -3.2, 1.2}}, w0,
      g);
  EXPECT_TRUE(all_close(ns, sign, {1e-9, 1e-9}));
}

// ----------------------------------------------------------------------------------------------
// The diagonal families against LibTorch's optimizers (float32, within its tolerance: torch
// divides sqrt(V) by sqrt(bc2) where the reference's formula takes sqrt(V / bc2)).
// ----------------------------------------------------------------------------------------------

struct TorchCase {
  std::string name;
  ShampooOptions options = ShampooOptions::reference_defaults();
  std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)> make;
};

void PrintTo(const TorchCase& c, std::ostream* os) { *os << c.name; }

std::vector<TorchCase> torch_cases() {
  // ε and β2 of the group differ from the configs': they must not enter.
  const auto base = ShampooOptions::reference_defaults(0.01).epsilon(0.5).betas({0.0, 0.3});
  return {
      {"adam",
       ShampooOptions(base)
           .betas({0.9, 0.3})
           .preconditioner(shampoo::AdamPreconditionerConfig{0.999, 1e-8}),
       [](auto p) {
         return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(0.01).eps(1e-8));
       }},
      {"adamw",
       ShampooOptions(base)
           .betas({0.9, 0.3})
           .weight_decay(0.1)
           .preconditioner(shampoo::AdamPreconditionerConfig{0.99, 1e-8}),
       [](auto p) {
         return std::make_unique<torch::optim::AdamW>(
             p, torch::optim::AdamWOptions(0.01).betas({0.9, 0.99}).eps(1e-8).weight_decay(0.1));
       }},
      {"adagrad", ShampooOptions(base).preconditioner(shampoo::AdaGradPreconditionerConfig{1e-10}),
       [](auto p) {
         return std::make_unique<torch::optim::Adagrad>(p, torch::optim::AdagradOptions(0.01));
       }},
      {"rmsprop",
       ShampooOptions(base).preconditioner(shampoo::RMSpropPreconditionerConfig{0.99, 1e-8}),
       [](auto p) {
         return std::make_unique<torch::optim::RMSprop>(
             p, torch::optim::RMSpropOptions(0.01).alpha(0.99).eps(1e-8));
       }},
      {"sgd_momentum",
       ShampooOptions(base).momentum(0.9).preconditioner(shampoo::SGDPreconditionerConfig{}),
       [](auto p) {
         return std::make_unique<torch::optim::SGD>(p,
                                                    torch::optim::SGDOptions(0.01).momentum(0.9));
       }},
  };
}

class DiagonalEqualsTorch : public ::testing::TestWithParam<TorchCase> {};

TEST_P(DiagonalEqualsTorch, StepForStep) {
  const auto& c = GetParam();
  const FamilyCase family{c.name, c.options.preconditioner()};
  auto ours = make_params(family, 3);
  auto theirs = make_params(family, 3);
  const auto start = snapshot(ours);
  DistributedShampoo optimizer(ours, c.options);
  auto reference = c.make(theirs);
  for (int t = 1; t <= 10; ++t) {
    set_grads(ours, t);
    set_grads(theirs, t);
    optimizer.step();
    reference->step();
    for (size_t i = 0; i < ours.size(); ++i) {
      ASSERT_TRUE(all_close(ours[i].detach(), theirs[i].detach()))
          << c.name << " step " << t << " parameter " << i;
    }
  }
  EXPECT_GT((ours[0].detach() - start[0]).abs().max().item<double>(), 1e-2);
}

INSTANTIATE_TEST_SUITE_P(Optimizers, DiagonalEqualsTorch, ::testing::ValuesIn(torch_cases()),
                         [](const auto& info) { return info.param.name; });

// Issue 58: each diagonal family built from the library's defaults, ShampooOptions(lr), with only
// the settings docs/training.md's "Diagonal families" names, is its torch::optim optimizer.
// Before, the default Adam grafting and start step 50 ran Adam's steps under the SGD family (SGD
// moved every entry of a gradient (1, 2, 3, 100) by −lr); now leaving grafting at its default is
// an error (DescentFamilyOptions.DiagonalFamilyWithTheDefaultGraftingIsRefused).
std::vector<TorchCase> readme_cases() {
  using shampoo::AdamPreconditionerConfig;
  using shampoo::RMSpropPreconditionerConfig;
  const auto from_defaults = ShampooOptions(0.01).grafting(std::monostate{});
  const auto undamped = ShampooOptions(from_defaults).betas({0.0, 1.0});
  return {
      {"sgd", ShampooOptions(undamped).preconditioner(shampoo::SGDPreconditionerConfig{}),
       [](auto p) {
         return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.01));
       }},
      {"sgd_momentum",
       ShampooOptions(undamped).momentum(0.9).preconditioner(shampoo::SGDPreconditionerConfig{}),
       [](auto p) {
         return std::make_unique<torch::optim::SGD>(p,
                                                    torch::optim::SGDOptions(0.01).momentum(0.9));
       }},
      {"adam",
       ShampooOptions(from_defaults)
           .preconditioner(AdamPreconditionerConfig{.beta2 = 0.999, .epsilon = 1e-8}),
       [](auto p) {
         return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(0.01));
       }},
      {"adam_l2",
       ShampooOptions(from_defaults)
           .weight_decay(0.1)
           .weight_decay_type(shampoo::WeightDecayType::kL2)
           .preconditioner(AdamPreconditionerConfig{.beta2 = 0.999, .epsilon = 1e-8}),
       [](auto p) {
         return std::make_unique<torch::optim::Adam>(
             p, torch::optim::AdamOptions(0.01).weight_decay(0.1));
       }},
      {"adamw",
       ShampooOptions(from_defaults)
           .weight_decay(0.01)
           .preconditioner(AdamPreconditionerConfig{.beta2 = 0.999, .epsilon = 1e-8}),
       [](auto p) {
         return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(0.01));
       }},
      {"adagrad", ShampooOptions(undamped).preconditioner(shampoo::AdaGradPreconditionerConfig{}),
       [](auto p) {
         return std::make_unique<torch::optim::Adagrad>(p, torch::optim::AdagradOptions(0.01));
       }},
      {"rmsprop",
       ShampooOptions(undamped).preconditioner(
           RMSpropPreconditionerConfig{.beta2 = 0.99, .epsilon = 1e-8}),
       [](auto p) {
         return std::make_unique<torch::optim::RMSprop>(p, torch::optim::RMSpropOptions(0.01));
       }},
  };
}

INSTANTIATE_TEST_SUITE_P(FromLibraryDefaults, DiagonalEqualsTorch,
                         ::testing::ValuesIn(readme_cases()),
                         [](const auto& info) { return info.param.name; });

// ----------------------------------------------------------------------------------------------
// Bit-for-bit equivalences.
// ----------------------------------------------------------------------------------------------

/// Two param groups over the parameters, differing in every float option the step reads.
std::vector<torch::optim::OptimizerParamGroup> two_groups(const FamilyCase& c,
                                                          const std::vector<at::Tensor>& params) {
  const auto first = family_options(c);
  const auto second =
      ShampooOptions(first).lr(0.02).betas({0.5, 0.99}).momentum(0.0).weight_decay(0.0);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{params[0], params[2]},
                      std::make_unique<ShampooOptions>(first));
  groups.emplace_back(std::vector<at::Tensor>{params[1]}, std::make_unique<ShampooOptions>(second));
  return groups;
}

std::vector<std::vector<at::Tensor>> single_process(const FamilyCase& c, int steps) {
  auto params = make_params(c, 4);
  DistributedShampoo optimizer(two_groups(c, params), family_options(c));
  std::vector<std::vector<at::Tensor>> trajectory;
  for (int t = 1; t <= steps; ++t) {
    set_grads(params, t);
    optimizer.step();
    trajectory.push_back(snapshot(params));
  }
  return trajectory;
}

class FamilyEquivalence : public ::testing::TestWithParam<FamilyCase> {};

TEST_P(FamilyEquivalence, MergedEqualsUnmerged) {
  const auto& c = GetParam();
  auto merged_params = make_params(c, 4);
  auto unmerged_params = make_params(c, 4);
  DistributedShampoo merged(two_groups(c, merged_params), family_options(c));
  DistributedShampoo unmerged(two_groups(c, unmerged_params), family_options(c),
                              DistributedOptions().merge_param_groups(false));
  ASSERT_EQ(merged.stats().virtual_groups, 1);
  ASSERT_EQ(unmerged.stats().virtual_groups, 2);
  const auto start = snapshot(merged_params);
  for (int t = 1; t <= 5; ++t) {
    set_grads(merged_params, t);
    set_grads(unmerged_params, t);
    merged.step();
    unmerged.step();
    ASSERT_TRUE(bit_equal(snapshot(merged_params), snapshot(unmerged_params)))
        << c.name << " step " << t;
  }
  EXPECT_FALSE(at::equal(merged_params[1].detach(), start[1]));
}

TEST_P(FamilyEquivalence, WorldTwoEqualsOneProcess) {
  const auto& c = GetParam();
  constexpr int kSteps = 4;
  const auto expected = single_process(c, kSteps);
  shampoo::testing::run_ranks(2, [&](int rank, const Group& group) {
    auto params = make_params(c, 4);
    DistributedShampoo optimizer(two_groups(c, params), family_options(c),
                                 DistributedOptions().process_group(group));
    for (int t = 1; t <= kSteps; ++t) {
      set_grads(params, t);
      optimizer.step();
      ASSERT_TRUE(bit_equal(snapshot(params), expected[t - 1]))
          << c.name << " rank " << rank << " step " << t;
    }
    ASSERT_LT(optimizer.stats().owned_blocks, optimizer.stats().total_blocks);
  });
}

TEST_P(FamilyEquivalence, ResumedEqualsUninterrupted) {
  const auto& c = GetParam();
  // Also without filter and momentum: the stateless families then have no block state at all.
  for (const bool stateful : {true, false}) {
    auto options = family_options(c);
    if (!stateful) options.betas({0.0, 1.0}).momentum(0.0);
    auto uninterrupted = make_params(c, 5);
    DistributedShampoo straight(uninterrupted, options);
    auto first = make_params(c, 5);
    DistributedShampoo before(first, options);
    const auto path = shampoo::testing::temp_path("descent_resume.pt");
    for (int t = 1; t <= 3; ++t) {
      set_grads(uninterrupted, t);
      straight.step();
      set_grads(first, t);
      before.step();
    }
    torch::save(before, path);
    auto resumed = clone_params(first);
    DistributedShampoo after(resumed, options);
    torch::load(after, path);
    std::filesystem::remove(path);
    for (int t = 4; t <= 7; ++t) {
      set_grads(uninterrupted, t);
      straight.step();
      set_grads(resumed, t);
      after.step();
      ASSERT_TRUE(bit_equal(snapshot(resumed), snapshot(uninterrupted)))
          << c.name << (stateful ? " stateful" : " stateless") << " step " << t;
    }
  }
}

TEST_P(FamilyEquivalence, DistributedCheckpointResumesBitForBit) {
  // World-size-independent checkpoints: one piece per block, also when a block has no state
  // (stateless families without filter and momentum).
  const auto& c = GetParam();
  const auto options = ShampooOptions(family_options(c)).betas({0.0, 1.0}).momentum(0.0);
  auto uninterrupted = make_params(c, 8);
  DistributedShampoo straight(uninterrupted, options);
  auto first = make_params(c, 8);
  DistributedShampoo before(first, options);
  const auto dir = shampoo::testing::temp_path("descent_pieces");
  for (int t = 1; t <= 2; ++t) {
    set_grads(uninterrupted, t);
    straight.step();
    set_grads(first, t);
    before.step();
  }
  shampoo::save_distributed_checkpoint(before, dir);
  auto resumed = clone_params(first);
  DistributedShampoo after(resumed, options);
  shampoo::load_distributed_checkpoint(after, dir);
  shampoo::testing::remove_tree(dir);
  for (int t = 3; t <= 4; ++t) {
    set_grads(uninterrupted, t);
    straight.step();
    set_grads(resumed, t);
    after.step();
    ASSERT_TRUE(bit_equal(snapshot(resumed), snapshot(uninterrupted))) << c.name << " step " << t;
  }
}

TEST_P(FamilyEquivalence, FusedPassEqualsThreePasses) {
  // The elementwise families (diagonal, sign with scale 1) step in the chain's fused pass; the
  // others never do. Against the three passes with the list's update() and precondition(): bit
  // for bit without a second moment; with one, within float32 rounding (the list's ATen ops
  // round V's update once and take MKL's vector sqrt). Two option sets: decoupled weight decay
  // with momentum and β1 (family_options), and L2 weight decay with β3 ≠ β1, no bias correction
  // and iterate averaging (which needs momentum 0). Column blocks (6×10 → 6×6 and 6×4) are not
  // contiguous: their gradients are copied and their updates staged.
  const auto& c = GetParam();
  const bool elementwise = std::visit(
      [](const auto& config) {
        using C = std::decay_t<decltype(config)>;
        if constexpr (std::is_same_v<C, shampoo::SignDescentConfig>) {
          return config.scale == shampoo::SignDescentScale::kOne;
        } else {
          return std::is_same_v<typename C::List, shampoo::detail::DiagonalPreconditionerList>;
        }
      },
      c.config);
  const bool second_moment = elementwise &&
                             !std::holds_alternative<shampoo::SGDPreconditionerConfig>(c.config) &&
                             !std::holds_alternative<shampoo::SignDescentConfig>(c.config);
  const auto l2 = ShampooOptions(family_options(c))
                      .momentum(0.0)
                      .weight_decay_type(shampoo::WeightDecayType::kL2)
                      .betas({0.8, 0.5})
                      .beta3(0.6)
                      .use_bias_correction(false)
                      .iterate_averaging(shampoo::GeneralizedPrimalAveragingConfig{});
  for (const auto& options : {family_options(c), l2}) {
    auto fused_params = make_params(c, 9);
    auto plain_params = make_params(c, 9);
    DistributedShampoo fused(fused_params, options);
    DistributedShampoo plain(plain_params, options);
    for (int t = 1; t <= 6; ++t) {
      set_grads(fused_params, t);
      set_grads(plain_params, t);
      const auto before = shampoo::detail::fused_chunks_for_testing();
      fused.step();
      EXPECT_EQ(shampoo::detail::fused_chunks_for_testing() > before, elementwise) << c.name;
      shampoo::detail::set_fused_step_for_testing(false);
      plain.step();
      shampoo::detail::set_fused_step_for_testing(true);
      EXPECT_EQ(shampoo::detail::fused_chunks_for_testing(), before + (elementwise ? 1 : 0));
      if (second_moment) {
        for (size_t i = 0; i < fused_params.size(); ++i) {
          ASSERT_TRUE(all_close(fused_params[i].detach(), plain_params[i].detach()))
              << c.name << " step " << t << " parameter " << i;
        }
      } else {
        ASSERT_TRUE(bit_equal(snapshot(fused_params), snapshot(plain_params)))
            << c.name << " step " << t;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyEquivalence, ::testing::ValuesIn(families()),
                         [](const auto& info) { return info.param.name; });

TEST(FamilyEquivalence, InBackwardEqualsOrdinaryStepWithMixedFamilies) {
  // Matrices by spectral descent, biases by the Adam preconditioner: two groups, two families.
  auto factory = [](std::vector<at::Tensor> params) {
    std::vector<at::Tensor> matrices, others;
    for (const auto& p : params) (p.dim() == 2 ? matrices : others).push_back(p);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(matrices,
                        std::make_unique<ShampooOptions>(
                            ShampooOptions::reference_defaults(0.02).momentum(0.5).preconditioner(
                                shampoo::SpectralDescentConfig{})));
    groups.emplace_back(others, std::make_unique<ShampooOptions>(
                                    ShampooOptions::reference_defaults(0.01).preconditioner(
                                        shampoo::AdamPreconditionerConfig{})));
    return std::make_unique<DistributedShampoo>(groups);
  };
  auto ordinary_model = shampoo::testing::make_mlp(6, 12, 3, 1);
  auto model = shampoo::testing::make_mlp(6, 12, 3, 1);
  auto ordinary = factory(ordinary_model->parameters());
  auto in_backward = shampoo::apply_optimizer_in_backward(model->parameters(), factory);
  const auto start = snapshot(model->parameters());
  for (int step = 1; step <= 5; ++step) {
    const auto data = shampoo::testing::make_blobs(32, 6, 3, 60 + step);
    ordinary->zero_grad();
    shampoo::testing::classification_loss(ordinary_model, data, true);
    ordinary->step();
    shampoo::testing::classification_loss(model, data, true);
    ASSERT_TRUE(bit_equal(snapshot(model->parameters()), snapshot(ordinary_model->parameters())))
        << "step " << step;
  }
  EXPECT_FALSE(at::equal(model->parameters()[0].detach(), start[0]));
}

class FamilyCuda : public ::testing::TestWithParam<FamilyCase> {};

TEST_P(FamilyCuda, EqualsCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const auto& c = GetParam();
  // Newton–Schulz and SVD in float32 on cuBLAS/cuSOLVER against CPU BLAS/LAPACK round
  // differently; five iterations amplify it: a tenfold atol.
  shampoo::testing::expect_cuda_matches_cpu(make_params(c, 6), family_options(c), 4, set_grads,
                                            {1.3e-6, 1e-4}, c.name);
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyCuda, ::testing::ValuesIn(families()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
