#pragma once
/// A CPU allocator that wraps LibTorch's and counts tensor memory: live bytes and their peak,
/// allocations since a reset (count, bytes, and per allocating top-level operator when an
/// OpObserver is alive on the thread), and the live allocations at a peak by operator.
///
/// Installed with c10::SetCPUAllocator at a high priority. Each allocation keeps the inner
/// allocator's DataPtr, whose deleter frees it; memory allocated before installation never passes
/// through here and is freed by its own deleter as before. After uninstall(), allocations made
/// meanwhile are still released through here (the tracker lives until exit). It sees tensor
/// storage only, not the private buffers of MKL, oneDNN or Gloo.

#include <c10/core/Allocator.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>

namespace shampoo::bench {

class TrackingAllocator final : public c10::Allocator {
 public:
  /// Bytes and count per allocating top-level operator ("" = none).
  using ByOp = std::map<std::string, std::pair<int64_t, int64_t>>;

  /// The process's tracker, installed as LibTorch's CPU allocator (idempotent).
  static TrackingAllocator& install();
  /// Puts LibTorch's own CPU allocator back.
  static void uninstall();

  c10::DataPtr allocate(size_t n) override;
  c10::DeleterFnPtr raw_deleter() const override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;

  int64_t live() const;
  int64_t peak() const;
  /// Starts a new peak measurement at the current live bytes.
  void reset_peak();

  /// Allocations since reset_counters(): count and bytes, all and those of at least
  /// `large_threshold` bytes, the latter per allocating top-level operator.
  void reset_counters(int64_t large_threshold);
  int64_t allocations() const;
  int64_t allocated_bytes() const;
  ByOp large_allocations_by_op() const;

  /// While on, every new peak replaces a snapshot of the live allocations by allocating
  /// operator (slow; for breakdowns only).
  void set_snapshot_at_peak(bool on);
  ByOp snapshot() const;

 private:
  explicit TrackingAllocator(c10::Allocator* inner) : inner_(inner) {}
  struct Record {
    c10::DataPtr inner;
    int64_t bytes = 0;
    std::string op;
  };
  static void release(void* data);
  void take_snapshot();  // under mutex_

  c10::Allocator* inner_;
  mutable std::mutex mutex_;
  int64_t live_ = 0;
  int64_t peak_ = 0;
  int64_t allocations_ = 0;
  int64_t allocated_bytes_ = 0;
  int64_t large_threshold_ = INT64_MAX;
  ByOp large_by_op_;
  bool snapshot_at_peak_ = false;
  ByOp snapshot_;
  std::unordered_map<void*, Record> records_;
};

}  // namespace shampoo::bench
