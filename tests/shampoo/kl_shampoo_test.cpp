// KL-Shampoo (docs/math.md, "KL-Shampoo"): an independent float64 implementation of full steps
// written from docs/math.md (plain ATen ops, no code of preconditioners/ or shampoo/), closed
// forms (no other dim: ordinary Shampoo; before the first amortized computation: ordinary
// Shampoo), KL differing from Shampoo, merged ≡ unmerged, world 2 ≡ one process, resumed ≡
// uninterrupted, the failure policy, the options (validation, merging, archives) and CUDA ≡ CPU.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <shampoo/shampoo.h>
#include <torch/cuda.h>
#include <torch/serialize.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <variant>
#include <vector>

#include "shampoo/kronecker_reference.h"
#include "shampoo/option_fields.h"
#include "support/device_parity.h"
#include "support/test_support.h"

namespace {

using shampoo::DistributedOptions;
using shampoo::DistributedShampoo;
using shampoo::EigenbasisMethod;
using shampoo::EigendecomposedKLShampooConfig;
using shampoo::EigendecomposedShampooConfig;
using shampoo::PreconditionerConfig;
using shampoo::PseudoInverseConfig;
using shampoo::RootInvKLShampooConfig;
using shampoo::RootInvShampooConfig;
using shampoo::ShampooOptions;
using shampoo::testing::all_close;
using shampoo::testing::bit_equal;
using shampoo::testing::clone_params;
using shampoo::testing::expect_error;
using shampoo::testing::snapshot;
using shampoo::testing::tolerance_for;
using shampoo::testing::kronecker::apply_along;
using shampoo::testing::kronecker::contract_all_but;
using shampoo::testing::kronecker::expect_matches_reference;
using shampoo::testing::kronecker::f64;
using shampoo::testing::kronecker::reference_base;
using shampoo::testing::kronecker::reference_params;
using shampoo::testing::kronecker::ReferenceCase;
using shampoo::testing::kronecker::ReferenceConfig;
using shampoo::testing::kronecker::without_stability_entries;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

// ----------------------------------------------------------------------------------------------
// The float64 reference (docs/math.md, "KL-Shampoo"): one block per parameter (no merging, every
// dim at most max_preconditioner_dim), no filtering, grafting, momentum or weight decay. A step:
// every factor L_k accumulates the gradient multiplied along the other preconditioned dims by
// their current roots X_j (all with the roots of before the step); at amortized steps
// X_k = f(eigh(L_k / bc2 + ε·I)); W ← W − lr·(G ×_k X_k). Roots start as I.
// ----------------------------------------------------------------------------------------------

struct ReferenceBlock {
  at::Tensor param;
  std::vector<at::Tensor> factors, roots;  // undefined for a dim with exponent 0
};

/// Roots start as I (root-inverse) or, eigendecomposed, as f(1)·I from λ = 1 and Q = I; after a
/// decomposition the two variants form the same root.
class ReferenceKL {
 public:
  ReferenceKL(const std::vector<at::Tensor>& params, const ShampooOptions& options)
      : config_(options) {
    const bool eigendecomposed =
        shampoo::eigendecomposed_config(options.preconditioner()) != nullptr;
    for (const auto& p : params) {
      ReferenceBlock b;
      b.param = p.detach().to(at::kDouble).clone();
      for (int64_t k = 0; k < p.dim(); ++k) {
        const double e = config_.exponent(p.dim(), k);
        const auto n = p.size(k);
        const auto ones = at::ones({n}, f64());
        b.factors.push_back(e != 0.0 ? at::zeros({n, n}, f64()) : at::Tensor());
        b.roots.push_back(e == 0.0          ? at::Tensor()
                          : eigendecomposed ? at::diag(config_.powers(ones, e))
                                            : at::eye(n, f64()));
      }
      blocks_.push_back(std::move(b));
    }
  }

