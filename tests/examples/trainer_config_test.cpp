// The trainer's defaults are the settings README.md recommends (its first snippet): lr 1e-3,
// betas (0.9, 0.999), epsilon 1e-12, roots every 50 steps, Adam grafting (0.999, 1e-8); flags and
// TrainerConfig's own initializers agree, and they reach the optimizer's options.
#include "examples/trainer_config.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <tuple>
#include <variant>

#include "examples/trainer_optimizer.h"
#include "shampoo/shampoo.h"

namespace {

using shampoo::examples::GraftingKind;
using shampoo::examples::OptimizerKind;
using shampoo::examples::TrainerConfig;

TrainerConfig parse_no_flags() {
  const char* argv[] = {"cifar10_trainer"};
  const auto config = shampoo::examples::parse_trainer_config(1, argv);
  EXPECT_TRUE(config.has_value());
  return *config;
}

void expect_recommended(const TrainerConfig& config) {
  EXPECT_EQ(config.optimizer, OptimizerKind::kShampoo);
  EXPECT_EQ(config.lr, 1e-3);
  EXPECT_EQ(config.beta1, 0.9);
  EXPECT_EQ(config.beta2, 0.999);
  EXPECT_EQ(config.epsilon, 1e-12);
  EXPECT_EQ(config.precondition_frequency, 50);
  EXPECT_EQ(config.start_preconditioning_step, -1);
  EXPECT_EQ(config.grafting, GraftingKind::kAdam);
  EXPECT_EQ(config.grafting_beta2, 0.999);
  EXPECT_EQ(config.grafting_epsilon, 1e-8);
}

TEST(TrainerDefaults, FlagsAreTheReadmeRecommendedSettings) {
  expect_recommended(parse_no_flags());
}

TEST(TrainerDefaults, ConfigInitializersAgreeWithTheFlags) { expect_recommended(TrainerConfig{}); }

TEST(TrainerDefaults, ReachTheOptimizer) {
  const auto config = parse_no_flags();
  torch::nn::Linear model(8, 4);
  const auto plans = shampoo::examples::plan_param_groups(model->named_parameters(), config);
  const auto optimizer = shampoo::examples::make_optimizer(config, plans, nullptr);
  auto* shampoo_optimizer = dynamic_cast<shampoo::DistributedShampoo*>(optimizer.get());
  ASSERT_NE(shampoo_optimizer, nullptr);
  const auto& options = shampoo_optimizer->group_options(0);
  EXPECT_EQ(options.lr(), 1e-3);
  EXPECT_EQ(options.betas(), std::make_tuple(0.9, 0.999));
  EXPECT_EQ(options.epsilon(), 1e-12);
  EXPECT_EQ(options.precondition_frequency(), 50);
  EXPECT_EQ(options.resolved_start_preconditioning_step(), 50);
  ASSERT_TRUE(std::holds_alternative<shampoo::AdamGraftingConfig>(options.grafting()));
  EXPECT_EQ(std::get<shampoo::AdamGraftingConfig>(options.grafting()),
            (shampoo::AdamGraftingConfig{0.999, 1e-8}));
  // The library keeps the reference's defaults; the trainer chooses its own.
  EXPECT_EQ(shampoo::ShampooOptions().precondition_frequency(), 1);
  EXPECT_TRUE(std::holds_alternative<std::monostate>(shampoo::ShampooOptions().grafting()));
}

}  // namespace
