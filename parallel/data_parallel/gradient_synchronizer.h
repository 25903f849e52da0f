#pragma once
/// Data-parallel gradient averaging for C++ training loops (LibTorch has no C++
/// DistributedDataParallel). Parameters are broadcast from rank 0 at construction; during
/// backward, gradients are packed into buckets (reverse registration order, the order autograd
/// produces them) and each full bucket's collective starts at once, overlapping the rest of
/// backward. synchronize() finishes the remaining buckets and writes the averaged gradients.
///
///   shampoo::GradientSynchronizer sync(model->parameters(), group);
///   loss.backward(); sync.synchronize(); optimizer.step();
///
/// Clipping under gradient sharding: LibTorch's torch::nn::utils::clip_grad_norm_ sees only the
/// gradients this rank holds, so it clips every rank by a different, partial norm, and nothing
/// can detect the call. Clip with shampoo::clip_grad_norm_(optimizer, max_norm)
/// (parallel/clip_grad_norm.h) or sync.clip_grad_norm_(max_norm): the global norm.
///
/// Gradient sharding (ZeRO-2, shard_gradients): with an optimizer whose ranks each step a subset
/// of the parameters (ShardedOptimizer, DistributedShampoo with
/// DistributedOptions::shard_by_parameter, InBackwardOptimizer), each bucket holds the
/// parameters of one owner and is reduced to that owner alone; every other rank releases those
/// gradients as soon as their bucket has been packed. After synchronize() a rank holds the
/// averaged gradients of the parameters it owns (and of those every rank steps) and no others.
///
///   shampoo::ShardedOptimizer opt(model->parameters(), factory, group);
///   sync.shard_gradients(opt);
///   loss.backward(); sync.synchronize(); shampoo::clip_grad_norm_(opt, 1.0); opt.step();

#include <ATen/ATen.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

namespace shampoo {

class ParameterOwners;  // parallel/optimizers/parameter_owners.h

struct GradientSynchronizerOptions {
  /// Bucket size in bytes (a parameter larger than this gets a bucket of its own).
  TORCH_ARG(int64_t, bucket_cap_bytes) = 25 * 1024 * 1024;
  /// Copy rank 0's parameter values to every rank at construction.
  TORCH_ARG(bool, broadcast_parameters) = true;

 public:
  /// Every field equal (as LibTorch's options compare).
  bool operator==(const GradientSynchronizerOptions&) const = default;
};

class GradientSynchronizer {
 public:
  /// `params`: the model's parameters, the same on every rank. Those that require no gradient on
  /// every rank (frozen) are broadcast but not synchronized; one that requires a gradient on
  /// some ranks only is an error on every rank. A frozen one unfrozen later (requires_grad on,
  /// its layer added to the optimizer) is averaged from the first synchronize() in which it has
  /// a gradient on, with the others (with gradient sharding, reduced to the owner the optimizer
  /// names for it then; all-reduced when the optimizer does not know it yet). Collective.
  GradientSynchronizer(std::vector<at::Tensor> params, c10::intrusive_ptr<c10d::ProcessGroup> group,
                       GradientSynchronizerOptions options = {});
  ~GradientSynchronizer();
  GradientSynchronizer(const GradientSynchronizer&) = delete;
  GradientSynchronizer& operator=(const GradientSynchronizer&) = delete;

  /// A parameter's owner when every rank steps it (its gradient is all-reduced).
  static constexpr int kEveryRank = -1;

  /// Gradient sharding (ZeRO-2): from now on the gradient of each parameter reaches only the rank
  /// that `optimizer` says steps it (a reduce to that rank; all-reduced for a parameter every
  /// rank steps and for those `optimizer` does not know), and the other ranks release it.
  /// `optimizer` is one whose ranks each step a subset of the parameters (ShardedOptimizer,
  /// DistributedShampoo with DistributedOptions::shard_by_parameter, InBackwardOptimizer; any
  /// other is an error naming them), over a process group of the same ranks, and must outlive
  /// the synchronizer (it is asked for the owners of parameters added later). Collective: every
  /// rank calls it, between backward passes; the ranks' owner maps are checked to agree. The bucket
  /// layout is rebuilt (one owner per bucket) and the persistent all-reduce buffers of sharded
  /// buckets are freed: a reduce buffer lives from its bucket's launch to its finish.
  void shard_gradients(const torch::optim::Optimizer& optimizer);
  /// Whether shard_gradients was called.
  bool sharded() const { return sharded_; }
  /// Owner of synchronized parameter `index` (in the order given at construction), or
  /// kEveryRank (always, before shard_gradients). -2 for a frozen parameter.
  int owner(size_t index) const;

