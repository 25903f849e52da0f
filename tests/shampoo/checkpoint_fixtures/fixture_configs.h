#pragma once
// The optimizers whose checkpoints are kept as fixtures (this folder): one per preconditioner
// family with non-default fields, and one per grafting method. Public API only, so that the same
// file builds against the version that wrote the fixtures (make_fixtures.cpp) and against this
// one (checkpoint_fixtures_test.cpp). Never change an entry: its fixture was written from it.

#include <shampoo/shampoo.h>

#include <string>
#include <vector>

namespace shampoo::fixtures {

struct FixtureConfig {
  std::string name;
  ShampooOptions options = ShampooOptions::reference_defaults();
};

inline std::vector<FixtureConfig> fixture_configs() {
  const auto base = ShampooOptions::reference_defaults(0.01).betas({0.9, 0.999}).precondition_frequency(1);
  auto with = [&](PreconditionerConfig p) { return ShampooOptions(base).preconditioner(p); };
  std::vector<FixtureConfig> out;
  out.push_back({"root_inverse_eigh", base});
  out.push_back(
      {"root_inverse_coupled_newton",
       with(RootInvShampooConfig{
           .solver = RootSolver::kCoupledNewton, .max_iterations = 50, .tolerance = 1e-5})});
  out.push_back(
      {"root_inverse_pseudo_inverse",
       with(RootInvShampooConfig{.rank_deficient_stability = PseudoInverseConfig{1e-8, 0.0}})
           .epsilon(0.0)});
  out.push_back({"eigenvalue_corrected_qr",
                 with(EigenvalueCorrectedShampooConfig{EigenbasisMethod::kQR, false})});
  SpectralDescentConfig spectral;
  spectral.num_iterations = 4;
  spectral.scale = OrthogonalizationScale::kSqrtAspectRatio;
  out.push_back({"spectral_descent", with(spectral)});
  out.push_back({"sign_descent_l1", with(SignDescentConfig{SignDescentScale::kL1Norm})});
  out.push_back({"sgd_preconditioner", with(SGDPreconditionerConfig{})});
  out.push_back({"adagrad_preconditioner", with(AdaGradPreconditionerConfig{1e-8})});
  RMSpropPreconditionerConfig rmsprop;
  rmsprop.beta2 = 0.9;
  rmsprop.epsilon = 1e-8;
  rmsprop.drop_weighting_factor_on_gsquare = true;
  out.push_back({"rmsprop_preconditioner", with(rmsprop)});
  AdamPreconditionerConfig adam;
  adam.beta2 = 0.95;
  adam.epsilon = 1e-7;
  out.push_back({"adam_preconditioner", with(adam)});
  EigendecomposedShampooConfig eigendecomposed;
  eigendecomposed.eigenbasis_method = EigenbasisMethod::kQR;
  out.push_back({"eigendecomposed_qr", with(eigendecomposed)});
  out.push_back({"root_inverse_kl", with(RootInvKLShampooConfig{})});
  out.push_back({"eigendecomposed_kl", with(EigendecomposedKLShampooConfig{})});
  const auto grafted = ShampooOptions(base).start_preconditioning_step(2);
  out.push_back({"grafting_sgd", ShampooOptions(grafted).grafting(SGDGraftingConfig{})});
  out.push_back(
      {"grafting_adagrad", ShampooOptions(grafted).grafting(AdaGradGraftingConfig{1e-9})});
  out.push_back(
      {"grafting_rmsprop", ShampooOptions(grafted).grafting(RMSpropGraftingConfig{0.98, 1e-9})});
  out.push_back(
      {"grafting_adam", ShampooOptions(grafted).grafting(AdamGraftingConfig{0.995, 1e-8})});
  return out;
}

/// The parameters: two matrices (every family accepts 2-D blocks).
inline std::vector<int64_t> param_shape(size_t i) {
  return i == 0 ? std::vector<int64_t>{4, 3} : std::vector<int64_t>{2, 5};
}
inline constexpr size_t kParams = 2;
/// Steps before the checkpoint; the test takes one more.
inline constexpr int kStepsBeforeCheckpoint = 2;

}  // namespace shampoo::fixtures
