#pragma once
/// Counts ATen operator calls on the calling thread while alive (an at::RecordFunction global
/// callback, scope FUNCTION), and names the top-level operator running on a thread, so that the
/// tracking allocator can tag allocations with it.

#include <ATen/record_function.h>

#include <cstdint>
#include <map>
#include <string>

namespace shampoo::bench {

class OpObserver {
 public:
  /// `by_name`: also count top-level calls per operator name (slower).
  explicit OpObserver(bool by_name = false);
  ~OpObserver();
  OpObserver(const OpObserver&) = delete;
  OpObserver& operator=(const OpObserver&) = delete;

  /// Calls on the constructing thread: top-level (no other operator running on the thread)
  /// and all, nested ones included.
  int64_t top_level() const;
  int64_t all() const;
  std::map<std::string, int64_t> top_level_by_name() const;

  /// Name of the top-level operator running on the calling thread ("" when none, or when no
  /// observer is alive).
  static const std::string& current_op();

 private:
  at::CallbackHandle handle_ = 0;
};

}  // namespace shampoo::bench