  void step(const std::vector<at::Tensor>& grads) {
    ++t_;
    const bool amortized = config_.amortized(t_);
    const double w = config_.weight();
    const double bc2 = config_.bias_correction(t_);
    for (size_t i = 0; i < blocks_.size(); ++i) {
      auto& b = blocks_[i];
      const auto g = grads[i].to(at::kDouble);
      const int64_t order = g.dim();
      std::vector<at::Tensor> contributions(order);
      for (int64_t k = 0; k < order; ++k) {
        if (!b.factors[k].defined()) continue;
        auto h = g;
        for (int64_t j = 0; j < order; ++j) {
          if (j != k && b.roots[j].defined()) h = apply_along(h, b.roots[j], j);
        }
        contributions[k] = contract_all_but(h, k);
      }
      auto p = g;
      for (int64_t k = 0; k < order; ++k) {
        if (!b.factors[k].defined()) continue;
        b.factors[k] = config_.beta2 * b.factors[k] + w * contributions[k];
        if (amortized) b.roots[k] = config_.root(b.factors[k] / bc2, config_.exponent(order, k));
        p = apply_along(p, b.roots[k], k);
      }
      b.param = b.param - config_.lr * p;
    }
  }

  at::Tensor param(size_t i) const { return blocks_[i].param; }

