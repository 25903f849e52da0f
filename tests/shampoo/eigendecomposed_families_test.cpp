// Eigendecomposed Shampoo and the pseudo-inverse (docs/math.md, "Eigendecomposed Shampoo" and
// "Pseudo-inverse"): an independent float64 implementation of full steps written from docs/math.md
// (plain ATen ops, no code of preconditioners/ or shampoo/), closed-form cases, the failure policy,
// the options (validation, merging, archives, archives written before these options existed) and
// CUDA ≡ CPU. Distributed, merged, resumed and in-backward equivalences of these families are
// cases of the suites that own those equivalences (distributed_shampoo_test, virtual_groups_test,
// checkpoint_test, in_backward_test).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <shampoo/shampoo.h>
#include <torch/cuda.h>
#include <torch/serialize.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <string>
#include <variant>
#include <vector>

#include "preconditioners/matrix_functions.h"
#include "shampoo/kronecker_reference.h"
#include "shampoo/option_fields.h"
#include "support/device_parity.h"
#include "support/test_support.h"

namespace {

using shampoo::DistributedShampoo;
using shampoo::EigenbasisMethod;
using shampoo::EigendecomposedShampooConfig;
using shampoo::PseudoInverseConfig;
using shampoo::RootInvShampooConfig;
using shampoo::ShampooOptions;
using shampoo::testing::all_close;
using shampoo::testing::bit_equal;
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

// ----------------------------------------------------------------------------------------------
// The float64 reference (docs/math.md): one block per parameter (no merging, every dim at most
// max_preconditioner_dim), no filtering, grafting, momentum or weight decay, so a step is
// statistics, decompositions at amortized steps, X_k from the kept decomposition, W ← W − lr·P.
// ----------------------------------------------------------------------------------------------

struct ReferenceBlock {
  at::Tensor param;
  std::vector<at::Tensor> factors, eigenvalues, eigenvectors;
};

class ReferenceEigendecomposed {
 public:
  ReferenceEigendecomposed(const std::vector<at::Tensor>& params, const ShampooOptions& options)
      : config_(options) {
    for (const auto& p : params) {
      ReferenceBlock b;
      b.param = p.detach().to(at::kDouble).clone();
      for (const int64_t n : p.sizes()) {
        b.factors.push_back(at::zeros({n, n}, f64()));
        b.eigenvalues.push_back(at::ones({n}, f64()));  // as docs/math.md: start at 1 and I
        b.eigenvectors.push_back(at::eye(n, f64()));
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
      auto p = g;
      for (int64_t k = 0; k < order; ++k) {
        const double e = config_.exponent(order, k);
        if (e == 0.0) continue;
        b.factors[k] = config_.beta2 * b.factors[k] + w * contract_all_but(g, k);
        if (amortized) decompose(b, k, bc2);
        const auto& q = b.eigenvectors[k];
        const auto x = (q * config_.powers(b.eigenvalues[k], e)).mm(q.t());
        p = apply_along(p, x, k);
      }
      b.param = b.param - config_.lr * p;
    }
  }

  at::Tensor param(size_t i) const { return blocks_[i].param; }

 private:
  void decompose(ReferenceBlock& b, int64_t k, double bc2) const {
    const auto n = b.factors[k].size(0);
    const auto a = b.factors[k] / bc2 + config_.epsilon * at::eye(n, f64());
    if (!config_.qr) {
      const auto [lambda, q] = at::linalg_eigh(a);
      b.eigenvalues[k] = lambda;
      b.eigenvectors[k] = q;
      return;
    }
    // One orthogonal-iteration step from the previous vectors by descending eigenvalue, then the
    // columns by ascending Rayleigh quotient.
    const auto q = std::get<0>(at::linalg_qr(a.mm(b.eigenvectors[k].flip(-1))));
    const auto rayleigh = (q * a.mm(q)).sum(0);
    const auto order = rayleigh.argsort(/*stable=*/true, /*dim=*/0);
    b.eigenvectors[k] = q.index_select(1, order);
    b.eigenvalues[k] = rayleigh.index_select(0, order);
  }

  ReferenceConfig config_;
  std::vector<ReferenceBlock> blocks_;
  int64_t t_ = 0;
};

// ----------------------------------------------------------------------------------------------
// Reference cases.
// ----------------------------------------------------------------------------------------------

std::vector<ReferenceCase> reference_cases() {
  const auto eigh = EigendecomposedShampooConfig{};
  const auto qr = EigendecomposedShampooConfig{.eigenbasis_method = EigenbasisMethod::kQR};
  // The pseudo-inverse drops what rounding leaves of the zero eigenvalues of rank-deficient
  // factors (the vector block's factor has rank t < 7): a relative threshold well above
  // float32's rounding, far below the gaps of these random factors.
  const auto pinv = PseudoInverseConfig{.rank_atol = 0.0, .rank_rtol = 1e-4};
  struct Precision {
    std::string suffix;
    at::ScalarType param_dtype, factor_dtype;
  };
  std::vector<ReferenceCase> out;
  for (const auto& precision : {Precision{"_double", at::kDouble, at::kDouble},
                                Precision{"_float_double_factors", at::kFloat, at::kDouble},
                                Precision{"_float", at::kFloat, at::kFloat}}) {
    const auto base = reference_base().factor_matrix_dtype(precision.factor_dtype);
    const auto dtype = precision.param_dtype;
    const auto& suffix = precision.suffix;
    const bool float_factors = precision.factor_dtype == at::kFloat;
    out.push_back({"eigh_every_step" + suffix, ShampooOptions(base).preconditioner(eigh), dtype});
    out.push_back({"eigendecomposed_pseudo_inverse" + suffix,
                   ShampooOptions(base).epsilon(0.0).precondition_frequency(2).preconditioner(
                       EigendecomposedShampooConfig{.rank_deficient_stability = pinv}),
                   dtype});
    // Root-inverse Shampoo with eigh roots computes the same X_k from the same decomposition.
    out.push_back({"root_inverse_pseudo_inverse" + suffix,
                   ShampooOptions(base).epsilon(0.0).preconditioner(
                       RootInvShampooConfig{.rank_deficient_stability = pinv}),
                   dtype});
    // Not with float32 factors: decompositions kept for several steps of rank-deficient factors
    // (the vector's factor has rank t < 7) meet gradients mostly in their null space, where the
    // step is ε + O(u·λ_max) of float32's eigh: ~1e-3 relative error, as in reference_test.cpp.
    // These pass with float64 factors and in float64.
    if (float_factors) continue;
    out.push_back(
        {"eigh_every_3rd_step_sum" + suffix,
         ShampooOptions(base).betas({0.0, 1.0}).precondition_frequency(3).preconditioner(eigh),
         dtype});
    out.push_back({"qr_every_2nd_step" + suffix,
                   ShampooOptions(base).precondition_frequency(2).preconditioner(qr), dtype});
    out.push_back({"eigh_exponent_overrides" + suffix,
                   ShampooOptions(base).preconditioner(eigh).inverse_exponent_override(
                       {{1, {{0, 0.25}}}, {2, {{1, 0.0}}}, {3, {{shampoo::kAllDims, 0.5}}}}),
                   dtype});
  }
  return out;
}

class EigendecomposedReference : public ::testing::TestWithParam<ReferenceCase> {};

TEST_P(EigendecomposedReference, EveryStepMatchesTheFloat64Reference) {
  expect_matches_reference<ReferenceEigendecomposed>(GetParam());
}

INSTANTIATE_TEST_SUITE_P(Families, EigendecomposedReference, ::testing::ValuesIn(reference_cases()),
                         [](const auto& info) { return info.param.name; });

// ----------------------------------------------------------------------------------------------
// Closed forms.
// ----------------------------------------------------------------------------------------------

std::vector<at::Tensor> mixed_params(uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<at::Tensor> params;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{9, 7}, {13}, {4, 3, 5}, {20, 11}}) {
    params.push_back(at::randn(shape, gen).requires_grad_());
  }
  return params;
}

