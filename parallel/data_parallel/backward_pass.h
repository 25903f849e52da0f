#pragma once
/// The backward pass a wrapper takes part in (optimizer-in-backward, full sharding): the first
/// of its hooks to run in a backward opens the pass, and a callback queued on autograd's engine
/// closes it once the whole backward is done (before backward() returns). A pass still open when
/// a hook of another backward runs was abandoned: that backward failed before its end callback.

#include <functional>

namespace shampoo::detail {

class BackwardPass {
 public:
  /// From a hook during backward: whether a pass is open for another backward than this one.
  bool abandoned() const;
  /// From a hook during backward: opens a pass for this backward unless one is open for it, and
  /// then queues `at_end` to run at its end (it must reach the wrapper through a weak reference
  /// and call close()). Returns whether it opened one.
  bool open(const std::function<void()>& at_end);
  /// The pass is over (at its end, or undone).
  void close() { open_ = false; }
  bool is_open() const { return open_; }

 private:
  bool open_ = false;
  int task_ = -1;  // autograd graph task of the open pass
};

}  // namespace shampoo::detail