 private:
  ReferenceConfig config_;
  std::vector<ReferenceBlock> blocks_;
  int64_t t_ = 0;
};

// ----------------------------------------------------------------------------------------------
// Reference cases.
// ----------------------------------------------------------------------------------------------

/// The KL-Shampoo variants, with the rank-deficient stability given.
struct Variant {
  std::string name;
  PreconditionerConfig (*make)(const shampoo::RankDeficientStabilityConfig&);
  PreconditionerConfig ordinary;  ///< the same family without KL statistics
};

void PrintTo(const Variant& v, std::ostream* os) { *os << v.name; }

std::vector<Variant> variants() {
  return {{"root_inverse_kl",
           [](const shampoo::RankDeficientStabilityConfig& s) {
             return PreconditionerConfig{
                 RootInvKLShampooConfig{RootInvShampooConfig{.rank_deficient_stability = s}}};
           },
           RootInvShampooConfig{}},
          {"eigendecomposed_kl",
           [](const shampoo::RankDeficientStabilityConfig& s) {
             return PreconditionerConfig{EigendecomposedKLShampooConfig{
                 EigendecomposedShampooConfig{.rank_deficient_stability = s}}};
           },
           EigendecomposedShampooConfig{}}};
}

std::vector<ReferenceCase> reference_cases() {
  // A relative threshold well above float32's rounding of the zero eigenvalues of the
  // rank-deficient factors (the vector's factor has rank t < 7), far below these factors' gaps.
  const auto pinv = PseudoInverseConfig{.rank_atol = 0.0, .rank_rtol = 1e-4};
  struct Precision {
    std::string suffix;
    at::ScalarType param_dtype, factor_dtype;
  };
  std::vector<ReferenceCase> out;
  for (const auto& variant : variants()) {
    const auto kl = variant.make(shampoo::PerturbationConfig{});
    for (const auto& precision : {Precision{"_double", at::kDouble, at::kDouble},
                                  Precision{"_float_double_factors", at::kFloat, at::kDouble},
                                  Precision{"_float", at::kFloat, at::kFloat}}) {
      const auto base = reference_base().factor_matrix_dtype(precision.factor_dtype);
      const auto dtype = precision.param_dtype;
      const auto prefix = variant.name + "_";
      const auto& suffix = precision.suffix;
      out.push_back(
          {prefix + "every_step" + suffix, ShampooOptions(base).preconditioner(kl), dtype});
      out.push_back({prefix + "pseudo_inverse" + suffix,
                     ShampooOptions(base).epsilon(0.0).precondition_frequency(2).preconditioner(
                         variant.make(pinv)),
                     dtype});
      // Not with float32 factors: roots kept for several steps of rank-deficient factors meet
      // gradients mostly in their null space (~1e-3 relative error of float32's eigh, as in
      // eigendecomposed_families_test.cpp and reference_test.cpp).
      if (precision.factor_dtype == at::kFloat) continue;
      out.push_back(
          {prefix + "every_3rd_step_sum" + suffix,
           ShampooOptions(base).betas({0.0, 1.0}).precondition_frequency(3).preconditioner(kl),
           dtype});
      out.push_back({prefix + "exponent_overrides" + suffix,
                     ShampooOptions(base).preconditioner(kl).inverse_exponent_override(
                         {{1, {{0, 0.25}}}, {2, {{1, 0.0}}}, {3, {{shampoo::kAllDims, 0.5}}}}),
                     dtype});
    }
  }
  // Eigendecomposed KL-Shampoo with ε > 1: before the first decomposition (t = 3) the roots that
  // precondition the statistics are ε^(−e)·I, not I.
  out.push_back({"eigendecomposed_kl_epsilon_above_one_double",
                 reference_base().epsilon(2.0).precondition_frequency(3).preconditioner(
                     EigendecomposedKLShampooConfig{}),
                 at::kDouble});
  // Not covered by this reference: the warm-started QR update of eigendecomposed KL-Shampoo (its
  // decomposition is eigendecomposed Shampoo's, checked in eigendecomposed_families_test.cpp).
  return out;
}

class KLReference : public ::testing::TestWithParam<ReferenceCase> {};

TEST_P(KLReference, EveryStepMatchesTheFloat64Reference) {
  expect_matches_reference<ReferenceKL>(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Variants, KLReference, ::testing::ValuesIn(reference_cases()),
                         [](const auto& info) { return info.param.name; });

// ----------------------------------------------------------------------------------------------
// Closed forms and the difference from Shampoo, per variant.
// ----------------------------------------------------------------------------------------------

class KLVariant : public ::testing::TestWithParam<Variant> {};

/// Runs the variant and its family without KL statistics (same options otherwise) on copies of
/// `params` for `steps` steps; returns, per step, whether the parameters were bit-equal.
std::vector<bool> same_as_shampoo(const std::vector<at::Tensor>& params,
                                  const ShampooOptions& options, const Variant& variant,
                                  int steps) {
  auto kl_params = clone_params(params);
  auto shampoo_params = clone_params(params);
  DistributedShampoo with_kl(kl_params, ShampooOptions(options).preconditioner(
                                            variant.make(shampoo::PerturbationConfig{})));
  DistributedShampoo ordinary(shampoo_params,
                              ShampooOptions(options).preconditioner(variant.ordinary));
  std::vector<bool> same;
  for (int step = 1; step <= steps; ++step) {
    shampoo::testing::set_random_grads(kl_params, 60 + step);
    shampoo::testing::set_random_grads(shampoo_params, 60 + step);
    with_kl.step();
    ordinary.step();
    same.push_back(bit_equal(snapshot(kl_params), snapshot(shampoo_params)));
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_FALSE(kl_params[i].detach().equal(params[i].detach())) << "parameter " << i;
    }
  }
  return same;
}

// With one preconditioned dim there is no other dim to precondition the gradient along: the
// factors, roots and steps are those of the family without KL (root-inverse or eigendecomposed
// Shampoo), bit for bit (a vector block; a matrix block whose dim 1 has exponent 0).
TEST_P(KLVariant, OnePreconditionedDimEqualsShampoo) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const std::vector<at::Tensor> params{at::randn({13}, gen), at::randn({6, 5}, gen)};
  const auto options = ShampooOptions::reference_defaults(0.05)
                           .betas({0.9, 0.99})
                           .epsilon(1e-6)
                           .use_merge_dims(false)
                           .inverse_exponent_override({{2, {{1, 0.0}}}});
  for (const bool same : same_as_shampoo(params, options, GetParam(), 6)) EXPECT_TRUE(same);
}

