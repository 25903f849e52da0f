// The per-parameter defaults by cost (shampoo/factor_choice.h): 1-D parameters and dims above
// max_factored_dim keep no Kronecker factor; a block left without any takes the grafting update,
// equal to LibTorch's own Adam; the reference preset factors every dim; memory_summary() says
// what each parameter got. And rounding: micro-batches stay with one batch (float64 factors, or
// float32 factors with a relative epsilon).
#include "shampoo/factor_choice.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/serialize.h>

#include <cmath>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "preconditioners/matrix_functions.h"
#include "shampoo/shampoo.h"
#include "support/test_support.h"

namespace {

using shampoo::DistributedShampoo;
using shampoo::ShampooOptions;

at::Tensor seeded(std::vector<int64_t> shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen);
}

/// Gradients of a fixed sequence: step i's gradient of a parameter of `shape`.
at::Tensor gradient(const std::vector<int64_t>& shape, int64_t step, uint64_t salt) {
  return seeded(shape, 1000 * static_cast<uint64_t>(step) + salt) * 0.1;
}

TEST(FactorChoice, OneDimensionalParametersFollowLibTorchsAdam) {
  // A bias [300] (and a [1, 40] one, 1-D once its size-1 dim is dropped) beside a weight, past
  // the start of preconditioning (step 50 by default): the biases follow torch::optim::Adam
  // within float32 tolerance (as grafting does before step 50, grafting_equivalence_test).
  const std::vector<std::vector<int64_t>> shapes{{300}, {1, 40}, {40, 30}};
  std::vector<at::Tensor> ours, theirs;
  for (size_t i = 0; i < shapes.size(); ++i) {
    ours.push_back(seeded(shapes[i], 10 + i).requires_grad_());
    theirs.push_back(ours.back().detach().clone().requires_grad_());
  }
  DistributedShampoo shampoo({ours[0], ours[1], ours[2]}, ShampooOptions(1e-3));
  torch::optim::Adam adam({theirs[0], theirs[1]}, torch::optim::AdamOptions(1e-3));
  for (int64_t step = 0; step < 80; ++step) {
    for (size_t i = 0; i < shapes.size(); ++i) {
      ours[i].mutable_grad() = gradient(shapes[i], step, i);
      if (i < 2) theirs[i].mutable_grad() = gradient(shapes[i], step, i);
    }
    shampoo.step();
    adam.step();
  }
  EXPECT_GT(shampoo.stats().amortized_computations, 0);  // the weight was preconditioned
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(shampoo::testing::all_close(ours[i], theirs[i]))
        << "bias " << i << ": max |diff| " << (ours[i] - theirs[i]).abs().max().item<double>();
  }
  // With the reference's behaviour the bias is preconditioned and goes elsewhere.
  auto bias = seeded({300}, 10).requires_grad_();
  DistributedShampoo factored({bias}, ShampooOptions(1e-3).precondition_1d(true));
  for (int64_t step = 0; step < 80; ++step) {
    bias.mutable_grad() = gradient({300}, step, 0);
    factored.step();
  }
  EXPECT_FALSE(shampoo::testing::all_close(bias, theirs[0]));
}