// Root-inverse Shampoo with eigh keeps X_k = Q·diag(f(λ))·Qᵀ of A + ε·I; eigendecomposed Shampoo
// keeps Q and λ of the same matrix and forms the same X_k at every step.
TEST(EigendecomposedClosedForm, EqualsRootInverseWithEighRoots) {
  const auto options = ShampooOptions::reference_defaults(0.02)
                           .betas({0.9, 0.99})
                           .epsilon(1e-6)
                           .precondition_frequency(2)
                           .max_preconditioner_dim(8)
                           .grafting(shampoo::AdamGraftingConfig{0.99, 1e-8})
                           .momentum(0.5);
  auto eigendecomposed_params = mixed_params(3);
  auto root_inverse_params = mixed_params(3);
  const auto initial = snapshot(root_inverse_params);
  DistributedShampoo eigendecomposed(eigendecomposed_params, ShampooOptions(options).preconditioner(
                                                                 EigendecomposedShampooConfig{}));
  DistributedShampoo root_inverse(root_inverse_params, options);
  for (int step = 1; step <= 8; ++step) {
    shampoo::testing::set_random_grads(eigendecomposed_params, 40 + step);
    shampoo::testing::set_random_grads(root_inverse_params, 40 + step);
    eigendecomposed.step();
    root_inverse.step();
    for (size_t i = 0; i < root_inverse_params.size(); ++i) {
      ASSERT_TRUE(all_close(eigendecomposed_params[i].detach(), root_inverse_params[i].detach()))
          << "step " << step << " parameter " << i;
    }
  }
  for (size_t i = 0; i < initial.size(); ++i) {
    EXPECT_FALSE(root_inverse_params[i].detach().equal(initial[i]));
  }
}

