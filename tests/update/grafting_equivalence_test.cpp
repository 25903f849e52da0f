// Grafting equivalence: with preconditioning never started, DistributedShampoo with a grafting
// method is that diagonal method, so it must follow LibTorch's own optimizer step for step
// (docs/math.md "Grafting / diagonal methods"), within float32 tolerance.
#include <shampoo/shampoo.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <functional>
#include <memory>
#include <string>

#include "support/test_support.h"

namespace {

using shampoo::testing::all_close;

struct EquivalenceCase {
  std::string name;
  std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)> reference;
  shampoo::ShampooOptions shampoo = shampoo::ShampooOptions::reference_defaults();
};

shampoo::ShampooOptions never_preconditioned(double lr) {
  return shampoo::ShampooOptions::reference_defaults(lr)
      .start_preconditioning_step(shampoo::kNeverStartPreconditioning)
      .precondition_frequency(1);
}

std::vector<EquivalenceCase> cases() {
  std::vector<EquivalenceCase> out;
  const double lr = 0.05;
  for (const double wd : {0.0, 0.01}) {
    for (const auto type : {shampoo::WeightDecayType::kL2, shampoo::WeightDecayType::kDecoupled}) {
      const std::string suffix = std::string(wd == 0.0 ? "" : "_wd") +
                                 (type == shampoo::WeightDecayType::kL2 ? "_l2" : "_decoupled");
      // SGD: torch's weight decay is added to the gradient before momentum; both Shampoo weight
      // decay types add wd·W to the direction before momentum, so both match.
      out.push_back({"sgd" + suffix,
                     [=](std::vector<at::Tensor> p) {
                       return std::make_unique<torch::optim::SGD>(
                           p, torch::optim::SGDOptions(lr).weight_decay(wd));
                     },
                     never_preconditioned(lr)
                         .betas({0.0, 1.0})
                         .weight_decay(wd)
                         .weight_decay_type(type)
                         .grafting(shampoo::SGDGraftingConfig{})});
      if (type == shampoo::WeightDecayType::kL2) {
        out.push_back({"adagrad" + suffix,
                       [=](std::vector<at::Tensor> p) {
                         return std::make_unique<torch::optim::Adagrad>(
                             p, torch::optim::AdagradOptions(lr).weight_decay(wd).eps(1e-10));
                       },
                       never_preconditioned(lr)
                           .betas({0.0, 1.0})
                           .weight_decay(wd)
                           .weight_decay_type(type)
                           .grafting(shampoo::AdaGradGraftingConfig{1e-10})});
        out.push_back(
            {"rmsprop" + suffix,
             [=](std::vector<at::Tensor> p) {
               return std::make_unique<torch::optim::RMSprop>(
                   p, torch::optim::RMSpropOptions(0.01).alpha(0.95).eps(1e-8).weight_decay(wd));
             },
             never_preconditioned(0.01)
                 .betas({0.0, 1.0})
                 .weight_decay(wd)
                 .weight_decay_type(type)
                 .grafting(shampoo::RMSpropGraftingConfig{0.95, 1e-8})});
        out.push_back(
            {"adam" + suffix,
             [=](std::vector<at::Tensor> p) {
               return std::make_unique<torch::optim::Adam>(
                   p,
                   torch::optim::AdamOptions(0.01).betas({0.9, 0.999}).eps(1e-8).weight_decay(wd));
             },
             never_preconditioned(0.01)
                 .betas({0.9, 0.999})
                 .weight_decay(wd)
                 .weight_decay_type(type)
                 .grafting(shampoo::AdamGraftingConfig{0.999, 1e-8})});
      } else if (wd != 0.0) {
        out.push_back(
            {"adamw" + suffix,
             [=](std::vector<at::Tensor> p) {
               return std::make_unique<torch::optim::AdamW>(
                   p,
                   torch::optim::AdamWOptions(0.01).betas({0.9, 0.999}).eps(1e-8).weight_decay(wd));
             },
             never_preconditioned(0.01)
                 .betas({0.9, 0.999})
                 .weight_decay(wd)
                 .weight_decay_type(type)
                 .grafting(shampoo::AdamGraftingConfig{0.999, 1e-8})});
      }
    }
  }
  for (const bool nesterov : {false, true}) {
    const std::string name = nesterov ? "sgd_nesterov" : "sgd_momentum";
    out.push_back(
        {name,
         [=](std::vector<at::Tensor> p) {
           return std::make_unique<torch::optim::SGD>(
               p, torch::optim::SGDOptions(lr).momentum(0.9).nesterov(nesterov).weight_decay(1e-3));
         },
         never_preconditioned(lr)
             .betas({0.0, 1.0})
             .momentum(0.9)
             .use_nesterov(nesterov)
             .weight_decay(1e-3)
             .weight_decay_type(shampoo::WeightDecayType::kL2)
             .grafting(shampoo::SGDGraftingConfig{})});
  }
  return out;
}

class GraftingEquivalence : public ::testing::TestWithParam<EquivalenceCase> {};

TEST_P(GraftingEquivalence, MatchesLibTorchOptimizerStepForStep) {
  const auto& c = GetParam();
  auto reference_model = shampoo::testing::make_mlp(6, 16, 3, /*seed=*/7);
  auto shampoo_model = shampoo::testing::make_mlp(6, 16, 3, /*seed=*/7);
  const auto data = shampoo::testing::make_blobs(64, 6, 3, /*seed=*/11);
  auto reference = c.reference(reference_model->parameters());
  shampoo::DistributedShampoo optimizer(shampoo_model->parameters(), c.shampoo);

  for (int step = 1; step <= 12; ++step) {
    for (auto* opt : {reference.get(), static_cast<torch::optim::Optimizer*>(&optimizer)}) {
      opt->zero_grad();
    }
    shampoo::testing::classification_loss(reference_model, data, /*backward=*/true);
    shampoo::testing::classification_loss(shampoo_model, data, /*backward=*/true);
    reference->step();
    optimizer.step();
    const auto expected = reference_model->parameters();
    const auto actual = shampoo_model->parameters();
    for (size_t i = 0; i < expected.size(); ++i) {
      ASSERT_TRUE(all_close(actual[i], expected[i]))
          << c.name << ", step " << step << ", parameter " << i;
    }
  }
  // The run moved the parameters (the comparison is not between two untouched models).
  const auto initial = shampoo::testing::make_mlp(6, 16, 3, /*seed=*/7)->parameters();
  EXPECT_FALSE(all_close(shampoo_model->parameters()[0], initial[0]));
}

INSTANTIATE_TEST_SUITE_P(AllMethods, GraftingEquivalence, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
