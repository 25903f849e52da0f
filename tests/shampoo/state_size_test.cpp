// The size of Shampoo's state: the estimate from the block plans equals what the optimizer
// allocates; the construction-time warning when the state dwarfs the parameters; dims left
// unpreconditioned by an exponent-0 override hold no factor, root or eigenbasis.
#include "shampoo/state_size.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/nn.h>
#include <torch/optim.h>
#include <torch/serialize.h>
#include <torch/types.h>

#include <sstream>
#include <string>
#include <vector>

#include "preconditioners/symmetric_matrices.h"
#include "shampoo/shampoo.h"

namespace {

using shampoo::AdaGradGraftingConfig;
using shampoo::AdamGraftingConfig;
using shampoo::DistributedShampoo;
using shampoo::EigenvalueCorrectedShampooConfig;
using shampoo::ShampooOptions;

class WarningCollector : public c10::WarningHandler {
 public:
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
  std::vector<std::string> messages;
};

/// The settings README.md recommends (its first snippet) and the trainer's defaults.
ShampooOptions recommended_options() {
  return ShampooOptions::reference_defaults(1e-3)
      .betas({0.9, 0.999})
      .epsilon(1e-12)
      .precondition_frequency(50)
      .grafting(AdamGraftingConfig{0.999, 1e-8});
}

std::vector<torch::Tensor> leaves(const std::vector<std::vector<int64_t>>& shapes) {
  std::vector<torch::Tensor> params;
  for (const auto& shape : shapes) params.push_back(torch::randn(shape).requires_grad_());
  return params;
}

struct EstimateCase {
  std::string name;
  ShampooOptions options = ShampooOptions::reference_defaults();
};

class StateSizeEstimateTest : public ::testing::TestWithParam<EstimateCase> {};

TEST_P(StateSizeEstimateTest, EqualsTheStateAllocatedAtConstruction) {
  // Blocks of every kind: split, merged, 1-D, 3-D, a remainder block, a size-1 dim.
  const auto params = leaves({{40, 30}, {3, 5, 7}, {100}, {1, 130}, {2, 3, 50}});
  const std::vector<torch::optim::OptimizerParamGroup> groups{
      torch::optim::OptimizerParamGroup(params)};
  const auto estimate = shampoo::detail::estimate_state_size(groups, GetParam().options);
  ASSERT_TRUE(estimate.has_value());
  int64_t param_bytes = 0;
  for (const auto& p : params) param_bytes += p.numel() * static_cast<int64_t>(p.element_size());
  EXPECT_EQ(estimate->param_bytes, param_bytes);

  DistributedShampoo optimizer(params, GetParam().options);
  EXPECT_GT(optimizer.stats().state_bytes, 0);
  EXPECT_EQ(estimate->state_bytes, optimizer.stats().state_bytes);
}

INSTANTIATE_TEST_SUITE_P(
    Options, StateSizeEstimateTest,
    ::testing::Values(
        EstimateCase{"root_inverse",
                     ShampooOptions::reference_defaults().max_preconditioner_dim(32)},
        EstimateCase{"adam_grafting_double_factors", ShampooOptions::reference_defaults()
                                                         .max_preconditioner_dim(32)
                                                         .grafting(AdamGraftingConfig{})
                                                         .factor_matrix_dtype(torch::kDouble)},
        EstimateCase{"eigenvalue_corrected_adagrad",
                     ShampooOptions::reference_defaults()
                         .max_preconditioner_dim(16)
                         .preconditioner(EigenvalueCorrectedShampooConfig{})
                         .grafting(AdaGradGraftingConfig{})},
        EstimateCase{"eigendecomposed",
                     ShampooOptions::reference_defaults().max_preconditioner_dim(16).preconditioner(
                         shampoo::EigendecomposedShampooConfig{})},
        EstimateCase{
            "exponent_overrides_no_merge",
            ShampooOptions::reference_defaults().use_merge_dims(false).inverse_exponent_override(
                {{1, {{0, 0.0}}}, {3, {{1, 0.0}, {2, 0.0}}}})},
        EstimateCase{"recommended", recommended_options()}),
    [](const auto& info) { return info.param.name; });

TEST(StateSizeWarning, FiresOnceForAThinParameterThatKeepsFactors) {
  // 1×100000: 98 blocks of 1024 elements, each with a 1024×1024 factor and root, packed, in
  // float64 (the default factor dtype): ~818 MB for 0.4 MB of parameters, when 1-D parameters are
  // factored (the reference's behaviour). By default they are not: the state is the grafting's, the
  // parameter's size, and nothing warns.
  const auto params = leaves({{1, 100000}});
  WarningCollector warnings;
  c10::WarningUtils::WarningHandlerGuard guard(&warnings);
  {
    DistributedShampoo by_default(params);
    EXPECT_TRUE(warnings.messages.empty());
    EXPECT_EQ(by_default.stats().state_bytes, 100000 * 4);
  }
  // Factored as the reference does (its dim of 100000 is also above max_factored_dim).
  DistributedShampoo optimizer(params, ShampooOptions().precondition_1d(true).max_factored_dim(-1));
  ASSERT_EQ(warnings.messages.size(), 1u);
  const auto& message = warnings.messages[0];
  for (const char* expected :
       {"614.0 MB", "MB", "0.4 MB", "parameter 0", "[1, 100000]", "98 blocks",
        "max_preconditioner_dim", "inverse_exponent_override", "exponent 0", "diagonal method"}) {
    EXPECT_NE(message.find(expected), std::string::npos) << "missing '" << expected << "' in\n"
                                                         << message;
  }
  // 97 blocks of 1024 and one of 672, a double factor and a float root each (the root in the
  // parameter's dtype), packed triangles; and the default Adam grafting's second moment, one
  // float per element.
  using shampoo::detail::packed_size;
  EXPECT_EQ(optimizer.stats().state_bytes,
            (8 + 4) * (97 * packed_size(1024) + packed_size(672)) + 4 * 100000);

  // Once per optimizer: groups added later are not estimated again.
  optimizer.add_param_group(torch::optim::OptimizerParamGroup(leaves({{1, 20000}})));
  EXPECT_EQ(warnings.messages.size(), 1u);
}

/// The one warning DistributedShampoo(params, recommended_options()) gives.
std::string the_warning(const std::vector<torch::Tensor>& params) {
  WarningCollector warnings;
  c10::WarningUtils::WarningHandlerGuard guard(&warnings);
  DistributedShampoo optimizer(params, recommended_options());
  EXPECT_EQ(warnings.messages.size(), 1u);
  return warnings.messages.empty() ? std::string() : warnings.messages[0];
}

bool contains(const std::string& message, const std::string& part) {
  return message.find(part) != std::string::npos;
}

// A language model's parameters: a 1-D output bias and an embedding get state far above their
// own size, though the model's total may stay under the model-wide threshold; the warning names
// each of them (and not the square weights, which hold about 3x).
TEST(StateSizeWarning, NamesEachParameterWhoseStateDwarfsIt) {
  {
    // [5000]: five 1-D blocks with 1024x1024 factors and roots, ~20 MB for 20 KB; two square
    // weights beside it. ~45 MB in all: below the 64 MiB of the model-wide rule.
    const auto params = leaves({{1024, 1024}, {5000}, {1024, 1024}});
    const std::vector<torch::optim::OptimizerParamGroup> groups{
        torch::optim::OptimizerParamGroup(params)};
    const auto estimate = shampoo::detail::estimate_state_size(groups, recommended_options());
    ASSERT_TRUE(estimate.has_value());
    EXPECT_LT(estimate->state_bytes, shampoo::detail::kStateSizeWarningMinBytes);
    const auto oversized = shampoo::detail::oversized_params(*estimate);
    ASSERT_EQ(oversized.size(), 1u);
    EXPECT_EQ(oversized[0].param, 1);
    EXPECT_TRUE(oversized[0].one_dimensional);
    EXPECT_EQ(oversized[0].largest_dim, 1024);

    const auto message = the_warning(params);
    for (const char* expected :
         {"parameter 1 (group 0, shape [5000], 5 blocks): 0.0 MB of parameters, 20.1 MB of state",
          "1-D", "{{1, {{shampoo::kAllDims, 0.0}}}}", "AdamPreconditionerConfig{}"}) {
      EXPECT_TRUE(contains(message, expected)) << "missing '" << expected << "' in\n" << message;
    }
    EXPECT_FALSE(contains(message, "parameter 0 (group")) << message;
    EXPECT_FALSE(contains(message, "parameter 2 (group")) << message;
  }
  {
    // The embedding, [50000, 128] (estimated only): 233 MB of state for 25.6 MB.
    const auto embedding = shampoo::detail::estimate_state_size(
        {torch::optim::OptimizerParamGroup(leaves({{50000, 128}}))}, recommended_options());
    ASSERT_TRUE(embedding.has_value());
    const auto oversized = shampoo::detail::oversized_params(*embedding);
    ASSERT_EQ(oversized.size(), 1u);
    EXPECT_NEAR(static_cast<double>(oversized[0].state_bytes) / 1e6, 233.3, 0.5);
    EXPECT_EQ(oversized[0].param_bytes, 50000 * 128 * 4);
  }
  // [20000, 128]: 20 blocks whose 1024-row factors dwarf the 128-column ones, ~9x its bytes.
  const auto message = the_warning(leaves({{20000, 128}}));
  for (const char* expected :
       {"parameter 0 (group 0, shape [20000, 128], 20 blocks): 10.2 MB of parameters", "(9x)",
        "largest block dim is 1024", "inverse_exponent_override {{2, {{dim, 0.0}}}}"}) {
    EXPECT_TRUE(contains(message, expected)) << "missing '" << expected << "' in\n" << message;
  }
}

TEST(StateSizeWarning, SilentForASmallModelWithTheRecommendedOptions) {
  WarningCollector warnings;
  c10::WarningUtils::WarningHandlerGuard guard(&warnings);
  // An MNIST-sized MLP (784-256-10): ~9x its parameters, a few MB.
  torch::nn::Sequential mlp(torch::nn::Linear(784, 256), torch::nn::ReLU(),
                            torch::nn::Linear(256, 10));
  DistributedShampoo optimizer(mlp->parameters(), recommended_options());
  // A toy whose state is a large multiple of its parameters but tiny: below the byte floor.
  torch::nn::Linear toy(8, 4);
  DistributedShampoo toy_optimizer(toy->parameters(), recommended_options());
  EXPECT_GT(toy_optimizer.stats().state_bytes,
            shampoo::detail::kStateSizeWarningRatio * (8 * 4 + 4) * 4);
  EXPECT_TRUE(warnings.messages.empty()) << warnings.messages.front();
}

TEST(StateSizeWarning, SilentWhenTheLongDimIsNotPreconditioned) {
  WarningCollector warnings;
  c10::WarningUtils::WarningHandlerGuard guard(&warnings);
  // The remedies the warning names: exponent 0 for the 1-D blocks (only the grafting state is
  // left) ...
  DistributedShampoo unpreconditioned(
      leaves({{1, 100000}}),
      recommended_options().inverse_exponent_override({{1, {{shampoo::kAllDims, 0.0}}}}));
  EXPECT_EQ(unpreconditioned.stats().state_bytes, 100000 * 4);
  // ... or a diagonal method. (Smaller blocks are no remedy for 1-D blocks: with
  // max_preconditioner_dim 64 the state is still 66x the parameter, and the warning says so.)
  DistributedShampoo diagonal(leaves({{1, 100000}}),
                              recommended_options().grafting(std::monostate{}).preconditioner(
                                  shampoo::AdamPreconditionerConfig{}));
  EXPECT_TRUE(warnings.messages.empty()) << warnings.messages.front();
}

// Dims with exponent 0 hold no factor and no root (or eigenbasis), also after steps: the state
// is exactly that of the preconditioned dim, and a checkpoint has no entry for the other.
class UnpreconditionedDimTest : public ::testing::TestWithParam<bool> {};

TEST_P(UnpreconditionedDimTest, HoldsNoFactorOrRoot) {
  const bool eigenvalue_corrected = GetParam();
  // epsilon regularizes the rank-deficient factors of a gradient with fewer rows than columns.
  auto options = ShampooOptions::reference_defaults(1e-2)
                     .betas({0.0, 0.999})
                     .epsilon(1e-4)
                     .precondition_frequency(1);
  if (eigenvalue_corrected) options.preconditioner(EigenvalueCorrectedShampooConfig{});
  // [48, 64]: 3072 elements, not merged; dim 1 is left unpreconditioned.
  const int64_t rows = 48, cols = 64;
  auto param = torch::randn({rows, cols}).requires_grad_();
  auto full = torch::randn({rows, cols}).requires_grad_();
  DistributedShampoo overridden(
      {param}, ShampooOptions(options).inverse_exponent_override({{2, {{1, 0.0}}}}));
  DistributedShampoo preconditioned({full}, options);
  for (int step = 0; step < 2; ++step) {
    for (auto* opt : {&overridden, &preconditioned}) opt->zero_grad();
    param.pow(2).sum().backward();
    full.pow(2).sum().backward();
    overridden.step();
    preconditioned.step();
  }
  // Per dim of size d: the factor (packed) and the root (packed) or the eigenbasis (dense).
  const auto dim_bytes = [&](int64_t d) {
    using shampoo::detail::packed_size;
    return (packed_size(d) + (eigenvalue_corrected ? d * d : packed_size(d))) * 4;
  };
  const int64_t corrections = eigenvalue_corrected ? rows * cols * 4 : 0;
  EXPECT_EQ(overridden.stats().state_bytes, dim_bytes(rows) + corrections);
  EXPECT_EQ(preconditioned.stats().state_bytes, dim_bytes(rows) + dim_bytes(cols) + corrections);

  std::stringstream buffer;
  torch::serialize::OutputArchive out;
  overridden.save(out);
  out.save_to(buffer);
  torch::serialize::InputArchive in;
  in.load_from(buffer);
  torch::serialize::InputArchive blocks, block;
  ASSERT_TRUE(in.try_read("blocks", blocks));
  ASSERT_TRUE(blocks.try_read("p0_b0", block));
  const std::string matrix = eigenvalue_corrected ? "basis_" : "root_";
  torch::Tensor tensor;
  EXPECT_TRUE(block.try_read("factor_0", tensor, /*is_buffer=*/true));
  EXPECT_TRUE(block.try_read(matrix + "0", tensor, /*is_buffer=*/true));
  EXPECT_FALSE(block.try_read("factor_1", tensor, /*is_buffer=*/true));
  EXPECT_FALSE(block.try_read(matrix + "1", tensor, /*is_buffer=*/true));
}

INSTANTIATE_TEST_SUITE_P(Preconditioners, UnpreconditionedDimTest, ::testing::Bool(),
                         [](const auto& info) {
                           return info.param ? "eigenvalue_corrected" : "root_inverse";
                         });

}  // namespace
