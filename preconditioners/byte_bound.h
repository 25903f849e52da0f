#pragma once
/// A bound in bytes that tests and benchmarks may set (a value ≤ 0 restores the default) and
/// that steps on any thread read: the chunk sizes of the step, of the amortized computation and
/// of the factor updates.

#include <atomic>
#include <cstdint>

namespace shampoo::detail {

class ByteBound {
 public:
  explicit ByteBound(int64_t default_bytes) : default_(default_bytes), bytes_(default_bytes) {}
  int64_t get() const { return bytes_.load(); }
  void set(int64_t bytes) { bytes_.store(bytes > 0 ? bytes : default_); }

 private:
  const int64_t default_;
  std::atomic<int64_t> bytes_;
};

}  // namespace shampoo::detail
