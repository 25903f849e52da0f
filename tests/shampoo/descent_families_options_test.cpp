// Options of the descent and diagonal families: validation messages, which groups merge
// (every field structural), the archive round trip of every field, archives written before the
// families existed (or lacking their entries) still load, a checkpoint of another family or
// other settings is refused naming them, spectral descent's 2-D restriction names the parameter,
// and the state-size estimate knows the families' state.
#include <shampoo/option_fields.h>
#include <shampoo/shampoo.h>
#include <shampoo/state_size.h>
#include <torch/serialize.h>

#include <filesystem>

#include "support/test_support.h"

namespace {

using shampoo::DistributedOptions;
using shampoo::DistributedShampoo;
using shampoo::ShampooOptions;
using shampoo::testing::expect_error;

using shampoo::AdaGradPreconditionerConfig;
using shampoo::AdamPreconditionerConfig;
using shampoo::OrthogonalizationMethod;
using shampoo::OrthogonalizationScale;
using shampoo::RMSpropPreconditionerConfig;
using shampoo::SGDPreconditionerConfig;
using shampoo::SignDescentConfig;
using shampoo::SignDescentScale;
using shampoo::SpectralDescentConfig;

std::vector<at::Tensor> matrices() {
  return {at::randn({4, 3}).requires_grad_(), at::randn({5, 2}).requires_grad_()};
}

ShampooOptions with(shampoo::PreconditionerConfig config) {
  return ShampooOptions::reference_defaults().preconditioner(std::move(config));
}

/// The preconditioner as messages show it.
std::string describe(const ShampooOptions& options) {
  for (const auto& field : shampoo::detail::option_fields()) {
    if (field.name == "preconditioner") return field.describe(options);
  }
  return "?";
}

TEST(DescentOptions, BadValuesNameFieldValueAndRange) {
  auto build = [](ShampooOptions o) { return [o] { DistributedShampoo opt(matrices(), o); }; };
  expect_error(
      build(with(SpectralDescentConfig{.num_iterations = 0})),
      {"ShampooOptions.preconditioner.num_iterations", "got 0", ">= 1", "SpectralDescentConfig"});
  expect_error(build(with(SpectralDescentConfig{.coefficients = {3.0, NAN, 1.0}})),
               {"preconditioner.coefficients[1]", "nan", "finite"});
  expect_error(build(with(SpectralDescentConfig{.scale_by_nuclear_norm = true})),
               {"preconditioner.scale_by_nuclear_norm", "kNewtonSchulz", "kSVD"});
  expect_error(build(with(SpectralDescentConfig{.method = OrthogonalizationMethod(5)})),
               {"preconditioner.method", "got 5", "kNewtonSchulz or kSVD"});
  expect_error(build(with(SpectralDescentConfig{.scale = OrthogonalizationScale(3)})),
               {"preconditioner.scale", "got 3", "kOne or kSqrtAspectRatio"});
  expect_error(build(with(SignDescentConfig{SignDescentScale(2)})),
               {"preconditioner.scale", "got 2", "kOne or kL1Norm"});
  expect_error(build(with(AdaGradPreconditionerConfig{0.0})),
               {"ShampooOptions.preconditioner.epsilon: got 0, expected > 0",
                "AdaGradPreconditionerConfig"});
  expect_error(build(with(RMSpropPreconditionerConfig{.beta2 = 0.0})),
               {"preconditioner.beta2: got 0", "(0, 1]", "RMSpropPreconditionerConfig"});
  expect_error(build(with(AdamPreconditionerConfig{.beta2 = 1.5})),
               {"preconditioner.beta2: got 1.5", "(0, 1]", "AdamPreconditionerConfig"});
  expect_error(build(with(AdamPreconditionerConfig{.epsilon = -1.0})),
               {"preconditioner.epsilon: got -1", "> 0", "AdamPreconditionerConfig"});
  // The reference's defaults are valid, and the edges of the ranges.
  for (const auto& config : std::vector<shampoo::PreconditionerConfig>{
           SpectralDescentConfig{},
           SpectralDescentConfig{.method = OrthogonalizationMethod::kSVD,
           .scale_by_nuclear_norm = true},
           SignDescentConfig{}, SGDPreconditionerConfig{}, AdaGradPreconditionerConfig{},
           RMSpropPreconditionerConfig{.beta2 = 1.0}, AdamPreconditionerConfig{}}) {
    DistributedShampoo fine(matrices(), with(config));
  }
}

// Issue 58: the default Adam grafting under a diagonal main preconditioner ran Adam, not the
// family chosen; leaving it at its default is now an error naming what to set. Setting grafting
// (none, or any grafting, the default's value too) is accepted.
TEST(DescentOptions, DiagonalFamilyWithTheDefaultGraftingIsRefused) {
  for (const auto& config : std::vector<shampoo::PreconditionerConfig>{
           SGDPreconditionerConfig{}, AdaGradPreconditionerConfig{}, RMSpropPreconditionerConfig{},
           AdamPreconditionerConfig{}}) {
    const auto left = ShampooOptions(0.1).betas({0.0, 1.0}).preconditioner(config);
    EXPECT_FALSE(left.grafting_given());
    expect_error([&] { DistributedShampoo opt(matrices(), left); },
                 {"ShampooOptions.grafting: left at its default (Adam grafting)", "preconditioner",
                  "grafting(std::monostate{})", "before step 50"});
    DistributedShampoo none(matrices(), ShampooOptions(left).grafting(std::monostate{}));
    DistributedShampoo adam(
        matrices(), ShampooOptions(left).grafting(shampoo::AdamGraftingConfig{0.999, 1e-8}));
    // The checkpoint of such a group carries its grafting: a copy read back is accepted.
    EXPECT_TRUE(
        shampoo::testing::options_round_trip(ShampooOptions(left).grafting(std::monostate{}))
            .grafting_given());
  }
  // The case: SGD chosen, (1, 2, 3, 100) moves by −lr·G.
  auto w = at::zeros({4}).requires_grad_();
  DistributedShampoo sgd(std::vector<at::Tensor>{w},
                         ShampooOptions(0.1)
                             .betas({0.0, 1.0})
                             .grafting(std::monostate{})
                             .preconditioner(SGDPreconditionerConfig{}));
  w.mutable_grad() = at::tensor({1.0F, 2.0F, 3.0F, 100.0F});
  sgd.step();
  EXPECT_TRUE(at::allclose(w.detach(), at::tensor({-0.1F, -0.2F, -0.3F, -10.0F}))) << w.detach();
}

TEST(DescentOptions, ReferenceDefaults) {
  const SpectralDescentConfig spectral;
  EXPECT_EQ(spectral.method, OrthogonalizationMethod::kNewtonSchulz);
  EXPECT_EQ(spectral.num_iterations, 5);
  EXPECT_EQ(spectral.coefficients, (std::array<double, 3>{3.4445, -4.7750, 2.0315}));
  EXPECT_EQ(spectral.scale, OrthogonalizationScale::kOne);
  EXPECT_FALSE(spectral.scale_by_nuclear_norm);
  EXPECT_EQ(SignDescentConfig{}.scale, SignDescentScale::kOne);
  EXPECT_EQ(AdaGradPreconditionerConfig{}.epsilon, 1e-10);
  EXPECT_EQ(RMSpropPreconditionerConfig{}, (RMSpropPreconditionerConfig{0.99, 1e-10, false}));
  EXPECT_EQ(AdamPreconditionerConfig{}, (AdamPreconditionerConfig{0.999, 1e-10, false}));
}

/// Every family with a non-default value in each of its fields (and its default).
std::vector<shampoo::PreconditionerConfig> changed_configs() {
  return {
      SpectralDescentConfig{},
      SpectralDescentConfig{.method = OrthogonalizationMethod::kSVD, .scale_by_nuclear_norm = true},
      SpectralDescentConfig{.num_iterations = 9},
      SpectralDescentConfig{.coefficients = {3.0, -3.2, 1.2}},
      SpectralDescentConfig{.scale = OrthogonalizationScale::kSqrtAspectRatio},
      SignDescentConfig{},
      SignDescentConfig{SignDescentScale::kL1Norm},
      SGDPreconditionerConfig{},
      AdaGradPreconditionerConfig{},
      AdaGradPreconditionerConfig{1e-6},
      RMSpropPreconditionerConfig{},
      RMSpropPreconditionerConfig{.beta2 = 0.5},
      RMSpropPreconditionerConfig{.epsilon = 1e-3},
      RMSpropPreconditionerConfig{.drop_weighting_factor_on_gsquare = true},
      AdamPreconditionerConfig{},
      AdamPreconditionerConfig{.beta2 = 0.5},
      AdamPreconditionerConfig{.epsilon = 1e-3},
      AdamPreconditionerConfig{.drop_weighting_factor_on_gsquare = true},
      shampoo::RootInvShampooConfig{},
      shampoo::EigenvalueCorrectedShampooConfig{},
  };
}

TEST(DescentOptions, StructurallyEqualExactlyWhenEveryFieldIsEqual) {
  const auto configs = changed_configs();
  for (size_t i = 0; i < configs.size(); ++i) {
    for (size_t j = 0; j < configs.size(); ++j) {
      EXPECT_EQ(shampoo::structurally_equal(with(configs[i]), with(configs[j])), i == j)
          << describe(with(configs[i])) << " vs " << describe(with(configs[j]));
    }
  }
}

TEST(DescentOptions, GroupsOfDifferentFamiliesOrSettingsAreNotMerged) {
  auto params = matrices();
  const auto a = with(SpectralDescentConfig{});
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{params[0]}, std::make_unique<ShampooOptions>(a));
  groups.emplace_back(std::vector<at::Tensor>{params[1]},
                      std::make_unique<ShampooOptions>(ShampooOptions(a).lr(0.5)));
  DistributedShampoo merged(groups);
  EXPECT_EQ(merged.stats().virtual_groups, 1);
  for (const auto& other : {with(SpectralDescentConfig{.num_iterations = 6}),
                            with(AdamPreconditionerConfig{}), with(SignDescentConfig{})}) {
    groups[1] = torch::optim::OptimizerParamGroup(std::vector<at::Tensor>{params[1]},
                                                  std::make_unique<ShampooOptions>(other));
    DistributedShampoo separate(groups);
    EXPECT_EQ(separate.stats().virtual_groups, 2);
  }
}