// Before the first amortized computation every root is I (ε ≤ 1), so the factors are those of
// the family without KL: the runs
// agree bit for bit through the first amortized step (t = 2, from the factors of steps 1–2) and
// the step after it (same roots), and differ from the second amortized step (t = 4) on, whose
// roots come from factors that saw the gradient through the other dims' roots.
TEST_P(KLVariant, EqualsShampooUntilRootsExistThenDiffers) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  const std::vector<at::Tensor> params{at::randn({6, 5}, gen), at::randn({3, 4, 2}, gen)};
  const auto options = ShampooOptions::reference_defaults(0.05)
                           .betas({0.0, 0.95})
                           .epsilon(1e-4)
                           .precondition_frequency(2)
                           .use_merge_dims(false);
  const auto same = same_as_shampoo(params, options, GetParam(), 5);
  EXPECT_TRUE(same[0] && same[1] && same[2]);
  EXPECT_FALSE(same[3]);
  EXPECT_FALSE(same[4]);
}

// The roots of root-inverse KL-Shampoo may come from the matmul-only solvers: they feed the
// statistics as eigh's roots do, and the run stays close to the eigh one.
TEST(KLSolvers, CoupledNewtonRootsTrackEighRoots) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(13);
  const std::vector<at::Tensor> params{at::randn({6, 5}, gen), at::randn({3, 4, 2}, gen)};
  auto eigh_params = clone_params(params);
  auto newton_params = clone_params(params);
  const auto options = ShampooOptions::reference_defaults(0.01).betas({0.0, 0.95}).epsilon(1e-3).use_merge_dims(false);
  DistributedShampoo eigh(eigh_params,
                          ShampooOptions(options).preconditioner(RootInvKLShampooConfig{}));
  DistributedShampoo newton(
      newton_params, ShampooOptions(options).preconditioner(RootInvKLShampooConfig{
                         RootInvShampooConfig{.solver = shampoo::RootSolver::kCoupledNewton}}));
  for (int step = 1; step <= 5; ++step) {
    shampoo::testing::set_random_grads(eigh_params, 80 + step);
    shampoo::testing::set_random_grads(newton_params, 80 + step);
    eigh.step();
    newton.step();
    for (size_t i = 0; i < params.size(); ++i) {
      // Coupled Newton stops at max|M − I| ≤ 1e-6 (its default tolerance), not at eigh's
      // rounding: the roots agree to about that, the parameters after 5 steps of lr 0.01 closer.
      ASSERT_TRUE(all_close(newton_params[i].detach(), eigh_params[i].detach(), {1e-4, 1e-5}))
          << "step " << step << " parameter " << i;
    }
  }
  EXPECT_FALSE(newton_params[0].detach().equal(params[0].detach()));
}

INSTANTIATE_TEST_SUITE_P(Variants, KLVariant, ::testing::ValuesIn(variants()),
                         [](const auto& info) { return info.param.name; });

// ----------------------------------------------------------------------------------------------
// Equivalences, bit for bit.
// ----------------------------------------------------------------------------------------------

std::vector<at::Tensor> make_params(uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<at::Tensor> params;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{6, 10}, {7}, {4, 3, 2}, {5, 6}}) {
    params.push_back(at::randn(shape, gen).requires_grad_());
  }
  return params;
}

void set_grads(const std::vector<at::Tensor>& params, int step) {
  shampoo::testing::set_random_grads(params, 700 + step);
}

ShampooOptions equivalence_options(const Variant& v) {
  return ShampooOptions::reference_defaults(0.05)
      .betas({0.9, 0.99})
      .epsilon(1e-6)
      .momentum(0.5)
      .max_preconditioner_dim(6)
      .precondition_frequency(2)
      .start_preconditioning_step(2)
      .grafting(shampoo::AdaGradGraftingConfig{})
      .preconditioner(v.make(shampoo::PerturbationConfig{}));
}

