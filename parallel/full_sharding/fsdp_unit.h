#pragma once
/// A unit of full sharding (FSDP2's parameter group): parameters gathered and released together,
/// their gradients reduced together, stepped together. Internal: not installed.

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "parallel/full_sharding/param_slot.h"
#include "parallel/full_sharding/shard_mesh.h"
#include "parallel/optimizers/local_optimizer.h"

namespace shampoo::detail {

struct FsdpUnit {
  std::string name;
  const ShardMesh* mesh = nullptr;  // the wrapper's, which outlives its units
  std::vector<ParamSlot> params;
  int64_t shard_numel = 0;                    // padded chunks of every parameter
  at::TensorOptions options;                  // of the parameters and their shards
  at::ScalarType dtype = at::kFloat;          // the parameters' own
  at::ScalarType compute_dtype = at::kFloat;  // of the gathered parameters (param_dtype)
  at::ScalarType reduce_dtype = at::kFloat;   // of the gradient reduction
  std::atomic<bool> gathered{true};
  int64_t arrived = 0;
  bool in_pass = false;     // ran forward with gradients in the current pass
  bool to_step = false;     // reduced gradients waiting for step()
  bool owned_kept = false;  // the owner's parameters kept from the backward gather for the step
  std::unique_ptr<LocalOptimizer> optimizer;  // local shards: over this rank's rows
  std::shared_future<void> pending;           // its step on the worker

  /// All-gathers the chunks over `via` into the full parameters (in the compute dtype): one
  /// all-gather per parameter, straight into its storage when its rows split evenly (else
  /// through a padded buffer), all in flight at once. Nothing when gathered.
  void gather(c10d::ProcessGroup& via);
  /// Releases the full parameters (nothing when not gathered).
  void reshard();
  /// Releases every parameter's full storage, whatever `gathered` says (the owners' parameters
  /// given their full values for a lossless step).
  void release_storage();
  /// Gives the (released) parameter its full value in its own dtype: every rank's rows,
  /// all-gathered over the shard group. Collective.
  void materialize(ParamSlot& slot, const std::string& what);
  /// Lossless: every rank sends each owner its rows of the owner's parameters over `via`; the
  /// owners' parameters get their full values (in their own dtype).
  void collect_rows(c10d::ProcessGroup& via);
  /// Lossless: each owner sends every rank that rank's rows of the parameters it stepped.
  void scatter_rows(c10d::ProcessGroup& via);
  /// Split across replicas: each owned parameter's stepped full value, from the replica that
  /// stepped it to this shard rank of the others, over `replicas_via`. Nothing otherwise.
  void broadcast_stepped(const c10::intrusive_ptr<c10d::ProcessGroup>& replicas_via);
  /// Lossless: each whole gradient summed into its owner's copy and averaged there.
  void reduce_to_owners(std::vector<at::Tensor> grads);
  /// Local shards: a reduce-scatter of the rank-major row chunks (padded), averaged.
  void reduce_to_rows(std::vector<at::Tensor> grads);
  /// Drops the reduced gradients: nothing of this unit steps (lossless: the owned parameters
  /// kept for the step are released).
  void drop_step(bool lossless);
  /// Waits for the unit's step on the worker and rethrows its failure.
  void wait();
  /// "parameter i ... holds inf or NaN" for the first owned averaged gradient that does, else "".
  std::string non_finite_gradient() const;
  /// The numbers that describe the unit (parameter count, shapes, dtype, device), hashed.
  int64_t fingerprint() const;
  std::string describe() const;
  /// Meta tensors of the parameters' full shapes.
  std::vector<at::Tensor> shapes() const;

 private:
  /// Per rank: the elements of the chunks of the unit's parameters that rank owns.
  std::vector<int64_t> chunks_by_owner() const;
  /// Hybrid: sums `sums` (what this rank reduced within its shard group) over the replica group.
  void reduce_across_replicas(const std::vector<at::Tensor>& sums);
};

}  // namespace shampoo::detail
