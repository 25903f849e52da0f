// The data-parallel gradient synchronizer: rank 0's parameters everywhere, averaged gradients,
// buckets started from autograd hooks during backward, parameters without gradients, and
// gradient accumulation.
#include <shampoo/shampoo.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>

#include <mutex>

#include "support/test_support.h"

namespace {

using shampoo::GradientSynchronizer;
using shampoo::GradientSynchronizerOptions;
using shampoo::testing::all_close;
using shampoo::testing::bit_equal;
using shampoo::testing::run_ranks;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

/// Gradients of the MLP on shard `rank` of a fixed batch.
shampoo::testing::Dataset shard(int rank, int world) {
  const auto data = shampoo::testing::make_blobs(64, 6, 3, /*seed=*/4);
  const int64_t size = 64 / world;
  return {data.inputs.narrow(0, rank * size, size), data.labels.narrow(0, rank * size, size)};
}

TEST(GradientSynchronizer, BroadcastsRankZerosParameters) {
  std::mutex mutex;
  std::vector<std::vector<at::Tensor>> seen(3);
  run_ranks(3, [&](int rank, const Group& group) {
    auto model = shampoo::testing::make_mlp(6, 8, 3, /*seed=*/100 + rank);  // differ per rank
    GradientSynchronizer sync(model->parameters(), group);
    std::lock_guard<std::mutex> lock(mutex);
    for (const auto& p : model->parameters()) seen[rank].push_back(p.detach().clone());
  });
  const auto rank0 = shampoo::testing::make_mlp(6, 8, 3, 100)->parameters();
  for (int rank = 0; rank < 3; ++rank) {
    for (size_t i = 0; i < rank0.size(); ++i) {
      EXPECT_TRUE(bit_equal(seen[rank][i], rank0[i].detach())) << "rank " << rank;
    }
  }
}

TEST(GradientSynchronizer, AveragesGradientsWithBucketsStartedDuringBackward) {
  constexpr int kWorld = 2;
  // Expected: the mean of the per-shard gradients, computed in one process.
  std::vector<at::Tensor> expected;
  for (int rank = 0; rank < kWorld; ++rank) {
    auto model = shampoo::testing::make_mlp(6, 8, 3, 7);
    shampoo::testing::classification_loss(model, shard(rank, kWorld), true);
    const auto params = model->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      if (rank == 0)
        expected.push_back(params[i].grad().clone() / kWorld);
      else
        expected[i] += params[i].grad() / kWorld;
    }
  }
  run_ranks(kWorld, [&](int rank, const Group& group) {
    auto model = shampoo::testing::make_mlp(6, 8, 3, 7);
    // Tiny buckets: one per parameter, so most start while backward is still running.
    GradientSynchronizer sync(model->parameters(), group,
                              GradientSynchronizerOptions().bucket_cap_bytes(64));
    EXPECT_EQ(sync.num_buckets(), 6);
    for (int iteration = 0; iteration < 2; ++iteration) {
      model->zero_grad();
      shampoo::testing::classification_loss(model, shard(rank, kWorld), true);
      sync.synchronize();
      const auto params = model->parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_TRUE(all_close(params[i].grad(), expected[i])) << "parameter " << i;
      }
      EXPECT_GT(sync.buckets_started_in_backward(), 0);
    }
  });
}

TEST(GradientSynchronizer, ParametersWithoutGradients) {
  run_ranks(2, [&](int rank, const Group& group) {
    auto used = at::ones({3}).requires_grad_();
    auto unused = at::ones({2}).requires_grad_();
    auto rank0_only = at::ones({4}).requires_grad_();
    GradientSynchronizer sync({used, unused, rank0_only}, group);
    auto loss = (used * (rank + 1)).sum();
    if (rank == 0) loss = loss + (rank0_only * 2.0).sum();
    loss.backward();
    sync.synchronize();
    EXPECT_TRUE(all_close(used.grad(), at::full({3}, 1.5)));        // (1 + 2) / 2
    EXPECT_FALSE(unused.grad().defined());                          // nobody had one
    EXPECT_TRUE(all_close(rank0_only.grad(), at::full({4}, 1.0)));  // (2 + 0) / 2
  });
}

TEST(GradientSynchronizer, OptionsThatDecideTheBucketsMustAgreeAcrossRanks) {
  // Other bucket sizes on one rank made other all-reduces (Gloo ended the process, or buckets of
  // equal size averaged other parameters' gradients); an error on every rank now.
  run_ranks(2, [&](int rank, const Group& group) {
    auto a = at::ones({300}).requires_grad_();
    auto b = at::ones({300}).requires_grad_();
    shampoo::testing::expect_error(
        [&] {
          GradientSynchronizer sync(
              {a, b}, group,
              shampoo::GradientSynchronizerOptions().bucket_cap_bytes(rank == 0 ? 1200 : 2400));
        },
        {"GradientSynchronizer: every rank must be constructed with the same options",
         "GradientSynchronizerOptions.bucket_cap_bytes differs between the ranks: rank 1 has "
         "2400, rank 0 has 1200"});
  });
}

