#pragma once
/// Data-parallel training runs with and without gradient sharding (ZeRO-2), shared by
/// gradient_sharding_test (ranks as threads) and torchrun_sharding_test (processes under
/// torchrun): the same model, data and optimizers, and one check that a sharded run trains as
/// the unsharded one.

#include <shampoo/shampoo.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <memory>
#include <string>

#include "support/test_support.h"

namespace shampoo::testing {

/// Shard `rank` of a fixed batch of 96 points (6 features, 3 classes).
Dataset sharding_batch(int rank, int world);

enum class ShardingKind {
  kShampooRootInverse,
  kShampooEigenvalueCorrected,
  kShardedAdam,
  kInBackwardShampoo,
  kInBackwardShardedAdam,
};
std::string kind_name(ShardingKind kind);
bool in_backward(ShardingKind kind);
bool is_shampoo(ShardingKind kind);

/// The options of the Shampoo kinds (Adam grafting, roots every 3 steps).
ShampooOptions sharding_shampoo_options(bool eigenvalue_corrected);

/// A model (make_mlp(6, 10, 3, seed 5)), its synchronizer (buckets of `bucket_cap` bytes) and
/// the optimizer of `kind`: stepped by hand, or in backward. `sharded`: the synchronizer shards
/// the gradients by the optimizer's owners (Shampoo then owns whole parameters).
struct TrainingRun {
  torch::nn::Sequential model;
  std::unique_ptr<GradientSynchronizer> sync;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::unique_ptr<InBackwardOptimizer> in_backward;
};
TrainingRun make_run(ShardingKind kind, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                     bool sharded, int64_t bucket_cap);

/// After synchronize(): the rank holds exactly the gradients of the parameters it owns, and no
/// reduce buffer.
void expect_only_owned_gradients(const TrainingRun& run, int rank);

/// One training step (in backward: forward and backward only); `check_sharding` checks the
/// gradients held after synchronize().
void train_step(TrainingRun& run, const Dataset& data, int rank, bool check_sharding);

/// What check_sharded_equals_unsharded saw of the first step's reduced gradients.
struct GradientAgreement {
  int64_t elements = 0;
  int64_t bit_equal = 0;
};

/// On one rank of `world`: 20 steps of an unsharded and a sharded run of `kind`, side by side.
/// World 2: the parameters bit for bit equal. Other worlds: the first step's reduced gradients
/// within float32 tolerance of the all-reduced ones (counted in `agreement`), Adam's parameters
/// within float32 tolerance after 20 steps, Shampoo's training loss within 2 %.
void check_sharded_equals_unsharded(ShardingKind kind, int rank, int world,
                                    const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                    GradientAgreement& agreement);

}  // namespace shampoo::testing