TEST(FactorChoice, ALargeDimKeepsNoFactorAndTheOthersStayOneSided) {
  // A [5000, 16] embedding: dim 0 is above max_factored_dim 4096, so every [1024, 16] block keeps
  // the factor of dim 1 only: the same as the reference's behaviour with exponent 0 for dim 0.
  auto a = seeded({5000, 16}, 3).requires_grad_();
  auto b = a.detach().clone().requires_grad_();
  DistributedShampoo by_default({a}, ShampooOptions(1e-3).precondition_frequency(5));
  DistributedShampoo by_override(
      {b},
      ShampooOptions(1e-3).precondition_frequency(5).max_factored_dim(-1).inverse_exponent_override(
          {{2, {{0, 0.0}}}}));
  for (int64_t step = 0; step < 12; ++step) {
    a.mutable_grad() = gradient({5000, 16}, step, 7);
    b.mutable_grad() = gradient({5000, 16}, step, 7);
    by_default.step();
    by_override.step();
  }
  EXPECT_TRUE(at::equal(a, b));
  EXPECT_EQ(by_default.stats().state_bytes, by_override.stats().state_bytes);
  // 5 blocks, each with one packed 16x16 factor (136 doubles) and root (136 floats: the
  // parameter's dtype).
  const auto summary = by_default.memory_summary();
  EXPECT_EQ(summary.factors, 5 * 136 * 8);
  EXPECT_EQ(summary.inverse_roots, 5 * 136 * 4);
  ASSERT_EQ(summary.params.size(), 1u);
  EXPECT_NE(summary.params[0].treatment.find("dim 0: 5000 > max_factored_dim 4096"),
            std::string::npos)
      << summary.params[0].treatment;
  EXPECT_NE(summary.to_string().find("parameter 0 [5000, 16]"), std::string::npos)
      << summary.to_string();
}

TEST(FactorChoice, ABlockWithoutFactorsIsDiagonalAndTheReferencePresetFactorsEverything) {
  // Both dims of [5000, 4500] above the limit: no factor left, the grafting update alone.
  const auto plan = shampoo::detail::make_block_plan({5000, 4500}, 1024, true);
  const auto choice =
      shampoo::detail::block_factor_choice(ShampooOptions(), plan, plan.blocks[0].sizes);
  EXPECT_TRUE(choice.diagonal);
  EXPECT_EQ(choice.dim_exponents, (std::vector<double>{0.0, 0.0}));
  // Without grafting nothing is diagonal: the identity direction, as an exponent-0 override.
  EXPECT_FALSE(shampoo::detail::block_factor_choice(ShampooOptions().grafting(std::monostate{}),
                                                    plan, plan.blocks[0].sizes)
                   .diagonal);
  const auto reference = ShampooOptions::reference_defaults();
  EXPECT_TRUE(reference.precondition_1d());
  EXPECT_EQ(reference.max_factored_dim(), -1);
  EXPECT_EQ(reference.relative_epsilon(), 0.0);
  EXPECT_EQ(reference.factor_matrix_dtype(), at::kFloat);
  EXPECT_EQ(ShampooOptions().factor_matrix_dtype(), at::kDouble);
  const auto full = shampoo::detail::block_factor_choice(reference, plan, plan.blocks[0].sizes);
  EXPECT_FALSE(full.diagonal);
  EXPECT_EQ(full.dim_exponents, (std::vector<double>{0.25, 0.25}));
  const auto bias = shampoo::detail::make_block_plan({300}, 1024, true);
  EXPECT_EQ(shampoo::detail::block_factor_choice(reference, bias, {300}).dim_exponents,
            (std::vector<double>{0.5}));
  EXPECT_EQ(shampoo::detail::describe_factor_choice(ShampooOptions(), bias),
            "the grafting method's update (a 1-D parameter; precondition_1d false)");
  // Families without factors are not affected.
  EXPECT_FALSE(
      shampoo::detail::block_factor_choice(
          ShampooOptions().preconditioner(shampoo::AdamPreconditionerConfig{}), bias, {300})
          .diagonal);
}

