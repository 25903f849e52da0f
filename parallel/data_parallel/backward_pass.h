#pragma once
/// The backward pass a wrapper takes part in (optimizer-in-backward, full sharding), and its
/// gradient accumulation: the first of its hooks to run in a backward opens the pass, and a
/// callback queued on autograd's engine ends it once the whole backward is done (before
/// backward() returns). A pass still open when a hook of another backward runs was abandoned:
/// that backward failed before its end callback. With accumulation over k passes, the pass that
/// opens as the k-th since the count was last restarted steps (stepping()); the others only
/// accumulate gradients.

#include <cstdint>
#include <functional>

namespace shampoo::detail {

class BackwardPass {
 public:
  /// From a hook during backward: whether a pass is open for another backward than this one.
  bool abandoned() const;
  /// From a hook during backward: opens a pass for this backward unless one is open for it, and
  /// then queues `at_end` to run at its end (it must reach the wrapper through a weak reference
  /// and call end() or close()). Returns whether it opened one; when it did, stepping() is
  /// whether this pass steps: `may_step` and next_steps().
  bool open(const std::function<void()>& at_end, bool may_step = true);
  /// The pass is over and counts (passes(), passes_since_step()).
  void end();
  /// The pass is over and does not count (undone).
  void close() {
    open_ = false;
    stepping_ = false;
  }
  bool is_open() const { return open_; }
  /// Whether the open pass steps (false between passes).
  bool stepping() const { return stepping_; }

  /// Gradient accumulation over k >= 1 passes (the wrapper checks k).
  void set_accumulation_steps(int64_t k) { accumulation_steps_ = k; }
  int64_t accumulation_steps() const { return accumulation_steps_; }
  /// Whether a pass opened now would be the last of an accumulation.
  bool next_steps() const { return (since_step_ + 1) % accumulation_steps_ == 0; }
  /// The step of an accumulation was taken: the count starts again (full sharding, whose step
  /// may come after backward). A wrapper that never calls it steps on every k-th pass.
  void stepped() { since_step_ = 0; }
  /// Passes that ended, and those since stepped() (all of them when it is never called).
  int64_t passes() const { return passes_; }
  int64_t passes_since_step() const { return since_step_; }
  /// A checkpoint's counts.
  void restore(int64_t passes, int64_t since_step) {
    passes_ = passes;
    since_step_ = since_step;
  }

 private:
  bool open_ = false;
  bool stepping_ = false;
  int task_ = -1;  // autograd graph task of the open pass
  int64_t accumulation_steps_ = 1;
  int64_t passes_ = 0;
  int64_t since_step_ = 0;
};

}  // namespace shampoo::detail