/// Two param groups, differing in float options the step reads.
std::vector<torch::optim::OptimizerParamGroup> two_groups(const Variant& v,
                                                          const std::vector<at::Tensor>& params) {
  const auto first = equivalence_options(v);
  const auto second = ShampooOptions(first).lr(0.02).betas({0.5, 0.95}).epsilon(1e-5);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{params[0], params[2]},
                      std::make_unique<ShampooOptions>(first));
  groups.emplace_back(std::vector<at::Tensor>{params[1], params[3]},
                      std::make_unique<ShampooOptions>(second));
  return groups;
}

class KLEquivalence : public ::testing::TestWithParam<Variant> {};

TEST_P(KLEquivalence, MergedEqualsUnmerged) {
  const auto& v = GetParam();
  auto merged_params = make_params(4);
  auto unmerged_params = make_params(4);
  DistributedShampoo merged(two_groups(v, merged_params), equivalence_options(v));
  DistributedShampoo unmerged(two_groups(v, unmerged_params), equivalence_options(v),
                              DistributedOptions().merge_param_groups(false));
  ASSERT_EQ(merged.stats().virtual_groups, 1);
  ASSERT_EQ(unmerged.stats().virtual_groups, 2);
  const auto start = snapshot(merged_params);
  for (int t = 1; t <= 6; ++t) {
    set_grads(merged_params, t);
    set_grads(unmerged_params, t);
    merged.step();
    unmerged.step();
    ASSERT_TRUE(bit_equal(snapshot(merged_params), snapshot(unmerged_params)))
        << v.name << " step " << t;
  }
  for (size_t i = 0; i < start.size(); ++i) {
    EXPECT_FALSE(at::equal(merged_params[i].detach(), start[i])) << "parameter " << i;
  }
}

TEST_P(KLEquivalence, WorldTwoEqualsOneProcess) {
  const auto& v = GetParam();
  constexpr int kSteps = 5;
  auto params = make_params(4);
  DistributedShampoo single(two_groups(v, params), equivalence_options(v));
  std::vector<std::vector<at::Tensor>> expected;
  for (int t = 1; t <= kSteps; ++t) {
    set_grads(params, t);
    single.step();
    expected.push_back(snapshot(params));
  }
  shampoo::testing::run_ranks(2, [&](int rank, const Group& group) {
    auto rank_params = make_params(4);
    DistributedShampoo optimizer(two_groups(v, rank_params), equivalence_options(v),
                                 DistributedOptions().process_group(group));
    for (int t = 1; t <= kSteps; ++t) {
      set_grads(rank_params, t);
      optimizer.step();
      ASSERT_TRUE(bit_equal(snapshot(rank_params), expected[t - 1]))
          << v.name << " rank " << rank << " step " << t;
    }
    ASSERT_LT(optimizer.stats().owned_blocks, optimizer.stats().total_blocks);
  });
}

TEST_P(KLEquivalence, ResumedEqualsUninterrupted) {
  const auto& v = GetParam();
  auto uninterrupted = make_params(5);
  DistributedShampoo straight(two_groups(v, uninterrupted), equivalence_options(v));
  auto first = make_params(5);
  DistributedShampoo before(two_groups(v, first), equivalence_options(v));
  const auto path = shampoo::testing::temp_path("kl_resume.pt");
  for (int t = 1; t <= 3; ++t) {
    set_grads(uninterrupted, t);
    straight.step();
    set_grads(first, t);
    before.step();
  }
  torch::save(before, path);
  auto resumed = clone_params(first);
  DistributedShampoo after(two_groups(v, resumed), equivalence_options(v));
  torch::load(after, path);
  std::filesystem::remove(path);
  for (int t = 4; t <= 7; ++t) {
    set_grads(uninterrupted, t);
    straight.step();
    set_grads(resumed, t);
    after.step();
    ASSERT_TRUE(bit_equal(snapshot(resumed), snapshot(uninterrupted))) << v.name << " step " << t;
  }
}