// A rank-one factor g·gᵀ: its pseudo-inverse square root is u·uᵀ/‖g‖ (u = g/‖g‖), so one step of
// a vector block moves W by −lr·u, a unit step along g, for root-inverse and eigendecomposed
// Shampoo alike; the ε perturbation instead would blow up the null space.
TEST(PseudoInverseClosedForm, RankOneFactorGivesTheUnitDirection) {
  const auto pinv = PseudoInverseConfig{.rank_atol = 0.0, .rank_rtol = 1e-4};
  const std::vector<shampoo::PreconditionerConfig> configs{
      RootInvShampooConfig{.rank_deficient_stability = pinv},
      EigendecomposedShampooConfig{.rank_deficient_stability = pinv}};
  for (const auto& config : configs) {
    auto w = at::zeros({5}).requires_grad_();
    DistributedShampoo opt({w}, ShampooOptions::reference_defaults(0.1)
                                    .betas({0.0, 1.0})
                                    .epsilon(0.0)
                                    .start_preconditioning_step(1)
                                    .preconditioner(config));
    const auto g = at::tensor({3.0f, 0.0f, 4.0f, 0.0f, 0.0f});
    w.mutable_grad() = g.clone();
    opt.step();
    EXPECT_TRUE(all_close(w.detach(), -0.1 * g / 5.0)) << "config " << config.index();
  }
}

