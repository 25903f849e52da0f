#pragma once
/// Data-parallel gradient averaging for C++ training loops (LibTorch has no C++
/// DistributedDataParallel). Parameters are broadcast from rank 0 at construction; during
/// backward, gradients are packed into buckets (reverse registration order, the order autograd
/// produces them) and each full bucket's all-reduce starts at once, overlapping the rest of
/// backward. synchronize() finishes the remaining buckets and writes the averaged gradients.
///
///   shampoo::GradientSynchronizer sync(model->parameters(), group);
///   loss.backward(); sync.synchronize(); optimizer.step();

#include <ATen/ATen.h>
#include <torch/arg.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

namespace shampoo {

struct GradientSynchronizerOptions {
  /// Bucket size in bytes (a parameter larger than this gets a bucket of its own).
  TORCH_ARG(int64_t, bucket_cap_bytes) = 25 * 1024 * 1024;
  /// Copy rank 0's parameter values to every rank at construction.
  TORCH_ARG(bool, broadcast_parameters) = true;
};

class GradientSynchronizer {
 public:
  GradientSynchronizer(std::vector<at::Tensor> params, c10::intrusive_ptr<c10d::ProcessGroup> group,
                       GradientSynchronizerOptions options = {});
  ~GradientSynchronizer();
  GradientSynchronizer(const GradientSynchronizer&) = delete;
  GradientSynchronizer& operator=(const GradientSynchronizer&) = delete;

  /// Launches the buckets still pending (gradients that never arrived count as zero; a
  /// parameter without a gradient on every rank keeps an undefined gradient), waits for all
  /// all-reduces and writes the averages into the parameters' gradients. Every rank must call
  /// it once per backward.
  void synchronize();

  /// Called (during backward or in synchronize()) with a bucket's parameters as soon as their
  /// averaged gradients are written, e.g. to step them right away (optimizer-in-backward).
  void set_bucket_ready_callback(std::function<void(const std::vector<at::Tensor>&)> callback);

  /// While alive, backward passes only accumulate gradients locally (gradient accumulation);
  /// the next backward outside it synchronizes the accumulated sums.
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
  /// Buckets whose all-reduce was started from a gradient hook (during backward) in the last
  /// synchronized iteration.
  int64_t buckets_started_in_backward() const { return started_in_backward_; }

 private:
  struct Bucket {
    std::vector<int64_t> params;   // indices into params_
    std::vector<int64_t> offsets;  // element offset of each param in the buffer
    at::Tensor buffer;             // [flags (one per param) | values]
    int64_t ready = 0;
    bool launched = false;
    c10::intrusive_ptr<c10d::Work> work;
  };

  void on_grad_ready(int64_t param);
  void launch_ready_buckets(bool from_hook);
  void launch(Bucket& bucket);
  void finish(Bucket& bucket);

  std::vector<at::Tensor> params_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  GradientSynchronizerOptions options_;
  std::vector<Bucket> buckets_;
  std::vector<int64_t> bucket_of_;     // per param
  std::vector<int64_t> hook_handles_;  // per param
  std::vector<bool> arrived_;          // per param, this iteration
  int64_t next_to_launch_ = 0;
  int64_t next_to_finish_ = 0;
  int64_t started_in_backward_ = 0;
  int64_t started_this_iteration_ = 0;
  bool enabled_ = true;
  std::mutex mutex_;
  std::function<void(const std::vector<at::Tensor>&)> bucket_ready_;
};

}  // namespace shampoo