TEST(DescentOptions, EveryFieldRoundTripsThroughAnArchive) {
  for (const auto& config : changed_configs()) {
    const auto written = with(config).lr(0.25);
    const auto read = shampoo::testing::options_round_trip(written);
    EXPECT_TRUE(read.preconditioner() == written.preconditioner()) << describe(written);
    EXPECT_TRUE(shampoo::structurally_equal(read, written));
  }
}

/// An options archive as written before the families existed: every row as now, but the
/// preconditioner row only with its original entries (and `kind`).
ShampooOptions read_archive_without_family_entries(const ShampooOptions& options, int64_t kind) {
  torch::serialize::OutputArchive out;
  for (const auto& field : shampoo::detail::option_fields()) {
    if (field.name != "preconditioner") {
      field.write(options, out);
      continue;
    }
    out.write("preconditioner_kind", c10::IValue(kind));
    out.write("preconditioner_retry_double_precision", c10::IValue(int64_t{1}));
    out.write("preconditioner_eigenbasis_method", c10::IValue(int64_t{0}));
    out.write("preconditioner_root_solver", c10::IValue(int64_t{0}));
    out.write("preconditioner_max_iterations", c10::IValue(int64_t{100}));
    out.write("preconditioner_tolerance", c10::IValue(1e-6));
    out.write("preconditioner_tf32", c10::IValue(int64_t{0}));
  }
  return shampoo::testing::read_options(out);
}