// The matrix functions directly: on the range X acts as λ^(−e), on the null space as 0.
TEST(PseudoInverseClosedForm, InverseRootOnTheRangeZeroOnTheNullSpace) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const auto q = std::get<0>(at::linalg_qr(at::randn({5, 5}, gen).to(at::kDouble)));
  const auto lambda = at::tensor({0.0, 0.0, 1.0, 2.0, 4.0}, f64());
  const auto a = (q * lambda).mm(q.t()).unsqueeze(0);
  const shampoo::PseudoInverseConfig settings{0.0, 1e-10};
  const auto expected =
      ((q * at::tensor({0.0, 0.0, 1.0, std::pow(2.0, -0.5), 0.5}, f64())).mm(q.t()));
  const auto root =
      shampoo::detail::stacked_inverse_root(a, {0.0}, {0.5}, true, nullptr, &settings);
  ASSERT_FALSE(root.failed[0]);
  EXPECT_TRUE(all_close(root.values[0], expected, {1e-10, 1e-10}));
  // Null-space vectors go to 0, range eigenvectors are scaled by λ^(−1/2).
  EXPECT_TRUE(
      all_close(root.values[0].mm(q.narrow(1, 0, 2)), at::zeros({5, 2}, f64()), {1e-10, 1e-10}));
  EXPECT_TRUE(all_close(root.values[0].mv(q.select(1, 4)), 0.5 * q.select(1, 4), {1e-10, 1e-10}));
  // From a kept decomposition the same.
  const auto from_decomposition = shampoo::detail::stacked_inverse_root_from_eigendecomposition(
      lambda.unsqueeze(0), q.unsqueeze(0), {0.0}, {0.5}, &settings);
  EXPECT_TRUE(all_close(from_decomposition[0], expected, {1e-10, 1e-10}));
  // The thresholds: rank_atol 1.5 drops λ = 1 too; rank_rtol 0.6 (cut-off 0.6·4) drops 1 and 2.
  const shampoo::PseudoInverseConfig atol{1.5, 0.0};
  const shampoo::PseudoInverseConfig rtol{0.0, 0.6};
  const auto keep_top = [&](const std::vector<double>& powers) {
    return (q * at::tensor(powers, f64())).mm(q.t());
  };
  EXPECT_TRUE(all_close(shampoo::detail::stacked_inverse_root_from_eigendecomposition(
                            lambda.unsqueeze(0), q.unsqueeze(0), {0.0}, {0.5}, &atol)[0],
                        keep_top({0, 0, 0, std::pow(2.0, -0.5), 0.5}), {1e-10, 1e-10}));
  EXPECT_TRUE(all_close(shampoo::detail::stacked_inverse_root_from_eigendecomposition(
                            lambda.unsqueeze(0), q.unsqueeze(0), {0.0}, {0.5}, &rtol)[0],
                        keep_top({0, 0, 0, 0, 0.5}), {1e-10, 1e-10}));
}

// Before its first decomposition the preconditioner is f(1)·I: the identity for ε ≤ 1
// (ε^(−e)·I for ε > 1, where the shift makes the smallest eigenvalue ε).
TEST(EigendecomposedClosedForm, BeforeTheFirstDecompositionItIsFOfOneTimesIdentity) {
  for (const double epsilon : {1e-6, 4.0}) {
    auto w = at::zeros({3, 2}).requires_grad_();
    DistributedShampoo opt({w}, ShampooOptions::reference_defaults(0.1)
                                    .betas({0.0, 1.0})
                                    .epsilon(epsilon)
                                    .use_merge_dims(false)
                                    .start_preconditioning_step(10)
                                    .preconditioner(EigendecomposedShampooConfig{}));
    const auto g = at::arange(6, at::kFloat).reshape({3, 2});
    w.mutable_grad() = g.clone();
    opt.step();
    // Two dims, exponent 1/4 each: the scale is f(1)² = (ε > 1 ? ε^(−1/2) : 1).
    const double scale = epsilon > 1.0 ? 1.0 / std::sqrt(epsilon) : 1.0;
    EXPECT_TRUE(all_close(w.detach(), -0.1 * scale * g)) << "epsilon " << epsilon;
  }
}

// ----------------------------------------------------------------------------------------------
// Failure policy.
// ----------------------------------------------------------------------------------------------