TEST(FactorChoice, OptionsAreCheckedSavedAndComparedOnLoad) {
  EXPECT_THROW(
      {
        try {
          ShampooOptions().max_factored_dim(0).validate();
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what()).find("max_factored_dim: got 0"), std::string::npos);
          throw;
        }
      },
      c10::Error);
  EXPECT_THROW(ShampooOptions().relative_epsilon(-1e-6).validate(), c10::Error);
  // A checkpoint of an optimizer that factors 1-D parameters does not load into one that does
  // not: the error names the field.
  auto w = seeded({8, 4}, 1).requires_grad_();
  auto bias = seeded({8}, 2).requires_grad_();
  DistributedShampoo saved({w, bias}, ShampooOptions(1e-3).precondition_1d(true));
  w.mutable_grad() = gradient({8, 4}, 0, 1);
  bias.mutable_grad() = gradient({8}, 0, 2);
  saved.step();
  std::stringstream buffer;
  torch::save(saved, buffer);
  DistributedShampoo loaded({w, bias}, ShampooOptions(1e-3));
  try {
    torch::load(loaded, buffer);
    FAIL() << "loaded a checkpoint of another structure";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("precondition_1d: got true"), std::string::npos)
        << e.what();
  }
  buffer.seekg(0);
  DistributedShampoo same({w, bias}, ShampooOptions(1e-3).precondition_1d(true));
  torch::load(same, buffer);
  // (peak_lr −1 became the group's lr when the group was added.)
  EXPECT_TRUE(static_cast<const ShampooOptions&>(same.param_groups()[0].options()) ==
              ShampooOptions(1e-3).precondition_1d(true).peak_lr(1e-3));
}

TEST(RelativeEpsilon, IsEpsilonPlusTheRelativeShareOfTheTrace) {
  auto A = at::zeros({2, 3, 3});
  A[0].diagonal().copy_(at::tensor({1.0f, 2.0f, 3.0f}));
  A[1].diagonal().copy_(at::tensor({4.0f, 0.0f, 0.0f}));
  const auto eps = shampoo::detail::regularization(A, {1e-12, 1e-12}, {1e-3, 0.0});
  EXPECT_DOUBLE_EQ(eps[0], 1e-12 + 1e-3 * 6.0);
  EXPECT_DOUBLE_EQ(eps[1], 1e-12);
}

/// A small next-token model: an embedding of a window of Zipf-distributed tokens, a hidden layer,
/// an output layer; trained `steps` steps with each batch's gradient taken whole or over
/// `micro` micro-batches. Returns the final parameters.
std::vector<at::Tensor> train_next_token(const ShampooOptions& options, int64_t micro,
                                         int64_t steps) {
  constexpr int64_t kVocab = 300, kDim = 16, kWindow = 4, kBatch = 32;
  torch::manual_seed(1);
  torch::nn::Embedding embedding(kVocab, kDim);
  torch::nn::Linear hidden(kWindow * kDim, 64), output(64, kVocab);
  std::vector<at::Tensor> params;
  for (auto* m : std::vector<torch::nn::Module*>{embedding.get(), hidden.get(), output.get()}) {
    for (const auto& p : m->parameters()) params.push_back(p);
  }
  DistributedShampoo optimizer(params, options);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const auto weights = at::arange(1, kVocab + 1, at::kDouble).reciprocal();
  for (int64_t step = 0; step < steps; ++step) {
    const auto tokens =
        at::multinomial(weights, kBatch * kWindow, true, gen).view({kBatch, kWindow});
    const auto targets = (tokens.select(1, 0) * 7 + tokens.select(1, 1)).remainder(kVocab);
    optimizer.zero_grad();
    const auto inputs = tokens.chunk(micro);
    const auto labels = targets.chunk(micro);
    for (int64_t m = 0; m < micro; ++m) {
      const auto x = at::tanh(hidden->forward(embedding->forward(inputs[m]).flatten(1)));
      (at::cross_entropy_loss(output->forward(x), labels[m]) / static_cast<double>(micro))
          .backward();
    }
    optimizer.step();
  }
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone());
  return out;
}

double relative_distance(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double diff = 0.0, ref = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (a[i] - b[i]).to(at::kDouble).pow(2).sum().item<double>();
    ref += b[i].to(at::kDouble).pow(2).sum().item<double>();
  }
  return std::sqrt(diff / ref);
}