  /// Launches the buckets still pending (gradients that never arrived count as zero; a
  /// parameter without a gradient on every rank keeps an undefined gradient), waits for all
  /// collectives and writes the averages into the gradients of the parameters this rank holds
  /// (all of them unless sharded). Every rank must call it once per backward.
  void synchronize();

  /// Gradient clipping by global norm after synchronize(), sharded or not (the result of
  /// torch::nn::utils::clip_grad_norm_ on the full averaged gradients, bit for bit): every rank
  /// computes the norms of the gradients it owns, one all-reduce of the per-parameter norms
  /// gives every rank the total, and each rank scales its own gradients by
  /// min(1, max_norm / (total + 1e-6)). Returns the total norm. `norm_type` > 0 or infinity.
  /// Collective.
  double clip_grad_norm_(double max_norm, double norm_type = 2.0);

  /// Called (during backward or in synchronize()) with a bucket's parameters as soon as their
  /// averaged gradients are written, e.g. to step them right away (optimizer-in-backward). Every
  /// rank calls it for every bucket in the same order; with sharding, the ranks that do not own
  /// the bucket get its parameters without gradients.
  void set_bucket_ready_callback(std::function<void(const std::vector<at::Tensor>&)> callback);

  /// While alive, backward passes only accumulate gradients locally (gradient accumulation);
  /// the next backward outside it synchronizes the accumulated sums (sharded: reduced to their
  /// owners, so the full local sums live on every rank until then, as in fairscale's ShardedDDP).
  class NoSync {
   public:
    explicit NoSync(GradientSynchronizer& owner);
    ~NoSync();

   private:
    GradientSynchronizer& owner_;
    bool previous_;
  };

  /// Disabled, backward passes only accumulate locally and synchronize() does nothing (what
  /// NoSync does for a scope; optimizer-in-backward sets it per pass for gradient accumulation).
  void set_enabled(bool enabled) { enabled_ = enabled; }
  bool enabled() const { return enabled_; }

  int64_t num_buckets() const { return static_cast<int64_t>(buckets_.size()); }
  /// Buckets whose collective was started from a gradient hook (during backward) in the last
  /// synchronized iteration.
  int64_t buckets_started_in_backward() const { return started_in_backward_; }
  /// Bytes of the gradients of the synchronized parameters this rank holds now, and of the
  /// synchronizer's own buffers (persistent all-reduce buffers, reduce buffers in flight).
  int64_t gradient_bytes() const;
  int64_t buffer_bytes() const;

  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const { return group_; }

 private:
  struct Bucket {
    std::vector<int64_t> params;             // indices into params_
    std::vector<int64_t> offsets;            // element offset of each param in the buffer
    int root = kEveryRank;                   // reduce target, or all-reduce
    int64_t numel = 0;                       // flags + values
    at::TensorOptions options;
    at::Tensor buffer;  // [flags (one per param) | values]; persistent only when all-reduced
    int64_t ready = 0;
    c10::intrusive_ptr<c10d::Work> work;
  };

  void on_grad_ready(int64_t param);
  void launch_ready_buckets(bool from_hook);
  void launch(Bucket& bucket);
  void finish(Bucket& bucket);
  /// Builds buckets_ from owners_ (one owner, dtype and device per bucket).
  void build_buckets();
  bool holds(int64_t param) const;
  void add_hook(size_t param);
  /// Frozen parameters that have a gradient now (unfrozen): averaged and synchronized from now.
  void adopt_unfrozen();

  std::vector<at::Tensor> given_;                   // every parameter given, frozen ones included
  const ParameterOwners* owners_source_ = nullptr;  // shard_gradients' optimizer
  std::vector<at::Tensor> params_;        // the synchronized (gradient-requiring) parameters
  std::vector<int64_t> given_index_;      // their positions in the list given
  std::vector<int64_t> synchronized_of_;  // per given position: index into params_, or -1
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  GradientSynchronizerOptions options_;
  std::vector<int> owners_;  // per param: rank or kEveryRank
  bool sharded_ = false;
  std::vector<Bucket> buckets_;
  std::vector<int64_t> bucket_of_;     // per param
  std::vector<int64_t> hook_handles_;  // per param
  std::vector<bool> arrived_;          // per param, this synchronized pass
  std::vector<bool> accumulated_;      // per param: a gradient accumulated since the last sync
  int64_t next_to_launch_ = 0;
  int64_t next_to_finish_ = 0;
  int64_t started_in_backward_ = 0;
  int64_t started_this_iteration_ = 0;
  bool enabled_ = true;
  mutable std::mutex mutex_;
  std::function<void(const std::vector<at::Tensor>&)> bucket_ready_;
};

}  // namespace shampoo