// A failed amortized computation keeps the previous roots, which also keep feeding the factors:
// with every computation after step 1 failing, the run equals one whose roots are never
// recomputed after step 1 (bit for bit), and the fourth failure in a row raises.
TEST_P(KLEquivalence, FailedComputationsKeepThePreviousRoots) {
  const auto options = ShampooOptions::reference_defaults(0.05)
                           .betas({0.0, 1.0})
                           .epsilon(1e-6)
                           .start_preconditioning_step(1)
                           .use_merge_dims(false)
                           .preconditioner(GetParam().make(shampoo::PerturbationConfig{}));
  auto a = at::randn({6, 5}).requires_grad_();
  auto b = a.detach().clone().requires_grad_();
  const auto initial = a.detach().clone();
  DistributedShampoo failing({a}, options);
  DistributedShampoo frozen({b}, ShampooOptions(options).precondition_frequency(1000));
  int step = 0;
  failing.set_failure_injector_for_testing([&](const std::string&, int64_t) { return step >= 2; });
  for (step = 1; step <= 4; ++step) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(90 + step);
    const auto g = at::randn({6, 5}, gen);
    a.mutable_grad() = g.clone();
    b.mutable_grad() = g.clone();
    failing.step();
    frozen.step();
    ASSERT_TRUE(bit_equal(a.detach(), b.detach())) << "step " << step;
  }
  EXPECT_EQ(failing.stats().failed_amortized_computations, 3);
  EXPECT_EQ(failing.stats().amortized_computations, 4);
  EXPECT_FALSE(a.detach().equal(initial));
  a.mutable_grad() = at::randn({6, 5});
  expect_error([&] { failing.step(); },
               {"parameter 0 block 0", "num_tolerated_failed_amortized_computations = 3"});
}

INSTANTIATE_TEST_SUITE_P(Variants, KLEquivalence, ::testing::ValuesIn(variants()),
                         [](const auto& info) { return info.param.name; });

// ----------------------------------------------------------------------------------------------
// Options.
// ----------------------------------------------------------------------------------------------

TEST(KLOptions, BadValuesNameFieldValueAndRange) {
  const auto pinv = PseudoInverseConfig{};
  expect_error(
      [&] {
        ShampooOptions::reference_defaults()
            .preconditioner(
                RootInvKLShampooConfig{RootInvShampooConfig{.rank_deficient_stability = pinv}})
            .validate();
      },
      {"ShampooOptions.epsilon: got 1e-12", "expected 0 with PseudoInverseConfig"});
  expect_error(
      [&] { ShampooOptions::reference_defaults().epsilon(0.0).preconditioner(RootInvKLShampooConfig{}).validate(); },
      {"ShampooOptions.epsilon: got 0", "expected epsilon > 0"});
  expect_error(
      [&] {
        ShampooOptions::reference_defaults()
            .epsilon(0.0)
            .preconditioner(RootInvKLShampooConfig{RootInvShampooConfig{
                .solver = shampoo::RootSolver::kNewtonDB, .rank_deficient_stability = pinv}})
            .validate();
      },
      {"PseudoInverseConfig needs solver kEigh, got kNewtonDB"});
  expect_error(
      [&] {
        ShampooOptions::reference_defaults()
            .preconditioner(RootInvKLShampooConfig{RootInvShampooConfig{
                .solver = shampoo::RootSolver::kCoupledNewton, .tolerance = -1.0}})
            .validate();
      },
      {"ShampooOptions.preconditioner.tolerance: got -1", "expected > 0"});
  expect_error(
      [&] {
        ShampooOptions::reference_defaults()
            .preconditioner(RootInvKLShampooConfig{
                RootInvShampooConfig{.solver = shampoo::RootSolver::kCoupledNewton}})
            .inverse_exponent_override({{2, {{0, 0.3}}}})
            .validate();
      },
      {"inverse_exponent_override[2][0]: exponent 0.3", "integer roots"});
  EXPECT_NO_THROW(ShampooOptions::reference_defaults()
                      .epsilon(0.0)
                      .preconditioner(RootInvKLShampooConfig{
                          RootInvShampooConfig{.rank_deficient_stability = pinv}})
                      .validate());
}