TEST(RoundingRobustness, FourMicroBatchesEndWhereOneBatchEnds) {
  // Roots every 10 steps from step 10; 150 steps. The gradients of the two runs differ in their
  // last bits only (the micro-batches' sum rounds otherwise). With float32 factors and the
  // absolute ε, the roots amplify the rounding of the factors' small eigenvalues; the default
  // float64 factors hold no such rounding, and a relative ε damps it in float32 factors.
  const auto options = ShampooOptions(1e-3).precondition_frequency(10);
  const auto distance = [](const ShampooOptions& o) {
    return relative_distance(train_next_token(o, 4, 150), train_next_token(o, 1, 150));
  };
  const double with_default = distance(options);
  EXPECT_LT(with_default, 1e-5);
  const auto float32 = ShampooOptions(options).factor_matrix_dtype(at::kFloat);
  const double with_relative = distance(ShampooOptions(float32).relative_epsilon(1e-5));
  EXPECT_LT(with_relative, 1e-4);
  const double with_absolute = distance(float32);
  EXPECT_GT(with_absolute, 10 * std::max(with_default, with_relative))
      << "float32 factors with the absolute epsilon no longer amplify rounding here: the test "
         "lost its point";
}

TEST(FactorDtype, ACheckpointLoadsAcrossFactorDtypes) {
  // A float32-factor checkpoint (the reference's dtype, and the default before 2026-11-28)
  // loads into the float64 default, and back: the factors and roots convert exactly, so the
  // float32 optimizer resumed through a float64 one steps as the uninterrupted one, bit for bit.
  auto w = at::zeros({8, 4}, at::requires_grad());
  const auto f32 = ShampooOptions(1e-2).precondition_frequency(2).factor_matrix_dtype(at::kFloat);
  DistributedShampoo first({w}, f32);
  for (int64_t step = 0; step < 5; ++step) {
    w.mutable_grad() = gradient({8, 4}, step, 1);
    first.step();
  }
  std::stringstream saved;
  torch::save(first, saved);
  auto v = w.detach().clone().requires_grad_();
  DistributedShampoo through({v}, ShampooOptions(1e-2).precondition_frequency(2));
  {
    // The load says that the checkpoint's storage options differ, naming them (issue 58).
    struct Collector : c10::WarningHandler {
      void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
      std::vector<std::string> messages;
    } warnings;
    c10::WarningUtils::WarningHandlerGuard guard(&warnings);
    torch::load(through, saved);
    ASSERT_EQ(warnings.messages.size(), 1U);
    const auto& message = warnings.messages[0];
    EXPECT_NE(message.find("param group 0 was saved with other storage options"), std::string::npos)
        << message;
    EXPECT_NE(message.find("factor_matrix_dtype: got Float, expected Double"), std::string::npos)
        << message;
    // A checkpoint of the same options loads without a word.
    std::stringstream same;
    torch::save(first, same);
    DistributedShampoo again({w.detach().clone().requires_grad_()}, f32);
    torch::load(again, same);
    EXPECT_EQ(warnings.messages.size(), 1U);
  }
  std::stringstream resaved;
  torch::save(through, resaved);
  auto u = w.detach().clone().requires_grad_();
  DistributedShampoo resumed({u}, f32);
  torch::load(resumed, resaved);
  for (int64_t step = 5; step < 9; ++step) {
    w.mutable_grad() = gradient({8, 4}, step, 1);
    u.mutable_grad() = gradient({8, 4}, step, 1);
    first.step();
    resumed.step();
    ASSERT_TRUE(at::equal(w, u)) << "step " << step;
  }
  // The float64 optimizer steps from the loaded state too.
  const auto before = v.detach().clone();
  v.mutable_grad() = gradient({8, 4}, 5, 1);
  through.step();
  EXPECT_TRUE(at::isfinite(v).all().item<bool>());
  EXPECT_FALSE(at::equal(v.detach(), before));
}