TEST(DescentOptions, ArchivesWithoutTheNewEntriesStillLoad) {
  // A checkpoint of root-inverse Shampoo written before this change.
  const auto old =
      read_archive_without_family_entries(ShampooOptions::reference_defaults().lr(0.3), 0);
  EXPECT_EQ(old.lr(), 0.3);
  EXPECT_TRUE(old.preconditioner() ==
              shampoo::PreconditionerConfig{shampoo::RootInvShampooConfig{}});
  // A family whose entries are absent keeps its defaults.
  const shampoo::PreconditionerConfig spectral = SpectralDescentConfig{};
  const auto kind = static_cast<int64_t>(spectral.index());
  EXPECT_TRUE(read_archive_without_family_entries(with(spectral), kind).preconditioner() ==
              spectral);
}

TEST(DescentOptions, TheArchiveRowListsEveryNewEntryOnce) {
  const auto& rows = shampoo::detail::option_fields();
  const auto row = std::find_if(rows.begin(), rows.end(),
                                [](const auto& f) { return f.name == "preconditioner"; });
  ASSERT_NE(row, rows.end());
  for (const char* key :
       {"preconditioner_spectral_method", "preconditioner_spectral_num_iterations",
        "preconditioner_spectral_coefficients", "preconditioner_spectral_scale_by_nuclear_norm",
        "preconditioner_spectral_scale", "preconditioner_sign_scale",
        "preconditioner_adagrad_epsilon", "preconditioner_rmsprop_beta2",
        "preconditioner_rmsprop_epsilon", "preconditioner_rmsprop_drop_weighting_factor_on_gsquare",
        "preconditioner_adam_beta2", "preconditioner_adam_epsilon",
        "preconditioner_adam_drop_weighting_factor_on_gsquare"}) {
    EXPECT_EQ(std::count(row->archive_keys.begin(), row->archive_keys.end(), key), 1) << key;
  }
}

