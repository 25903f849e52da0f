#include "examples/distributed_batch_sampler.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/randperm.h>
#include <c10/util/Exception.h>

namespace shampoo::examples {

DistributedBatchSampler::DistributedBatchSampler(int64_t num_examples, int64_t local_batch_size,
                                                 int64_t world_size, int64_t rank, uint64_t seed)
    : num_examples_(num_examples),
      local_batch_size_(local_batch_size),
      world_size_(world_size),
      rank_(rank),
      seed_(seed),
      batches_per_epoch_(
          local_batch_size * world_size > 0 ? num_examples / (local_batch_size * world_size) : 0) {
  TORCH_CHECK(local_batch_size >= 1, "DistributedBatchSampler: local batch size ", local_batch_size,
              ", expected >= 1");
  TORCH_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "DistributedBatchSampler: rank ",
              rank, " of world size ", world_size);
  TORCH_CHECK(batches_per_epoch_ >= 1, "the training set holds ", num_examples,
              " examples, fewer than one global batch of ", local_batch_size * world_size, " (",
              local_batch_size, " per rank x ", world_size,
              " ranks); use a smaller --global-batch-size or --local-batch-size");
}

at::Tensor DistributedBatchSampler::epoch_order(int64_t epoch) const {
  // A generator of its own, seeded from (seed, epoch): the order does not depend on what else
  // drew random numbers, nor on how many epochs ran before in this process (resume).
  const uint64_t epoch_seed = seed_ * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(epoch);
  auto generator = at::make_generator<at::CPUGeneratorImpl>(epoch_seed);
  return at::randperm(num_examples_, generator, at::TensorOptions().dtype(at::kLong));
}

at::Tensor DistributedBatchSampler::local_batch(const at::Tensor& order, int64_t batch) const {
  TORCH_INTERNAL_ASSERT(batch >= 0 && batch < batches_per_epoch_);
  const int64_t begin = batch * global_batch_size() + rank_ * local_batch_size_;
  return order.slice(0, begin, begin + local_batch_size_);
}

}  // namespace shampoo::examples