TEST(FactoredGrafting, TwoDimensionalBlocksKeepRowAndColumnSumsAndOneDimensionalOnesAnExactV) {
  // A [40, 60] weight (one block, factors on both dims) and its [40] bias (no factor: the grafting
  // update itself). Factored, the weight's V is 40 + 60 floats (not merged into one 1-D block: 2400
  // > max_preconditioner_dim); the first step is the exact one bit for bit (the history is zero),
  // later ones differ; the bias follows the exact V bit for bit throughout.
  const auto make = [](uint64_t seed) {
    return std::vector<at::Tensor>{seeded({40, 60}, seed).requires_grad_(),
                                   seeded({40}, seed + 1).requires_grad_()};
  };
  auto factored_params = make(3);
  auto exact_params = make(3);
  const auto options = ShampooOptions(1e-2).precondition_frequency(2);
  EXPECT_TRUE(options.factored_grafting());
  EXPECT_FALSE(ShampooOptions::reference_defaults().factored_grafting());
  DistributedShampoo factored(factored_params, options);
  DistributedShampoo exact(exact_params, ShampooOptions(options).factored_grafting(false));
  for (int64_t step = 0; step < 6; ++step) {
    for (size_t i = 0; i < 2; ++i) {
      const auto g = gradient(factored_params[i].sizes().vec(), step, 10 + i);
      factored_params[i].mutable_grad() = g.clone();
      exact_params[i].mutable_grad() = g.clone();
    }
    factored.step();
    exact.step();
    EXPECT_TRUE(at::equal(factored_params[1], exact_params[1])) << "bias, step " << step;
    if (step == 0) {
      EXPECT_TRUE(at::equal(factored_params[0], exact_params[0])) << "the first step";
    }
  }
  EXPECT_FALSE(at::equal(factored_params[0], exact_params[0]));
  // Close to the exact V's run: the grafting norm only scales the block's direction.
  const double moved = (exact_params[0] - seeded({40, 60}, 3)).norm().item<double>();
  EXPECT_LT((factored_params[0] - exact_params[0]).norm().item<double>(), 0.2 * moved);
  EXPECT_EQ(factored.memory_summary().grafting, (40 + 60) * 4 + 40 * 4);
  EXPECT_EQ(exact.memory_summary().grafting, 40 * 60 * 4 + 40 * 4);
  EXPECT_EQ(factored.stats().state_bytes, factored.memory_summary().state_total());
}

TEST(FactoredGrafting, CheckpointsLoadAcrossItsValues) {
  // Saved factored, loaded exact (V = r·cᵀ / Σr), saved again and loaded factored (r and c are
  // V's row and column sums again, so the same as saved, up to rounding): each optimizer steps.
  auto w = seeded({40, 30}, 4).requires_grad_();
  const auto options = ShampooOptions(1e-2).precondition_frequency(2);
  DistributedShampoo first({w}, options);
  for (int64_t step = 0; step < 4; ++step) {
    w.mutable_grad() = gradient({40, 30}, step, 1);
    first.step();
  }
  std::stringstream saved;
  torch::save(first, saved);
  auto v = w.detach().clone().requires_grad_();
  DistributedShampoo exact({v}, ShampooOptions(options).factored_grafting(false));
  torch::load(exact, saved);
  std::stringstream resaved;
  torch::save(exact, resaved);
  auto u = w.detach().clone().requires_grad_();
  DistributedShampoo factored({u}, options);
  torch::load(factored, resaved);
  for (int64_t step = 4; step < 7; ++step) {
    for (auto* p : {&w, &v, &u}) p->mutable_grad() = gradient({40, 30}, step, 1);
    first.step();
    exact.step();
    factored.step();
  }
  EXPECT_TRUE(at::allclose(u, w, 1e-5, 1e-7));  // through the exact V and back
  EXPECT_TRUE(at::isfinite(v).all().item<bool>());
  EXPECT_FALSE(at::equal(v, w));  // the exact V from r·cᵀ / Σr differs from then on
}

}  // namespace
