#pragma once
/// Which rank owns each item, and the owner-major layout of the AllGather that brings the owners'
/// results to every rank: the one ownership plan of every mode. Items are Shampoo's blocks (the
/// Distributor), whole parameters (state sharding, ZeRO-1; gradient sharding, ZeRO-2; full
/// sharding's lossless steps) or a parameter's blocks kept together (shard_by_parameter).
///
/// Owners (docs/math.md "Distribution"): greedy longest-processing-time. Items sorted by cost
/// descending (stable), each given to the least-loaded rank (ties: lowest rank). Deterministic:
/// every rank computes the same owners from the same inputs. Items added later continue the
/// loads, so existing owners never move.

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace shampoo::detail {

/// Cost of an item: its bytes in the communication dtype, rounded up to 64 bytes.
int64_t block_cost(int64_t numel, int64_t element_size);

/// Owners of items with the given costs over `world_size` ranks. `loads` (size world_size) holds
/// the ranks' loads before the call and is updated.
std::vector<int> assign_owners(const std::vector<int64_t>& costs, int world_size,
                               std::vector<int64_t>& loads);

/// The owners of a growing list of items over one group of ranks.
class OwnershipPlan {
 public:
  explicit OwnershipPlan(int world_size = 1);

  /// Appends items with the given costs; returns the index of the first.
  int64_t add(const std::vector<int64_t>& costs);
  /// Appends items that are owned in sets: together[i] names item i's set (any number, equal
  /// for items owned together; a set's items are all new in this call). A set costs the sum of
  /// its items' costs and is placed in the order of its first item.
  int64_t add_together(const std::vector<int64_t>& costs, const std::vector<int64_t>& together);

  int world_size() const { return world_size_; }
  int64_t size() const { return static_cast<int64_t>(owners_.size()); }
  int owner_of(int64_t item) const { return owners_.at(static_cast<size_t>(item)); }
  const std::vector<int>& owners() const { return owners_; }
  /// Per rank: the summed cost of the items it owns.
  const std::vector<int64_t>& loads() const { return loads_; }

 private:
  int world_size_;
  std::vector<int> owners_;
  std::vector<int64_t> loads_;
};

/// One AllGather's buffer, owner-major: segment r (every segment padded to the largest) holds
/// rank r's header words, then the values of the items r owns, in item order. With flags, the
/// header is a status word followed by one flag per item r owns (in item order).
class OwnerMajorLayout {
 public:
  OwnerMajorLayout() = default;
  /// numels[i] and owners[i] describe item i (owners in [0, world_size)).
  OwnerMajorLayout(int world_size, const std::vector<int64_t>& numels,
                   const std::vector<int>& owners, bool with_flags);

  int world_size() const { return world_size_; }
  /// Elements per rank.
  int64_t segment_size() const { return segment_size_; }
  /// The largest header (status word and flags) of any rank: the columns that hold flags.
  int64_t header_size() const { return header_size_; }
  int owner(int64_t item) const { return owners_[item]; }
  /// Element offset of item's values inside its owner's segment.
  int64_t offset(int64_t item) const { return offsets_[item]; }
  /// Element offset of item's flag inside its owner's segment (layouts with flags).
  int64_t flag(int64_t item) const { return flags_[item]; }

  /// Buffers for the layout: send [segment_size], receive [world_size * segment_size].
  at::Tensor make_send(const at::TensorOptions& options) const;
  at::Tensor make_receive(const at::TensorOptions& options) const;
  /// Item's values in this rank's send buffer (this rank owns it) and in the receive buffer.
  at::Tensor in_send(const at::Tensor& send, int64_t item) const;
  at::Tensor in_receive(const at::Tensor& receive, int64_t item) const;

 private:
  int world_size_ = 1;
  int64_t segment_size_ = 0;
  int64_t header_size_ = 0;
  std::vector<int> owners_;
  std::vector<int64_t> numels_;
  std::vector<int64_t> offsets_;
  std::vector<int64_t> flags_;
};

}  // namespace shampoo::detail
