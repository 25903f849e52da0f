#pragma once
/// Gradient clipping by global norm for every optimizer of this library, where LibTorch's
/// torch::nn::utils::clip_grad_norm_ cannot see every gradient:
///
///   loss.backward();
///   sync.synchronize();                           // data parallelism, gradient sharding
///   shampoo::clip_grad_norm_(optimizer, 1.0);      // not torch::nn::utils::clip_grad_norm_
///   optimizer.step();
///
/// Under gradient sharding (ZeRO-2) a rank holds only the gradients of the parameters it owns,
/// so LibTorch's function would clip each rank's gradients by that rank's own norm, differently
/// on every rank, and nothing can tell it apart from a correct call. This one computes the norm
/// one process would compute over the full averaged gradients (bit for bit) and scales what each
/// rank holds.

#include <torch/optim/optimizer.h>

namespace shampoo {

/// Clips the gradients of `optimizer`'s parameters by their global norm, as
/// torch::nn::utils::clip_grad_norm_ does for one process on the full averaged gradients (the
/// same bits): scale min(1, max_norm / (total + 1e-6)). Returns the total norm. `norm_type` > 0
/// or infinity. Works out where the gradients are:
/// - an optimizer whose ranks own parameters (ShardedOptimizer, InBackwardOptimizer's sets,
///   DistributedShampoo with DistributedOptions::shard_by_parameter), sharded by a
///   GradientSynchronizer or not: each rank counts the norms of the parameters it owns, one
///   small all-reduce gives every rank the total. Collective: every rank calls it.
/// - FullyShardedDataParallel::optimizer(): the wrapper's clip_grad_norm_ (overlap_step(false);
///   with overlap the units stepped during backward, which is an error that says so).
/// - any other optimizer (one process, or data parallelism with replicated gradients):
///   LibTorch's clip_grad_norm_ over its parameters.
/// An InBackwardOptimizer steps during backward, before every gradient exists: an error.
double clip_grad_norm_(torch::optim::Optimizer& optimizer, double max_norm,
                       double norm_type = 2.0);

}  // namespace shampoo