TEST(GradientSynchronizer, TheSameElementsInAnotherOrderAreAnError) {
  // Rank 1 lists the two parameters the other way round: the buckets followed each rank's list,
  // so a's gradient was averaged with b's. An error on every rank at construction now.
  run_ranks(2, [&](int rank, const Group& group) {
    auto a = at::ones({4, 3}).requires_grad_();
    auto b = at::ones({3, 4}).requires_grad_();
    shampoo::testing::expect_error(
        [&] {
          GradientSynchronizer sync(
              rank == 0 ? std::vector<at::Tensor>{a, b} : std::vector<at::Tensor>{b, a}, group);
        },
        {"in other shapes or dtypes, or in another order", "same parameters in the same order"});
  });
}

TEST(GradientSynchronizer, NoSyncAccumulatesMicroBatches) {
  run_ranks(2, [&](int rank, const Group& group) {
    auto w = at::ones({5}).requires_grad_();
    GradientSynchronizer sync({w}, group);
    {
      GradientSynchronizer::NoSync no_sync(sync);
      (w * (rank + 1)).sum().backward();  // local only
      sync.synchronize();                 // a no-op inside NoSync
      EXPECT_TRUE(bit_equal(w.grad(), at::full({5}, static_cast<float>(rank + 1))));
    }
    (w * 10.0).sum().backward();  // accumulated: rank + 1 + 10, then averaged
    sync.synchronize();
    EXPECT_TRUE(all_close(w.grad(), at::full({5}, (1 + 2 + 20) / 2.0)));
  });
}

TEST(GradientSynchronizer, DataParallelShampooTrainsLikeFullBatch) {
  // Full batch in one process vs two ranks on half batches with averaged gradients: the same
  // mathematical step (up to the rounding of the average).
  auto reference = shampoo::testing::make_mlp(6, 8, 3, 9);
  const auto options =
      shampoo::ShampooOptions::reference_defaults(0.02).epsilon(1e-3).precondition_frequency(2).grafting(
          shampoo::AdamGraftingConfig{});
  shampoo::DistributedShampoo single(reference->parameters(), options);
  const auto full = shampoo::testing::make_blobs(64, 6, 3, 4);
  for (int step = 0; step < 5; ++step) {
    single.zero_grad();
    shampoo::testing::classification_loss(reference, full, true);
    single.step();
  }
  run_ranks(2, [&](int rank, const Group& group) {
    auto model = shampoo::testing::make_mlp(6, 8, 3, 9);
    GradientSynchronizer sync(model->parameters(), group);
    shampoo::DistributedShampoo opt(model->parameters(), options,
                                    shampoo::DistributedOptions().process_group(group));
    for (int step = 0; step < 5; ++step) {
      opt.zero_grad();
      shampoo::testing::classification_loss(model, shard(rank, 2), true);
      sync.synchronize();
      opt.step();
    }
    const auto expected = reference->parameters();
    const auto actual = model->parameters();
    for (size_t i = 0; i < actual.size(); ++i) {
      // Averaging two half-batch gradients rounds differently from one full-batch mean; the
      // Shampoo roots amplify such differences (by up to epsilon^(-1/4) on rank-deficient
      // factors, hence epsilon 1e-3 here: with 1e-8 they reach 1e-2 after five steps).
      EXPECT_TRUE(all_close(actual[i], expected[i], {1e-4, 1e-5})) << "parameter " << i;
    }
  });
}

// A layer frozen when the synchronizer was built, unfrozen at iteration 3 and added to the
// optimizer: its gradients are averaged from then on, so the run equals the one whose
// synchronizer saw the layer trainable from the start (bit for bit at world 2), with and without
// gradient sharding. Before, each rank stepped it with its own gradient.
TEST(GradientSynchronizer, ALayerUnfrozenLaterIsAveraged) {
  for (const bool sharded : {false, true}) {
    std::vector<std::vector<at::Tensor>> results(2);
    for (const bool frozen_at_start : {false, true}) {
      std::mutex mutex;
      run_ranks(2, [&](int rank, const Group& group) {
        const auto data = shard(rank, 2);
        auto model = shampoo::testing::make_mlp(6, 8, 3, /*seed=*/3);
        auto first = model->ptr(0)->parameters();  // the layer unfrozen at iteration 3
        std::vector<at::Tensor> rest;
        for (size_t m = 1; m < model->size(); ++m) {
          for (const auto& p : model->ptr(m)->parameters()) rest.push_back(p);
        }
        if (frozen_at_start) {
          for (auto& p : first) p.set_requires_grad(false);
        }
        GradientSynchronizer sync(model->parameters(), group);
        const auto adam =
            shampoo::group_optimizer_factory<torch::optim::Adam>(torch::optim::AdamOptions(0.01));
        shampoo::ShardedOptimizer optimizer(rest, adam, group);
        if (sharded) sync.shard_gradients(optimizer);
        for (int step = 0; step < 6; ++step) {
          if (step == 3) {
            for (auto& p : first) p.set_requires_grad(true);
            optimizer.add_param_group(torch::optim::OptimizerParamGroup(first));
          }
          model->zero_grad();
          shampoo::testing::classification_loss(model, data, /*backward=*/true);
          sync.synchronize();
          optimizer.step();
        }
        auto values = shampoo::testing::snapshot(model->parameters());
        std::lock_guard<std::mutex> lock(mutex);
        if (rank == 0) results[frozen_at_start ? 1 : 0] = values;
      });
    }
    EXPECT_TRUE(bit_equal(results[1], results[0])) << "sharded " << sharded;
  }
}

}  // namespace