// Eigendecomposed KL-Shampoo: eigendecomposed Shampoo's checks.
TEST(KLOptions, EigendecomposedBadValuesNameFieldValueAndRange) {
  const auto pinv = PseudoInverseConfig{};
  expect_error(
      [&] {
        ShampooOptions::reference_defaults()
            .preconditioner(EigendecomposedKLShampooConfig{
                EigendecomposedShampooConfig{.rank_deficient_stability = pinv}})
            .validate();
      },
      {"ShampooOptions.epsilon: got 1e-12", "expected 0 with PseudoInverseConfig"});
  expect_error(
      [&] {
        ShampooOptions::reference_defaults()
            .preconditioner(EigendecomposedKLShampooConfig{EigendecomposedShampooConfig{
                .eigenbasis_method = static_cast<EigenbasisMethod>(7)}})
            .validate();
      },
      {"ShampooOptions.preconditioner.eigenbasis_method: got 7", "expected kEigh or kQR"});
  EXPECT_NO_THROW(ShampooOptions::reference_defaults()
                      .epsilon(0.0)
                      .preconditioner(EigendecomposedKLShampooConfig{
                          EigendecomposedShampooConfig{.rank_deficient_stability = pinv}})
                      .validate());
}

TEST(KLOptions, TheFamilyAndItsFieldsAreStructural) {
  const auto kl = ShampooOptions::reference_defaults().preconditioner(RootInvKLShampooConfig{});
  EXPECT_TRUE(shampoo::structurally_equal(kl, ShampooOptions(kl).lr(1).epsilon(1e-3)));
  EXPECT_FALSE(shampoo::structurally_equal(kl, ShampooOptions::reference_defaults()));
  EXPECT_FALSE(shampoo::structurally_equal(
      kl, ShampooOptions::reference_defaults().preconditioner(
              RootInvKLShampooConfig{RootInvShampooConfig{.retry_double_precision = false}})));
  EXPECT_FALSE(shampoo::structurally_equal(
      kl, ShampooOptions::reference_defaults().preconditioner(RootInvKLShampooConfig{
              RootInvShampooConfig{.solver = shampoo::RootSolver::kCoupledNewton}})));
  // Groups of KL-Shampoo and of Shampoo are separate virtual groups.
  auto a = at::randn({4, 3}).requires_grad_();
  auto b = at::randn({4, 3}).requires_grad_();
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{a}, std::make_unique<ShampooOptions>(kl));
  groups.emplace_back(std::vector<at::Tensor>{b}, std::make_unique<ShampooOptions>());
  DistributedShampoo opt(std::move(groups));
  EXPECT_EQ(opt.stats().virtual_groups, 2);
  const auto* field = shampoo::detail::structural_difference(kl, ShampooOptions::reference_defaults());
  ASSERT_NE(field, nullptr);
  EXPECT_EQ(field->name, "preconditioner");
  EXPECT_NE(field->describe(kl).find("root-inverse KL-Shampoo (retry_double_precision true"),
            std::string::npos)
      << field->describe(kl);
  // Eigendecomposed KL-Shampoo: another family than eigendecomposed Shampoo and than
  // root-inverse KL-Shampoo; its eigenbasis method is structural.
  const auto eigen_kl = ShampooOptions::reference_defaults().preconditioner(EigendecomposedKLShampooConfig{});
  EXPECT_TRUE(shampoo::structurally_equal(eigen_kl, ShampooOptions(eigen_kl).lr(1)));
  EXPECT_FALSE(shampoo::structurally_equal(eigen_kl, kl));
  EXPECT_FALSE(shampoo::structurally_equal(
      eigen_kl, ShampooOptions::reference_defaults().preconditioner(EigendecomposedShampooConfig{})));
  EXPECT_FALSE(shampoo::structurally_equal(
      eigen_kl, ShampooOptions::reference_defaults().preconditioner(EigendecomposedKLShampooConfig{
                    EigendecomposedShampooConfig{.eigenbasis_method = EigenbasisMethod::kQR}})));
  EXPECT_NE(field->describe(eigen_kl).find("eigendecomposed KL-Shampoo (eigenbasis_method kEigh"),
            std::string::npos)
      << field->describe(eigen_kl);
}

