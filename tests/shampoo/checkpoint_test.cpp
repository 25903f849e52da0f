// Checkpoints: torch::save / torch::load resume bit-identically; a checkpoint of another model
// or other structural options is refused with a clear error and leaves the optimizer untouched.
#include <shampoo/shampoo.h>
#include <torch/serialize.h>

#include <filesystem>

#include "support/test_support.h"

namespace {

using shampoo::DistributedShampoo;
using shampoo::ShampooOptions;
using shampoo::testing::bit_equal;

struct Run {
  std::vector<at::Tensor> params;
  std::unique_ptr<DistributedShampoo> optimizer;
};

/// Two groups (different lr, momentum) over a weight, a blocked weight, a 3-D weight and a bias.
Run make_run(const ShampooOptions& base, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Run run;
  run.params = {at::randn({6, 5}, gen).requires_grad_(), at::randn({9, 4}, gen).requires_grad_(),
                at::randn({3, 4, 2}, gen).requires_grad_(), at::randn({5}, gen).requires_grad_()};
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{run.params[0], run.params[1]},
                      std::make_unique<ShampooOptions>(ShampooOptions(base).lr(0.02)));
  groups.emplace_back(
      std::vector<at::Tensor>{run.params[2], run.params[3]},
      std::make_unique<ShampooOptions>(ShampooOptions(base).lr(0.01).momentum(0.5)));
  run.optimizer = std::make_unique<DistributedShampoo>(groups, base);
  return run;
}

void step(Run& run, int t) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + t);
  for (auto& p : run.params) p.mutable_grad() = at::randn(p.sizes(), gen);
  run.optimizer->step();
}

std::vector<at::Tensor> values(const Run& run) {
  std::vector<at::Tensor> out;
  for (const auto& p : run.params) out.push_back(p.detach().clone());
  return out;
}

ShampooOptions base_options() {
  return ShampooOptions(0.01)
      .betas({0.9, 0.99})
      .epsilon(1e-8)
      .precondition_frequency(3)
      .start_preconditioning_step(2)
      .max_preconditioner_dim(6)
      .grafting(shampoo::AdamGraftingConfig{0.99, 1e-8});
}

class Resume : public ::testing::TestWithParam<int> {};

TEST_P(Resume, ResumedRunEqualsUninterruptedBitForBit) {
  auto options = base_options();
  if (GetParam() == 1) options.preconditioner(shampoo::EigenvalueCorrectedShampooConfig{});
  if (GetParam() == 2)
    options.weight_decay(1e-3)
        .weight_decay_type(shampoo::WeightDecayType::kL2)
        .use_nesterov(true)
        .momentum(0.9)
        .beta3(0.5);
  auto uninterrupted = make_run(options, 1);
  for (int t = 1; t <= 10; ++t) step(uninterrupted, t);

  auto first = make_run(options, 1);
  for (int t = 1; t <= 5; ++t) step(first, t);
  first.optimizer->group_options(1).lr(0.005);  // as a scheduler would
  const auto path = shampoo::testing::temp_path("opt.pt");
  torch::save(*first.optimizer, path);
  const auto params_at_save = values(first);

  // A fresh process would rebuild the model and optimizer, then restore both.
  auto resumed = make_run(options, 1);
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < resumed.params.size(); ++i) resumed.params[i].copy_(params_at_save[i]);
  }
  torch::load(*resumed.optimizer, path);
  EXPECT_EQ(resumed.optimizer->group_step(0), 5);
  EXPECT_EQ(resumed.optimizer->group_options(1).lr(), 0.005);
  resumed.optimizer->group_options(1).lr(0.01);  // back to the uninterrupted run's value
  for (int t = 6; t <= 10; ++t) step(resumed, t);
  EXPECT_TRUE(bit_equal(values(resumed), values(uninterrupted)));
  std::filesystem::remove(path);
}

INSTANTIATE_TEST_SUITE_P(Configs, Resume, ::testing::Values(0, 1, 2));

TEST(Resume, WithoutStateTheRunDiverges) {
  // The resume test above could not pass by accident: skipping the load changes the result.
  auto uninterrupted = make_run(base_options(), 1);
  for (int t = 1; t <= 10; ++t) step(uninterrupted, t);
  auto first = make_run(base_options(), 1);
  for (int t = 1; t <= 5; ++t) step(first, t);
  auto fresh = make_run(base_options(), 1);
  {
    torch::NoGradGuard no_grad;
    const auto v = values(first);
    for (size_t i = 0; i < fresh.params.size(); ++i) fresh.params[i].copy_(v[i]);
  }
  for (int t = 6; t <= 10; ++t) step(fresh, t);
  EXPECT_FALSE(bit_equal(values(fresh), values(uninterrupted)));
}

void expect_load_error(DistributedShampoo& optimizer, const std::string& path,
                       const std::string& fragment) {
  try {
    torch::load(optimizer, path);
    ADD_FAILURE() << "expected load to fail with '" << fragment << "'";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find(fragment), std::string::npos) << message;
  }
}

TEST(CheckpointErrors, OtherModelOrStructureIsRefusedAndNothingChanges) {
  auto source = make_run(base_options(), 1);
  for (int t = 1; t <= 3; ++t) step(source, t);
  const auto path = shampoo::testing::temp_path("opt.pt");
  torch::save(*source.optimizer, path);

  // A model with another shape.
  auto other_params = std::vector<at::Tensor>{
      at::randn({6, 5}).requires_grad_(), at::randn({9, 3}).requires_grad_(),
      at::randn({3, 4, 2}).requires_grad_(), at::randn({5}).requires_grad_()};
  DistributedShampoo other(other_params, base_options());
  expect_load_error(other, path, "different model: parameter 1");

  // Fewer parameters.
  DistributedShampoo smaller({at::randn({6, 5}).requires_grad_()}, base_options());
  expect_load_error(smaller, path, "parameters");

  // Same model, other structural options.
  auto other_structure = make_run(base_options().max_preconditioner_dim(4), 1);
  expect_load_error(*other_structure.optimizer, path, "structural options");

  // Not a checkpoint of this optimizer.
  const auto junk = shampoo::testing::temp_path("junk.pt");
  torch::save(at::ones({3}), junk);
  auto target = make_run(base_options(), 1);
  for (int t = 1; t <= 3; ++t) step(target, t);
  auto twin = make_run(base_options(), 1);
  for (int t = 1; t <= 3; ++t) step(twin, t);
  expect_load_error(*target.optimizer, junk, "not a DistributedShampoo checkpoint");
  // The failed loads left the target as it was: it continues exactly like its twin.
  for (int t = 4; t <= 6; ++t) {
    step(target, t);
    step(twin, t);
  }
  EXPECT_TRUE(bit_equal(values(target), values(twin)));
  std::filesystem::remove(path);
  std::filesystem::remove(junk);
}

}  // namespace