// A failed decomposition keeps the previous one: with every decomposition after step 1 failing,
// the run equals one whose decompositions are never recomputed after step 1 (bit for bit), and
// the fourth failure in a row raises.
TEST(EigendecomposedFailurePolicy, FailedDecompositionsKeepThePreviousOnes) {
  for (const auto method : {EigenbasisMethod::kEigh, EigenbasisMethod::kQR}) {
    const auto options =
        ShampooOptions::reference_defaults(0.05)
            .betas({0.0, 1.0})
            .epsilon(1e-6)
            .start_preconditioning_step(1)
            .use_merge_dims(false)
            .preconditioner(EigendecomposedShampooConfig{.eigenbasis_method = method});
    auto a = at::randn({6, 5}).requires_grad_();
    auto b = a.detach().clone().requires_grad_();
    const auto initial = a.detach().clone();
    DistributedShampoo failing({a}, options);
    DistributedShampoo frozen({b}, ShampooOptions(options).precondition_frequency(1000));
    int step = 0;
    failing.set_failure_injector_for_testing(
        [&](const std::string&, int64_t) { return step >= 2; });
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
}

// ----------------------------------------------------------------------------------------------
// Options.
// ----------------------------------------------------------------------------------------------

TEST(EigendecomposedOptions, BadValuesNameFieldValueAndRange) {
  const auto pinv = PseudoInverseConfig{};
  expect_error(
      [&] {
        ShampooOptions::reference_defaults()
            .preconditioner(EigendecomposedShampooConfig{.rank_deficient_stability = pinv})
            .validate();
      },
      {"ShampooOptions.epsilon: got 1e-12", "expected 0 with PseudoInverseConfig"});
  expect_error([&] { ShampooOptions::reference_defaults().epsilon(0.0).validate(); },
               {"ShampooOptions.epsilon: got 0", "expected epsilon > 0"});
  expect_error(
      [&] {
        ShampooOptions::reference_defaults()
            .epsilon(0.0)
            .preconditioner(EigendecomposedShampooConfig{
                .rank_deficient_stability = PseudoInverseConfig{.rank_atol = -1.0}})
            .validate();
      },
      {"rank_deficient_stability.rank_atol: got -1", "expected rank_atol >= 0"});
  expect_error(
      [&] {
        ShampooOptions::reference_defaults()
            .epsilon(0.0)
            .preconditioner(RootInvShampooConfig{.rank_deficient_stability =
                                                     PseudoInverseConfig{.rank_rtol = -0.5}})
            .validate();
      },
      {"rank_deficient_stability.rank_rtol: got -0.5", "kDtypeRankRtol"});
  expect_error(
      [&] {
        ShampooOptions::reference_defaults()
            .epsilon(0.0)
            .preconditioner(RootInvShampooConfig{.solver = shampoo::RootSolver::kCoupledNewton,
                                                 .rank_deficient_stability = pinv})
            .validate();
      },
      {"PseudoInverseConfig needs solver kEigh, got kCoupledNewton"});
  expect_error(
      [&] {
        ShampooOptions::reference_defaults()
            .preconditioner(
                EigendecomposedShampooConfig{.eigenbasis_method = static_cast<EigenbasisMethod>(7)})
            .validate();
      },
      {"ShampooOptions.preconditioner.eigenbasis_method: got 7", "expected kEigh or kQR"});
  // Valid: the pseudo-inverse with ε = 0 and the dtype-relative threshold.
  EXPECT_NO_THROW(ShampooOptions::reference_defaults()
                      .epsilon(0.0)
                      .preconditioner(EigendecomposedShampooConfig{
                          .rank_deficient_stability =
                              PseudoInverseConfig{.rank_rtol = shampoo::kDtypeRankRtol}})
                      .validate());
}

TEST(EigendecomposedOptions, FamiliesAndTheirFieldsAreStructural) {
  const auto eigendecomposed = ShampooOptions::reference_defaults().preconditioner(EigendecomposedShampooConfig{});
  const auto pinv = ShampooOptions::reference_defaults().epsilon(0.0).preconditioner(
      EigendecomposedShampooConfig{.rank_deficient_stability = PseudoInverseConfig{}});
  EXPECT_TRUE(shampoo::structurally_equal(eigendecomposed, ShampooOptions(eigendecomposed).lr(1)));
  EXPECT_FALSE(shampoo::structurally_equal(eigendecomposed, ShampooOptions::reference_defaults()));
  EXPECT_FALSE(shampoo::structurally_equal(
      eigendecomposed,
      ShampooOptions::reference_defaults().preconditioner(shampoo::EigenvalueCorrectedShampooConfig{})));
  EXPECT_FALSE(shampoo::structurally_equal(
      eigendecomposed, ShampooOptions::reference_defaults().preconditioner(EigendecomposedShampooConfig{
                           .eigenbasis_method = EigenbasisMethod::kQR})));
  EXPECT_FALSE(shampoo::structurally_equal(
      eigendecomposed, ShampooOptions::reference_defaults().preconditioner(
                           EigendecomposedShampooConfig{.retry_double_precision = false})));
  EXPECT_FALSE(shampoo::structurally_equal(eigendecomposed, pinv));
  EXPECT_FALSE(shampoo::structurally_equal(
      pinv, ShampooOptions(pinv).preconditioner(EigendecomposedShampooConfig{
                .rank_deficient_stability = PseudoInverseConfig{.rank_atol = 1e-9}})));
  EXPECT_FALSE(shampoo::structurally_equal(
      pinv, ShampooOptions(pinv).preconditioner(EigendecomposedShampooConfig{
                .rank_deficient_stability = PseudoInverseConfig{.rank_rtol = 1e-9}})));
  EXPECT_FALSE(shampoo::structurally_equal(
      ShampooOptions::reference_defaults(), ShampooOptions::reference_defaults().epsilon(0.0).preconditioner(RootInvShampooConfig{
                            .rank_deficient_stability = PseudoInverseConfig{}})));
  // Groups of different families are separate virtual groups.
  auto a = at::randn({4, 3}).requires_grad_();
  auto b = at::randn({4, 3}).requires_grad_();
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{a},
                      std::make_unique<ShampooOptions>(eigendecomposed));
  groups.emplace_back(std::vector<at::Tensor>{b}, std::make_unique<ShampooOptions>());
  DistributedShampoo opt(std::move(groups));
  EXPECT_EQ(opt.stats().virtual_groups, 2);
  // Messages name the family and its fields.
  const auto* field = shampoo::detail::structural_difference(eigendecomposed, pinv);
  ASSERT_NE(field, nullptr);
  EXPECT_EQ(field->name, "preconditioner");
  EXPECT_NE(field->describe(pinv).find("eigendecomposed Shampoo"), std::string::npos);
  EXPECT_NE(field->describe(pinv).find("pseudo-inverse (rank_atol 0, rank_rtol 0)"),
            std::string::npos)
      << field->describe(pinv);
}