TEST(KLOptions, ArchivesRoundTripEveryConfig) {
  const std::vector<PreconditionerConfig> configs{
      RootInvKLShampooConfig{},
      RootInvKLShampooConfig{RootInvShampooConfig{.retry_double_precision = false,
                                                  .solver = shampoo::RootSolver::kNewtonDB,
                                                  .max_iterations = 9,
                                                  .tolerance = 1e-4,
                                                  .tf32 = true}},
      RootInvKLShampooConfig{RootInvShampooConfig{
          .rank_deficient_stability = PseudoInverseConfig{.rank_atol = 1e-7, .rank_rtol = 1e-3}}},
      EigendecomposedKLShampooConfig{},
      EigendecomposedKLShampooConfig{EigendecomposedShampooConfig{
          .eigenbasis_method = EigenbasisMethod::kQR, .retry_double_precision = false}},
      EigendecomposedKLShampooConfig{EigendecomposedShampooConfig{
          .rank_deficient_stability = PseudoInverseConfig{.rank_rtol = shampoo::kDtypeRankRtol}}}};
  for (const auto& config : configs) {
    const auto written = ShampooOptions::reference_defaults().epsilon(0.0).lr(0.3).preconditioner(config);
    const auto read = shampoo::testing::options_round_trip(written);
    EXPECT_TRUE(read.preconditioner() == config) << "config kind " << config.index();
    EXPECT_EQ(read.lr(), 0.3);
  }
}

// KL-Shampoo adds no archive entries of its own (its kind is the code): an archive written before
// the rank-deficient stability entries existed still loads a KL config, with the perturbation.
TEST(KLOptions, ArchiveWithoutTheNewerEntriesStillLoads) {
  for (const auto& config : std::vector<PreconditionerConfig>{
           RootInvKLShampooConfig{RootInvShampooConfig{
               .solver = shampoo::RootSolver::kCoupledNewton, .max_iterations = 7}},
           EigendecomposedKLShampooConfig{
               EigendecomposedShampooConfig{.eigenbasis_method = EigenbasisMethod::kQR}}}) {
    const auto read = without_stability_entries(ShampooOptions::reference_defaults().lr(0.3).preconditioner(config),
                                                shampoo::EigenvalueCorrectedShampooConfig{});
    EXPECT_TRUE(read.preconditioner() == config) << "config kind " << config.index();
    EXPECT_EQ(read.lr(), 0.3);
  }
}

// ----------------------------------------------------------------------------------------------
// CUDA ≡ CPU.
// ----------------------------------------------------------------------------------------------

class KLCuda : public ::testing::TestWithParam<ReferenceCase> {};

TEST_P(KLCuda, MatchesCpuWithinTolerance) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const auto& c = GetParam();
  // cuSOLVER and LAPACK are different algorithms (as tests/preconditioners/cuda_test.cpp).
  shampoo::testing::expect_cuda_matches_cpu(
      reference_params(at::kFloat), c.options, 5,
      [](const std::vector<at::Tensor>& params, int t) {
        shampoo::testing::set_random_grads(params, 500 + t);
      },
      {1e-4, 1e-5}, c.name);
}

INSTANTIATE_TEST_SUITE_P(Variants, KLCuda, ::testing::ValuesIn([] {
                           std::vector<ReferenceCase> out;
                           for (const auto& c : reference_cases()) {
                             if (c.options.factor_matrix_dtype() == at::kFloat) out.push_back(c);
                           }
                           return out;
                         }()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
