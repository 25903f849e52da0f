#pragma once
/// The collective helpers of every mode (Distributor, state, gradient and full sharding).
///
/// Agreement across ranks: every rank describes what must be equal everywhere (shapes, owners,
/// options) as a list of integers, hashes it with the one fingerprint below, and AllGathers the
/// result with a few counts that make the error readable. A mismatch is then an error on every
/// rank, never a hang in a later collective. Used by DistributedShampoo's registration, the
/// gradient synchronizer, the sharded optimizer and full sharding.

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

namespace shampoo::detail {

/// The library's agreement hash: SHA-1 (c10::sha1) over the values' bytes, its first 63 bits
/// (non-negative). Values of different lengths hash apart (the count is hashed first).
int64_t fingerprint(const std::vector<int64_t>& values);

/// Collects the values of a fingerprint.
class Fingerprint {
 public:
  Fingerprint& add(int64_t value) {
    values_.push_back(value);
    return *this;
  }
  /// A list of values and its end, so that lists of different lengths stay apart.
  Fingerprint& add_list(at::IntArrayRef values);
  int64_t value() const { return fingerprint(values_); }

 private:
  std::vector<int64_t> values_;
};

/// One small AllGather over `group`'s CPU backend: result[r] = rank r's values (every rank
/// passes the same count).
std::vector<std::vector<int64_t>> gather_int64(c10d::ProcessGroup& group,
                                               const std::vector<int64_t>& values);

/// The first rank whose gathered values differ from rank 0's, or none.
std::optional<int> first_differing_rank(const std::vector<std::vector<int64_t>>& all);

/// Waits for collectives (all of them, also after a failure); a failure (a rank that died, a
/// timeout) becomes one error: "<who><what> failed on rank <rank> (...): <c10d's message>".
void wait_collectives(std::vector<c10::intrusive_ptr<c10d::Work>>& works, const std::string& who,
                      const std::string& what, int rank);

/// Copies rank 0's values of `tensors` to every rank of `group`, in place: one broadcast per
/// dtype and device. Errors as wait_collectives's.
void broadcast_from_rank_zero(c10d::ProcessGroup& group, const std::vector<at::Tensor>& tensors,
                              const std::string& who, const std::string& what);

}  // namespace shampoo::detail