TEST(EigendecomposedOptions, ArchivesRoundTripEveryConfig) {
  const std::vector<shampoo::PreconditionerConfig> configs{
      EigendecomposedShampooConfig{},
      EigendecomposedShampooConfig{.eigenbasis_method = EigenbasisMethod::kQR,
                                   .retry_double_precision = false},
      EigendecomposedShampooConfig{.rank_deficient_stability =
                                       PseudoInverseConfig{.rank_atol = 1e-7, .rank_rtol = 1e-3}},
      EigendecomposedShampooConfig{.rank_deficient_stability =
                                       PseudoInverseConfig{.rank_rtol = shampoo::kDtypeRankRtol}},
      RootInvShampooConfig{.rank_deficient_stability = PseudoInverseConfig{.rank_atol = 2e-6}},
      shampoo::EigenvalueCorrectedShampooConfig{EigenbasisMethod::kQR, false},
      RootInvShampooConfig{.solver = shampoo::RootSolver::kNewtonDB}};
  for (const auto& config : configs) {
    const auto written = ShampooOptions::reference_defaults().epsilon(0.0).preconditioner(config);
    const auto read = shampoo::testing::options_round_trip(written);
    EXPECT_TRUE(read.preconditioner() == config) << "config kind " << config.index();
  }
}

// A checkpoint written before the rank-deficient stability entries existed (the seven
// preconditioner entries of then) loads with the perturbation, the default.
TEST(EigendecomposedOptions, ArchiveWithoutTheNewEntriesStillLoads) {
  for (const auto& config : std::vector<shampoo::PreconditionerConfig>{
           RootInvShampooConfig{.solver = shampoo::RootSolver::kCoupledNewton, .max_iterations = 7},
           shampoo::EigenvalueCorrectedShampooConfig{EigenbasisMethod::kQR, true}}) {
    const auto read = without_stability_entries(ShampooOptions::reference_defaults().lr(0.3).preconditioner(config),
                                                EigendecomposedShampooConfig{});
    EXPECT_TRUE(read.preconditioner() == config) << "config kind " << config.index();
    EXPECT_EQ(read.lr(), 0.3);
  }
}

// ----------------------------------------------------------------------------------------------
// CUDA ≡ CPU.
// ----------------------------------------------------------------------------------------------

class EigendecomposedCuda : public ::testing::TestWithParam<ReferenceCase> {};

TEST_P(EigendecomposedCuda, MatchesCpuWithinTolerance) {
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

INSTANTIATE_TEST_SUITE_P(Families, EigendecomposedCuda, ::testing::ValuesIn([] {
                           std::vector<ReferenceCase> out;
                           for (const auto& c : reference_cases()) {
                             if (c.options.factor_matrix_dtype() == at::kFloat) out.push_back(c);
                           }
                           return out;
                         }()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
