#pragma once
/// Which training examples each rank reads in each iteration (the role of PyTorch's
/// DistributedSampler + DataLoader). Every epoch shuffles [0, n) with a permutation drawn from
/// (seed, epoch) alone, identical on every rank and independent of the world size; it is cut
/// into global batches of local_batch_size · world_size examples (a last partial global batch is
/// dropped, so every rank runs the same number of equal steps), and rank r reads the r-th slice
/// of local_batch_size examples of each global batch. So one process with batch 2B and two ranks
/// with local batch B see the same global batches: a global batch holds the same examples at any
/// number of ranks, which is what lets a run resume at another world size.

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace shampoo::examples {

class DistributedBatchSampler {
 public:
  /// Throws c10::Error when the data set holds fewer than one global batch.
  DistributedBatchSampler(int64_t num_examples, int64_t local_batch_size, int64_t world_size,
                          int64_t rank, uint64_t seed);

  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  int64_t global_batch_size() const { return local_batch_size_ * world_size_; }

  /// The shuffled order of the examples in `epoch` (int64 [n]); the same on every rank.
  at::Tensor epoch_order(int64_t epoch) const;
  /// This rank's example indices of batch `batch` (0-based) of an epoch with order `order`.
  at::Tensor local_batch(const at::Tensor& order, int64_t batch) const;

 private:
  int64_t num_examples_;
  int64_t local_batch_size_;
  int64_t world_size_;
  int64_t rank_;
  uint64_t seed_;
  int64_t batches_per_epoch_;
};

}  // namespace shampoo::examples
