// save_training_checkpoint / load_training_checkpoint: the whole run (model with dropout, the
// optimizer, a GradScaler, the generators and the user's values) resumes bit for bit; a save in
// the middle of a gradient accumulation keeps the accumulated gradients; mismatches are errors
// that name the difference; an InBackwardOptimizer refuses a save mid-accumulation.
#include <shampoo/shampoo.h>
#include <torch/nn/modules/dropout.h>
#include <torch/optim/adam.h>

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "support/test_support.h"

namespace {

using shampoo::testing::bit_equal;
using shampoo::testing::expect_error;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

/// make_mlp's model with dropout after its first layer.
torch::nn::Sequential model_with_dropout() {
  auto mlp = shampoo::testing::make_mlp(6, 10, 3, /*seed=*/5);
  torch::nn::Sequential model;
  size_t index = 0;
  for (auto& module : *mlp) {
    model->push_back(module.clone());
    if (index++ == 0) model->push_back(torch::nn::Dropout(0.3));
  }
  return model;
}

shampoo::ShampooOptions options() { return shampoo::ShampooOptions(0.02).precondition_frequency(2); }

/// Steps [first, last) of a run with a scaler and dropout; the scale, the values and the
/// parameters at the end.
struct Outcome {
  std::vector<at::Tensor> params;
  double scale = 0.0;
  std::map<std::string, c10::IValue> values;
};

Outcome train(const std::string& dir, int last, int save_at) {
  at::manual_seed(17);
  auto model = model_with_dropout();
  shampoo::DistributedShampoo optimizer(model->parameters(), options());
  shampoo::GradScaler scaler(shampoo::GradScalerOptions().init_scale(256.0).growth_interval(2));
  std::map<std::string, c10::IValue> values{{"step", int64_t{0}},
                                            {"epoch", int64_t{0}},
                                            {"best_loss", 1e9},
                                            {"name", std::string("run")},
                                            {"order", at::arange(5)}};
  const shampoo::TrainingState state{model.ptr().get(), &optimizer, &scaler, &values};
  shampoo::load_training_checkpoint(dir, state);
  const auto data = shampoo::testing::make_blobs(64, 6, 3, /*seed=*/3);
  for (int64_t step = values["step"].toInt(); step < last; ++step) {
    optimizer.zero_grad();
    auto loss = shampoo::testing::classification_loss(model, data, /*backward=*/false);
    scaler.scale(loss).backward();
    scaler.step(optimizer);
    scaler.update();
    values["step"] = step + 1;
    values["best_loss"] = std::min(values["best_loss"].toDouble(), loss.item<double>());
    if (step + 1 == 4) values["order"] = at::randperm(5);  // from the generator, every run
    if (step + 1 == save_at) {
      shampoo::save_training_checkpoint(dir, state);
      break;
    }
  }
  return {shampoo::testing::snapshot(model->parameters()), scaler.get_scale(), values};
}

TEST(TrainingState, ResumesTheWholeRunBitForBit) {
  const auto dir = shampoo::testing::temp_path("training_state");
  const auto straight = train(dir + "_none", 8, 0);
  const auto saved = train(dir, 8, 4);
  const auto resumed = train(dir, 8, 0);
  EXPECT_TRUE(bit_equal(resumed.params, straight.params));
  EXPECT_EQ(resumed.scale, straight.scale);
  EXPECT_EQ(resumed.values.at("step").toInt(), 8);
  EXPECT_EQ(resumed.values.at("best_loss").toDouble(), straight.values.at("best_loss").toDouble());
  EXPECT_EQ(resumed.values.at("name").toStringRef(), "run");
  EXPECT_TRUE(at::equal(resumed.values.at("order").toTensor(), saved.values.at("order").toTensor()));
  EXPECT_TRUE(at::equal(resumed.values.at("order").toTensor(), straight.values.at("order").toTensor()));
  shampoo::testing::remove_tree(dir);
}

TEST(TrainingState, MismatchesAreErrorsThatNameThem) {
  const auto dir = shampoo::testing::temp_path("training_state_errors");
  train(dir, 2, 2);
  auto model = model_with_dropout();
  shampoo::DistributedShampoo optimizer(model->parameters(), options());
  // Without the scaler that wrote it.
  expect_error(
      [&] { shampoo::load_training_checkpoint(dir, {model.ptr().get(), &optimizer}); },
      {"written by a run with a GradScaler"});
  // Another model.
  auto other = shampoo::testing::make_mlp(6, 12, 3, 5);
  shampoo::DistributedShampoo other_optimizer(other->parameters(), options());
  shampoo::GradScaler scaler;
  expect_error(
      [&] {
        shampoo::load_training_checkpoint(dir, {other.ptr().get(), &other_optimizer, &scaler});
      },
      {"0.weight is [10, 6] (Float) there and [12, 6] (Float) here",
       "a checkpoint of another model?"});
  // Another kind of optimizer.
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
  expect_error(
      [&] { shampoo::load_training_checkpoint(dir, {model.ptr().get(), &adam, &scaler}); },
      {"param group 0 has options of type torch::optim::AdamOptions here and "
       "shampoo::ShampooOptions there"});
  EXPECT_FALSE(shampoo::load_training_checkpoint(dir + "_absent", {model.ptr().get(), &adam}));
  shampoo::testing::remove_tree(dir);
}

/// Data parallelism with gradient accumulation (two micro-batches per step, NoSync on the
/// first): saved after the first micro-batch of step 3 with TrainingState::gradients, resumed
/// there, equal to the uninterrupted run.
std::vector<at::Tensor> accumulate(const std::string& dir, bool save_mid, bool resume) {
  std::vector<at::Tensor> out;
  std::mutex mutex;
  shampoo::testing::run_ranks(2, [&](int rank, const Group& group) {
    auto model = shampoo::testing::make_mlp(6, 10, 3, /*seed=*/5);
    shampoo::GradientSynchronizer sync(model->parameters(), group);
    shampoo::DistributedShampoo optimizer(model->parameters(), options(),
                                          shampoo::DistributedOptions().process_group(group));
    std::map<std::string, c10::IValue> values{{"pass", int64_t{0}}};
    shampoo::TrainingState state{model.ptr().get(), &optimizer, nullptr, &values};
    state.gradients = true;
    if (resume) shampoo::load_training_checkpoint(dir, state, group);
    const auto data = shampoo::testing::make_blobs(64, 6, 3, /*seed=*/3);
    for (int64_t pass = values["pass"].toInt(); pass < 10; ++pass) {
      const bool last = pass % 2 == 1;
      if (!last) optimizer.zero_grad();
      const shampoo::testing::Dataset micro{data.inputs.narrow(0, (pass % 4) * 16 + rank * 8, 8),
                                            data.labels.narrow(0, (pass % 4) * 16 + rank * 8, 8)};
      sync.set_enabled(last);
      shampoo::testing::classification_loss(model, micro, /*backward=*/true);
      if (last) {
        sync.synchronize();
        optimizer.step();
      }
      values["pass"] = pass + 1;
      if (save_mid && pass == 4) {  // the first micro-batch of step 3 accumulated
        shampoo::save_training_checkpoint(dir, state, group);
        return;
      }
    }
    std::lock_guard<std::mutex> lock(mutex);
    if (rank == 0) out = shampoo::testing::snapshot(model->parameters());
  });
  return out;
}

TEST(TrainingState, MidAccumulationKeepsTheAccumulatedGradients) {
  const auto dir = shampoo::testing::temp_path("training_state_accumulation");
  const auto straight = accumulate(dir + "_none", false, false);
  accumulate(dir, true, false);
  EXPECT_TRUE(bit_equal(accumulate(dir, false, true), straight));
  // The local sums cannot be spread over another number of ranks.
  shampoo::testing::run_ranks(1, [&](int, const Group& group) {
    auto model = shampoo::testing::make_mlp(6, 10, 3, /*seed=*/5);
    shampoo::DistributedShampoo optimizer(model->parameters(), options(),
                                          shampoo::DistributedOptions().process_group(group));
    shampoo::TrainingState state{model.ptr().get(), &optimizer};
    state.gradients = true;
    expect_error([&] { shampoo::load_training_checkpoint(dir, state, group); },
                 {"gradients of 2 ranks", "resume at 2 ranks only"});
  });
  shampoo::testing::remove_tree(dir);
}

TEST(TrainingState, InBackwardRefusesASaveMidAccumulation) {
  auto model = shampoo::testing::make_mlp(6, 10, 3, /*seed=*/5);
  auto in_backward = shampoo::apply_optimizer_in_backward(
      model->parameters(), [](std::vector<at::Tensor> p) {
        return std::make_unique<shampoo::DistributedShampoo>(p, options());
      });
  in_backward.set_accumulation_steps(2);
  const auto data = shampoo::testing::make_blobs(32, 6, 3, /*seed=*/3);
  shampoo::testing::classification_loss(model, data, /*backward=*/true);
  const auto dir = shampoo::testing::temp_path("in_backward_mid");
  expect_error(
      [&] { shampoo::save_training_checkpoint(dir, {model.ptr().get(), &in_backward}); },
      {"1 of the 2 backward passes", "Save after the accumulation's last backward pass"});
  shampoo::testing::classification_loss(model, data, /*backward=*/true);  // steps
  shampoo::save_training_checkpoint(dir, {model.ptr().get(), &in_backward});
  EXPECT_TRUE(shampoo::distributed_checkpoint_exists(dir));
  shampoo::testing::remove_tree(dir);
}

}  // namespace
