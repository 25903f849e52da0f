// Gradient sharding (ZeRO-2, GradientSynchronizer::shard_gradients): every rank keeps only the
// gradients of the parameters it steps, and training equals unsharded data parallelism bit for bit
// (Shampoo root-inverse and eigenvalue-corrected, ShardedOptimizer over Adam, optimizer-in-
// backward), also with gradient accumulation, clipping by global norm and checkpoints; clear
// errors for what cannot be sharded.
#include <shampoo/shampoo.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <mutex>

#include "parallel/sharding_runs.h"
#include "support/test_support.h"

namespace {

using shampoo::DistributedOptions;
using shampoo::DistributedShampoo;
using shampoo::GradientSynchronizer;
using shampoo::GradientSynchronizerOptions;
using shampoo::ShampooOptions;
using shampoo::testing::all_close;
using shampoo::testing::bit_equal;
using shampoo::testing::expect_error;
using shampoo::testing::run_ranks;
using shampoo::testing::snapshot;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

using shampoo::testing::expect_only_owned_gradients;
using shampoo::testing::GradientAgreement;
using shampoo::testing::kind_name;
using shampoo::testing::make_run;
using shampoo::testing::sharding_batch;
using shampoo::testing::ShardingKind;
using shampoo::testing::train_step;
using shampoo::testing::TrainingRun;

class ShardedGradients : public ::testing::TestWithParam<std::tuple<ShardingKind, int>> {};

TEST_P(ShardedGradients, EqualUnshardedDataParallelism) {
  const auto [kind, world] = GetParam();
  std::mutex mutex;
  GradientAgreement total;
  run_ranks(world, [&](int rank, const Group& group) {
    GradientAgreement agreement;
    shampoo::testing::check_sharded_equals_unsharded(kind, rank, world, group, agreement);
    std::lock_guard<std::mutex> lock(mutex);
    total.elements += agreement.elements;
    total.bit_equal += agreement.bit_equal;
  });
  if (total.elements > 0) {
    std::cout << kind_name(kind) << " world " << world << ": " << total.bit_equal << " of "
              << total.elements
              << " reduced gradient elements bit-identical to the all-reduced ones\n";
    if (world == 2) {
      EXPECT_EQ(total.bit_equal, total.elements);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Optimizers, ShardedGradients,
    ::testing::Combine(::testing::Values(ShardingKind::kShampooRootInverse,
                                         ShardingKind::kShampooEigenvalueCorrected,
                                         ShardingKind::kShardedAdam,
                                         ShardingKind::kInBackwardShampoo,
                                         ShardingKind::kInBackwardShardedAdam),
                       ::testing::Values(2, 4)),
    [](const auto& info) {
      return kind_name(std::get<0>(info.param)) + "_world" +
             std::to_string(std::get<1>(info.param));
    });

TEST(ShardedGradients, NonOwnersReleaseGradientsDuringBackward) {
  run_ranks(2, [&](int rank, const Group& group) {
    auto run = make_run(ShardingKind::kShardedAdam, group, /*sharded=*/true, /*bucket_cap=*/64);
    shampoo::testing::classification_loss(run.model, sharding_batch(rank, 2), true);
    // Before synchronize(): every bucket was launched from a hook (one parameter each), and the
    // rank that does not own it released the gradient right after packing it.
    const auto params = run.model->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      if (run.sync->owner(i) != rank) {
        EXPECT_FALSE(params[i].grad().defined()) << i;
      }
    }
    run.sync->synchronize();
    expect_only_owned_gradients(run, rank);
  });
}

TEST(ShardedGradients, AccumulationWithNoSyncEqualsUnsharded) {
  run_ranks(2, [&](int rank, const Group& group) {
    auto reference = make_run(ShardingKind::kShampooRootInverse, group, false, 128);
    auto sharded = make_run(ShardingKind::kShampooRootInverse, group, true, 128);
    const auto data = sharding_batch(rank, 2);
    const auto half = data.inputs.size(0) / 2;
    const shampoo::testing::Dataset first{data.inputs.narrow(0, 0, half),
                                          data.labels.narrow(0, 0, half)};
    const shampoo::testing::Dataset second{data.inputs.narrow(0, half, half),
                                           data.labels.narrow(0, half, half)};
    for (int step = 0; step < 5; ++step) {
      for (TrainingRun* run : {&reference, &sharded}) {
        run->optimizer->zero_grad();
        {
          GradientSynchronizer::NoSync no_sync(*run->sync);
          shampoo::testing::classification_loss(run->model, first, true);
        }
        shampoo::testing::classification_loss(run->model, second, true);
        run->sync->synchronize();
        run->optimizer->step();
      }
      expect_only_owned_gradients(sharded, rank);
      ASSERT_TRUE(
          bit_equal(snapshot(sharded.model->parameters()), snapshot(reference.model->parameters())))
          << "step " << step;
    }
  });
}

// Fixed with gradient sharding: a parameter used in an accumulated micro-batch but not in the
// last one kept its local, unaveraged sum (the synchronizer only sent gradients that arrived in
// the synchronized backward).
TEST(GradientSynchronizerAccumulation, ParameterUsedOnlyInEarlierMicroBatchesIsAveraged) {
  for (const bool sharded : {false, true}) {
    run_ranks(2, [&](int rank, const Group& group) {
      auto a = at::ones({3}).requires_grad_();
      auto b = at::ones({2}).requires_grad_();
      GradientSynchronizer sync({a, b}, group);
      shampoo::ShardedOptimizer owners(
          {a, b},
          shampoo::group_optimizer_factory<torch::optim::SGD>(torch::optim::SGDOptions(0.1)),
          group);
      if (sharded) sync.shard_gradients(owners);
      {
        GradientSynchronizer::NoSync no_sync(sync);
        (a * (rank + 1.0)).sum().backward();  // a only: 1 on rank 0, 2 on rank 1
      }
      (b * 3.0).sum().backward();  // b only
      sync.synchronize();
      const bool holds_a = !sharded || owners.owners()[0] == rank;
      const bool holds_b = !sharded || owners.owners()[1] == rank;
      ASSERT_EQ(a.grad().defined(), holds_a) << "sharded " << sharded;
      if (holds_a) {
        EXPECT_TRUE(bit_equal(a.grad(), at::full({3}, 1.5f))) << "sharded " << sharded;
      }
      if (holds_b) {
        EXPECT_TRUE(bit_equal(b.grad(), at::full({2}, 3.0f))) << "sharded " << sharded;
      }
    });
  }
}

TEST(ShardedGradients, ClipGradNormEqualsLibTorchOnTheFullGradients) {
  for (const double norm_type : {2.0, 1.0, std::numeric_limits<double>::infinity()}) {
    for (const double max_norm : {0.05, 100.0}) {  // clipping, and not
      run_ranks(2, [&](int rank, const Group& group) {
        auto reference = make_run(ShardingKind::kShardedAdam, group, false, 128);
        auto sharded = make_run(ShardingKind::kShardedAdam, group, true, 128);
        const auto data = sharding_batch(rank, 2);
        for (int step = 0; step < 3; ++step) {
          for (TrainingRun* run : {&reference, &sharded}) {
            run->optimizer->zero_grad();
            shampoo::testing::classification_loss(run->model, data, true);
            run->sync->synchronize();
          }
          const double expected =
              torch::nn::utils::clip_grad_norm_(reference.model->parameters(), max_norm, norm_type);
          const double total = sharded.sync->clip_grad_norm_(max_norm, norm_type);
          EXPECT_EQ(total, expected) << "norm " << norm_type << " max " << max_norm;
          const auto full = reference.model->parameters();
          const auto mine = sharded.model->parameters();
          for (size_t i = 0; i < mine.size(); ++i) {
            if (mine[i].grad().defined()) {
              EXPECT_TRUE(bit_equal(mine[i].grad(), full[i].grad())) << "parameter " << i;
            }
          }
          reference.optimizer->step();
          sharded.optimizer->step();
        }
        EXPECT_TRUE(bit_equal(snapshot(sharded.model->parameters()),
                              snapshot(reference.model->parameters())));
      });
    }
  }
}

TEST(ShardedGradients, CheckpointSavedShardedResumesUnshardedAtWorld1) {
  const auto dir = std::filesystem::path(shampoo::testing::temp_path("zero2_ckpt"));
  shampoo::testing::remove_tree(dir);
  const auto options = shampoo::testing::sharding_shampoo_options(false);
  std::vector<at::Tensor> uninterrupted;
  std::vector<at::Tensor> at_save;
  std::mutex mutex;
  // World 2, sharded: 6 steps, a checkpoint after 3.
  run_ranks(2, [&](int rank, const Group& group) {
    auto run = make_run(ShardingKind::kShampooRootInverse, group, true, 128);
    for (int step = 0; step < 6; ++step) {
      train_step(run, sharding_batch(rank, 2), rank, true);
      if (step == 2) {
        shampoo::save_distributed_checkpoint(*run.optimizer, dir);
        std::lock_guard<std::mutex> lock(mutex);
        if (rank == 0) at_save = snapshot(run.model->parameters());
      }
    }
    std::lock_guard<std::mutex> lock(mutex);
    if (rank == 0) uninterrupted = snapshot(run.model->parameters());
  });
  // One process (no sharding), the full batch averaged as two halves: resumes from step 3.
  auto model = shampoo::testing::make_mlp(6, 10, 3, 5);
  {
    at::NoGradGuard no_grad;
    const auto params = model->parameters();
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(at_save[i]);
  }
  DistributedShampoo resumed(model->parameters(), options);
  shampoo::load_distributed_checkpoint(resumed, dir);
  for (int step = 3; step < 6; ++step) {
    resumed.zero_grad();
    for (int r = 0; r < 2; ++r) {
      shampoo::testing::classification_loss(model, sharding_batch(r, 2), true);
    }
    for (auto& p : model->parameters()) p.mutable_grad().div_(2.0);
    resumed.step();
  }
  const auto params = snapshot(model->parameters());
  for (size_t i = 0; i < params.size(); ++i) {
    // (g0 + g1) / 2 in one process accumulates g0 then adds g1: the same sums as the reduce.
    EXPECT_TRUE(all_close(params[i], uninterrupted[i])) << "parameter " << i;
  }
  shampoo::testing::remove_tree(dir);
}

TEST(ShardedGradientsErrors, ClearMessages) {
  // Shampoo's blocks of one parameter on several ranks.
  run_ranks(2, [&](int rank, const Group& group) {
    auto w = at::randn({40, 30}).requires_grad_();  // blocks of 16 columns: 2 x 2 blocks
    GradientSynchronizer sync({w}, group);
    DistributedShampoo split({w}, ShampooOptions::reference_defaults(0.01).max_preconditioner_dim(16),
                             DistributedOptions().process_group(group));
    expect_error([&] { sync.shard_gradients(split); },
                 {"blocks of parameter 0", "owned by ranks", "shard_by_parameter(true)"});
    DistributedShampoo whole({w}, ShampooOptions::reference_defaults(0.01).max_preconditioner_dim(16),
                             DistributedOptions().process_group(group).shard_by_parameter(true));
    sync.shard_gradients(whole);
    EXPECT_TRUE(sync.sharded());
  });
  // A single-process optimizer owns everything everywhere.
  run_ranks(2, [&](int, const Group& group) {
    auto w = at::randn({4, 3}).requires_grad_();
    GradientSynchronizer sync({w}, group);
    DistributedShampoo local({w}, ShampooOptions::reference_defaults(0.01));
    expect_error([&] { sync.shard_gradients(local); }, {"no process group"});
    // An optimizer that steps every parameter on every rank has no owners to shard by.
    torch::optim::Adam adam({w}, torch::optim::AdamOptions(0.01));
    expect_error([&] { sync.shard_gradients(adam); },
                 {"does not say which rank steps each parameter", "ShardedOptimizer",
                  "shard_by_parameter(true)", "InBackwardOptimizer"});
    EXPECT_FALSE(sync.sharded());
  });
  // Trainer subgroups.
  expect_error(
      [] { DistributedOptions().shard_by_parameter(true).num_trainers_per_group(2).validate(); },
      {"shard_by_parameter", "num_trainers_per_group"});
}

TEST(ShardedGradientsErrors, ParameterFrozenOnSomeRanksOnlyIsAnErrorOnEveryRank) {
  std::mutex mutex;
  std::vector<std::string> messages(2);
  run_ranks(2, [&](int rank, const Group& group) {
    auto a = at::ones({3}).requires_grad_();
    auto b = at::ones({2}).requires_grad_(rank == 0);  // frozen on rank 1 only
    try {
      GradientSynchronizer sync({a, b}, group);
      ADD_FAILURE() << "rank " << rank << ": no error";
    } catch (const c10::Error& e) {
      std::lock_guard<std::mutex> lock(mutex);
      messages[rank] = e.what();
    }
  });
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_NE(messages[rank].find("need no gradient"), std::string::npos) << messages[rank];
    EXPECT_NE(messages[rank].find("parameter 1"), std::string::npos) << messages[rank];
  }
  // Frozen on every rank: broadcast, never synchronized, no error.
  run_ranks(2, [&](int rank, const Group& group) {
    auto a = at::full({3}, static_cast<float>(rank)).requires_grad_();
    auto frozen = at::full({2}, static_cast<float>(rank));
    GradientSynchronizer sync({a, frozen}, group);
    EXPECT_TRUE(bit_equal(frozen, at::zeros({2})));  // rank 0's values
    EXPECT_EQ(sync.owner(1), -2);
    (a * (rank + 1.0)).sum().backward();
    sync.synchronize();
    EXPECT_TRUE(bit_equal(a.grad(), at::full({3}, 1.5f)));
  });
}

}  // namespace
