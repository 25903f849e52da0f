#pragma once
/// Training-loss bookkeeping of the reference's LossMetrics (facebookresearch/optimizers,
/// distributed_shampoo/examples): per rank, the lifetime loss (mean of every iteration's loss so
/// far) and the window loss (mean of the last `window_size` iterations); globally, their means
/// over the ranks (one all-reduce).

#include <torch/serialize/archive.h>

#include <cstdint>
#include <deque>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace shampoo::examples {

/// Losses of one iteration: this rank's and (with a process group) the means over the ranks.
struct IterationLosses {
  double loss = 0;
  double lifetime_loss = 0;
  double window_loss = 0;
};

class LossMetrics {
 public:
  /// window_size ≥ 1.
  explicit LossMetrics(int64_t window_size);

  /// Records the loss of the next iteration.
  void update(double loss);

  /// Iterations recorded.
  int64_t iteration() const { return iteration_; }
  /// This rank's losses after the last update().
  IterationLosses local() const;
  /// The means over the ranks of `group` of local() (collective: every rank calls it); local()
  /// when `group` is null.
  IterationLosses global(const c10::intrusive_ptr<c10d::ProcessGroup>& group) const;

  /// The means over the ranks of `group` of every rank's running sum, last loss and window
  /// (collective: every rank calls it): the metrics of the global batches' losses, as one process
  /// training on them would have recorded them, up to rounding. A copy when `group` is null.
  LossMetrics mean_over_ranks(const c10::intrusive_ptr<c10d::ProcessGroup>& group) const;

  /// Checkpoints (the window and the running sum, so a resumed run prints the same losses).
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

 private:
  int64_t window_size_;
  int64_t iteration_ = 0;
  double loss_sum_ = 0;
  double last_loss_ = 0;
  std::deque<double> window_;
};

}  // namespace shampoo::examples
