#pragma once
/// The collective helpers of every mode (Distributor, state, gradient and full sharding), and the
/// library's only calls into c10d's collectives: every other folder starts a collective through
/// the start_* functions below.
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

/// A collective started on one of the ranks: wait() on it, or pass several to wait_collectives.
using CollectiveWork = c10::intrusive_ptr<c10d::Work>;

// The collectives, each started on the backend `group` has for the device type of its tensors
// (Gloo for CPU tensors, NCCL for CUDA ones; process_group.h). Every rank of `group` calls the
// same one with tensors of the same shapes and dtype; reductions are sums.

/// Every rank's `tensors` summed, in place, on every rank.
CollectiveWork start_all_reduce(c10d::ProcessGroup& group, std::vector<at::Tensor>& tensors);
/// Every rank's `tensors` summed into rank `root`'s, in place (the others' keep c10d's leftovers).
CollectiveWork start_reduce(c10d::ProcessGroup& group, std::vector<at::Tensor>& tensors, int root);
/// Rank `root`'s `tensors` copied into every rank's.
CollectiveWork start_broadcast(c10d::ProcessGroup& group, std::vector<at::Tensor>& tensors,
                               int root);
/// `output` (group size × input.numel(), rank-major) receives every rank's `input`.
CollectiveWork start_all_gather(c10d::ProcessGroup& group, at::Tensor& output, at::Tensor& input);
/// `output` receives this rank's piece (rank-major pieces of output.numel()) of the sum of every
/// rank's `input`.
CollectiveWork start_reduce_scatter(c10d::ProcessGroup& group, at::Tensor& output,
                                    at::Tensor& input);
/// Flat pieces between every pair of ranks: input's i-th piece (input_splits[i] elements) goes
/// to rank i, and output's i-th piece (output_splits[i] elements) comes from rank i. The splits
/// are taken by value: Gloo's backend moves from the lists it is given (c10d's dispatcher copies
/// them first; the backend, called directly here, does not).
CollectiveWork start_all_to_all(c10d::ProcessGroup& group, at::Tensor& output, at::Tensor& input,
                                std::vector<int64_t> output_splits,
                                std::vector<int64_t> input_splits);

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

/// An option every rank must set alike because it decides what a rank sends (a dtype, a group
/// size, whether a collective happens), as one integer and how to print it.
struct SharedSetting {
  std::string name;  ///< as the user spells it: "DistributedOptions.merge_param_groups"
  int64_t value = 0;
  std::string (*shown)(int64_t) = nullptr;

  static SharedSetting flag(std::string name, bool value);
  static SharedSetting number(std::string name, int64_t value);
  /// An optional dtype ("unset" when none).
  static SharedSetting dtype(std::string name, std::optional<at::ScalarType> value);
};

/// One small AllGather over `group`: an error on every rank naming each setting that differs and
/// the ranks' values ("<who>every rank must be constructed with the same options: <name> differs
/// between the ranks: rank 1 has false, rank 0 has true; ..."). Call it before any other
/// collective of the construction, whose shapes those settings decide.
void check_settings_agree(c10d::ProcessGroup& group, const std::string& who,
                          const std::vector<SharedSetting>& settings);

/// Waits for collectives (all of them, also after a failure); a failure (a rank that died, a
/// timeout) becomes one error: "<who><what> failed on rank <rank> (...): <c10d's message>".
void wait_collectives(std::vector<c10::intrusive_ptr<c10d::Work>>& works, const std::string& who,
                      const std::string& what, int rank);

/// Copies rank 0's values of `tensors` to every rank of `group`, in place: one broadcast per
/// dtype and device. Errors as wait_collectives's.
void broadcast_from_rank_zero(c10d::ProcessGroup& group, const std::vector<at::Tensor>& tensors,
                              const std::string& who, const std::string& what);

}  // namespace shampoo::detail
