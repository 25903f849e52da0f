#include "benchmarks/tracking_allocator.h"

#include <c10/core/CPUAllocator.h>

#include <algorithm>

#include "benchmarks/op_observer.h"

namespace shampoo::bench {
namespace {

// Above LibTorch's own registration (priority 0), so that SetCPUAllocator replaces it.
constexpr uint8_t kPriority = 100;

TrackingAllocator* g_tracker = nullptr;
c10::Allocator* g_original = nullptr;

}  // namespace

TrackingAllocator& TrackingAllocator::install() {
  if (g_tracker == nullptr) {
    g_original = c10::GetCPUAllocator();
    static TrackingAllocator tracker(g_original);
    g_tracker = &tracker;
  }
  c10::SetCPUAllocator(g_tracker, kPriority);
  return *g_tracker;
}

void TrackingAllocator::uninstall() {
  if (g_original != nullptr) c10::SetCPUAllocator(g_original, kPriority);
}

c10::DataPtr TrackingAllocator::allocate(size_t n) {
  c10::DataPtr inner = inner_->allocate(n);
  void* data = inner.get();
  if (data == nullptr) return inner;  // zero bytes: nothing to count
  const auto device = inner.device();
  const auto bytes = static_cast<int64_t>(n);
  const std::string& op = OpObserver::current_op();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    live_ += bytes;
    ++allocations_;
    allocated_bytes_ += bytes;
    if (bytes >= large_threshold_) {
      auto& entry = large_by_op_[op];
      entry.first += bytes;
      ++entry.second;
    }
    records_.emplace(data, Record{std::move(inner), bytes, op});
    if (live_ > peak_) {
      peak_ = live_;
      if (snapshot_at_peak_) take_snapshot();
    }
  }
  return c10::DataPtr(data, data, &TrackingAllocator::release, device);
}

void TrackingAllocator::release(void* data) {
  c10::DataPtr inner;  // freed by the inner deleter when it goes out of scope, outside the lock
  std::lock_guard<std::mutex> lock(g_tracker->mutex_);
  const auto it = g_tracker->records_.find(data);
  if (it == g_tracker->records_.end()) return;
  g_tracker->live_ -= it->second.bytes;
  inner = std::move(it->second.inner);
  g_tracker->records_.erase(it);
}

c10::DeleterFnPtr TrackingAllocator::raw_deleter() const { return &TrackingAllocator::release; }

void TrackingAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  default_copy_data(dest, src, count);
}

int64_t TrackingAllocator::live() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return live_;
}

int64_t TrackingAllocator::peak() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_;
}

void TrackingAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  peak_ = live_;
}

void TrackingAllocator::reset_counters(int64_t large_threshold) {
  std::lock_guard<std::mutex> lock(mutex_);
  allocations_ = 0;
  allocated_bytes_ = 0;
  large_threshold_ = large_threshold;
  large_by_op_.clear();
}

int64_t TrackingAllocator::allocations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return allocations_;
}

int64_t TrackingAllocator::allocated_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return allocated_bytes_;
}

TrackingAllocator::ByOp TrackingAllocator::large_allocations_by_op() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return large_by_op_;
}

void TrackingAllocator::set_snapshot_at_peak(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  snapshot_at_peak_ = on;
  snapshot_.clear();
}

TrackingAllocator::ByOp TrackingAllocator::snapshot() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return snapshot_;
}

void TrackingAllocator::take_snapshot() {
  snapshot_.clear();
  for (const auto& [data, record] : records_) {
    auto& entry = snapshot_[record.op];
    entry.first += record.bytes;
    ++entry.second;
  }
}

}  // namespace shampoo::bench