TEST(DescentOptions, ACheckpointOfOtherSettingsIsRefusedNamingThem) {
  auto source_params = matrices();
  DistributedShampoo source(source_params, with(SpectralDescentConfig{}));
  shampoo::testing::set_random_grads(source_params, 1);
  source.step();
  const auto path = shampoo::testing::temp_path("descent_checkpoint.pt");
  torch::save(source, path);
  auto target_params = matrices();
  DistributedShampoo target(target_params, with(SpectralDescentConfig{.num_iterations = 6}));
  expect_error([&] { torch::load(target, path); },
               {"preconditioner: got spectral descent (method kNewtonSchulz, num_iterations 5",
                "expected spectral descent (method kNewtonSchulz, num_iterations 6"});
  DistributedShampoo adam(target_params, with(AdamPreconditionerConfig{}));
  expect_error([&] { torch::load(adam, path); }, {"preconditioner: got spectral descent",
                                                  "expected Adam preconditioner (beta2 0.999"});
  std::filesystem::remove(path);
}

TEST(SpectralDescentBlocks, ANonMatrixBlockIsAnErrorNamingTheParameter) {
  const auto spectral = with(SpectralDescentConfig{});
  auto bias =
      std::vector<at::Tensor>{at::randn({4, 3}).requires_grad_(), at::randn({5}).requires_grad_()};
  expect_error([&] { DistributedShampoo opt(bias, spectral); },
               {"param group 0: parameter 1 (parameter 1 overall, shape [5])", "spectral descent",
                "2-D blocks only", "block 0 has shape [5] (1-D)", "another preconditioner"});
  // Dims that cannot merge under max_preconditioner_dim stay three.
  auto cube = std::vector<at::Tensor>{at::randn({20, 30, 40}).requires_grad_()};
  expect_error(
      [&] { DistributedShampoo opt(cube, ShampooOptions(spectral).max_preconditioner_dim(100)); },
      {"parameter 0", "shape [20, 30, 40]", "(3-D)", "max_preconditioner_dim (100",
       "raise max_preconditioner_dim"});
  auto conv = std::vector<at::Tensor>{at::randn({4, 3, 2}).requires_grad_()};
  expect_error(
      [&] { DistributedShampoo opt(conv, ShampooOptions(spectral).use_merge_dims(false)); },
      {"shape [4, 3, 2]", "use_merge_dims false", "enable use_merge_dims"});
  // Merged, the same parameter is one 4×6 matrix; a 1×n row squeezes to 1-D (an error).
  DistributedShampoo merged(conv, spectral);
  EXPECT_EQ(merged.stats().total_blocks, 1);
  auto row = std::vector<at::Tensor>{at::randn({1, 8}).requires_grad_()};
  expect_error([&] { DistributedShampoo opt(row, spectral); }, {"shape [1, 8]", "[8] (1-D)"});
  // The other families take any order.
  DistributedShampoo sign(bias, with(SignDescentConfig{}));
}

TEST(DescentStateSize, EstimateEqualsTheStateAllocated) {
  // Spectral descent needs matrices; the others also take a 1-D and a 3-D parameter.
  const auto params = std::vector<at::Tensor>{at::randn({40, 30}).requires_grad_(),
                                              at::randn({3, 5, 7}).requires_grad_(),
                                              at::randn({50}).requires_grad_()};
  for (const auto& config : changed_configs()) {
    const bool spectral = std::holds_alternative<SpectralDescentConfig>(config);
    const auto used = spectral ? std::vector<at::Tensor>{params[0], params[1]} : params;
    const std::vector<torch::optim::OptimizerParamGroup> groups{
        torch::optim::OptimizerParamGroup(used)};
    const auto options =
        with(config).max_preconditioner_dim(64).grafting(shampoo::AdaGradGraftingConfig{});
    const auto estimate = shampoo::detail::estimate_state_size(groups, options);
    ASSERT_TRUE(estimate.has_value());
    DistributedShampoo optimizer(used, options);
    EXPECT_EQ(estimate->state_bytes, optimizer.stats().state_bytes) << describe(options);
  }
  // Only the diagonal families hold a second moment (numel × 4 bytes); without grafting the
  // descent families hold nothing.
  const std::vector<torch::optim::OptimizerParamGroup> groups{
      torch::optim::OptimizerParamGroup(params)};
  const auto adam = shampoo::detail::estimate_state_size(groups, with(AdamPreconditionerConfig{}));
  const auto sign = shampoo::detail::estimate_state_size(groups, with(SignDescentConfig{}));
  EXPECT_EQ(adam->state_bytes, (1200 + 105 + 50) * 4);
  EXPECT_EQ(sign->state_bytes, 0);
}

}  // namespace
