// Checkpoints written by an earlier version still load, and the numerics did not move: for every
// fixture (checkpoint_fixtures/, written by make_fixtures.cpp from fixture_configs.h), this
// version runs the same two steps from the same parameters and gradients and must reach the
// saved parameters bit for bit; the saved checkpoint loads into an optimizer of the same options,
// and one more step from it equals one more step of this version's own run, bit for bit.
#include <torch/serialize.h>

#include "checkpoint_fixtures/fixture_configs.h"
#include "support/test_support.h"

namespace {

using shampoo::testing::bit_equal;

std::string fixture_path(const std::string& name, const std::string& what) {
  return std::string(SHAMPOO_CHECKPOINT_FIXTURES) + "/" + name + "_" + what + ".pt";
}

std::vector<at::Tensor> load_tensors(const std::string& path) {
  std::vector<at::Tensor> tensors;
  torch::load(tensors, path);
  return tensors;
}

std::vector<at::Tensor> leaves(const std::vector<at::Tensor>& values) {
  std::vector<at::Tensor> out;
  for (const auto& v : values) out.push_back(v.clone().requires_grad_());
  return out;
}

void step_with(shampoo::DistributedShampoo& optimizer, std::vector<at::Tensor>& params,
               const std::vector<at::Tensor>& grads, int step) {
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].mutable_grad() = grads[step * params.size() + i].clone();
  }
  optimizer.step();
}

class CheckpointFixtures : public ::testing::TestWithParam<shampoo::fixtures::FixtureConfig> {};

TEST_P(CheckpointFixtures, LoadAndContinueBitForBit) {
  const auto& fixture = GetParam();
  const auto init = load_tensors(fixture_path(fixture.name, "init"));
  const auto grads = load_tensors(fixture_path(fixture.name, "grads"));
  const auto saved = load_tensors(fixture_path(fixture.name, "params"));
  ASSERT_EQ(init.size(), shampoo::fixtures::kParams);

  auto params = leaves(init);
  shampoo::DistributedShampoo own(params, fixture.options);
  for (int s = 0; s < shampoo::fixtures::kStepsBeforeCheckpoint; ++s) {
    step_with(own, params, grads, s);
  }
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(bit_equal(params[i].detach(), saved[i])) << fixture.name << " parameter " << i;
  }

  auto resumed_params = leaves(saved);
  shampoo::DistributedShampoo resumed(resumed_params, fixture.options);
  torch::load(resumed, fixture_path(fixture.name, "optimizer"));
  step_with(own, params, grads, shampoo::fixtures::kStepsBeforeCheckpoint);
  step_with(resumed, resumed_params, grads, shampoo::fixtures::kStepsBeforeCheckpoint);
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(bit_equal(resumed_params[i].detach(), params[i].detach()))
        << fixture.name << " parameter " << i;
  }
  // The float options came back from the checkpoint as saved.
  const auto& options =
      static_cast<const shampoo::ShampooOptions&>(resumed.param_groups()[0].options());
  EXPECT_TRUE(shampoo::structurally_equal(options, fixture.options)) << fixture.name;
}

INSTANTIATE_TEST_SUITE_P(EveryFamily, CheckpointFixtures,
                         ::testing::ValuesIn(shampoo::fixtures::fixture_configs()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
