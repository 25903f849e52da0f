#pragma once
/// A parameter of full sharding (FSDP2's sharded parameter): its full shape, its row chunks,
/// what this rank keeps of it, and the rank-major buffers its rows travel in.
/// Internal: not installed.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "parallel/full_sharding/shard_mesh.h"

namespace shampoo::detail {

/// A parameter's full storage is released while its unit is sharded: no bytes and shape [0], so
/// that autograd's saved tensors (which hold the parameter itself) see the values again once the
/// unit is gathered. Neither call bumps the version counter.
/// `dtype`: the parameter's own (the shards'), which it shows while released.
void release_full(const at::Tensor& param, at::ScalarType dtype);
/// Full storage of `sizes` in `dtype` (a mixed-precision policy's compute dtype while gathered).
void allocate_full(const at::Tensor& param, at::IntArrayRef sizes, at::ScalarType dtype);
std::string shape_text(at::IntArrayRef sizes);

/// One parameter of a unit. Its rows are split in chunks of chunk_rows, one per rank of the
/// shard group (the last ones short or empty); a rank-major buffer holds one padded chunk per
/// rank.
struct ParamSlot {
  at::Tensor param;  // the module's tensor: full while the unit is gathered, else shape [0]
  std::vector<int64_t> sizes;
  int64_t rows = 1;        // dim 0 (1 for a 0-dim parameter)
  int64_t row_numel = 1;   // elements per row
  int64_t chunk_rows = 1;  // rows per rank, ceil(rows / world)
  int64_t offset = 0;      // of this parameter's chunk in the unit's shard buffer
  int owner = -1;          // lossless: the rank that steps it
  int replica_owner = -1;  // split across replicas: the replica that steps it (-1: every one)
  int param_group = -1;    // its param group of optimizer() (-1: in none, frozen)
  int64_t joined_at = 0;   // steps taken when it joined its param group
  at::Tensor shard;        // this rank's valid rows, [valid, ...]
  at::Tensor reduced;      // averaged gradient kept for the step (full, or this rank's rows)
  bool arrived = false;    // gradient accumulated in this backward pass
  int64_t hook = -1;

  int64_t numel() const { return rows * row_numel; }
  int64_t chunk_numel() const { return chunk_rows * row_numel; }
  int64_t valid_rows(int rank) const {
    return std::clamp<int64_t>(rows - rank * chunk_rows, 0, chunk_rows);
  }
  /// The first row of `rank`'s chunk, or `rows` for a rank past the last row (a parameter with
  /// fewer rows than ranks: its chunk is empty, and narrow() wants a start within the rows).
  int64_t first_row(int rank) const { return std::min(rows, rank * chunk_rows); }
  std::vector<int64_t> shard_sizes(int rank) const {
    auto out = sizes.empty() ? std::vector<int64_t>{1} : sizes;
    out[0] = valid_rows(rank);
    return out;
  }
  /// Whether it is in one of optimizer()'s groups (else it is frozen: not stepped).
  bool in_a_group() const { return param_group >= 0; }
  /// Whether this rank of `mesh` steps it: its owner in its shard group and, split across
  /// replicas, in its replica.
  bool steps_on(const ShardMesh& mesh) const {
    return owner == mesh.rank && (replica_owner < 0 || replica_owner == mesh.replica);
  }

  /// Writes `full`'s rows (the parameter's full shape) into the rank-major [world, ...] buffer
  /// at `column` (the slot's offset when not given), one chunk per rank, zeros past the last row.
  void write_chunks(const at::Tensor& by_rank, const at::Tensor& full, int64_t column) const;
  void write_chunks(const at::Tensor& by_rank, const at::Tensor& full) const;
  /// The inverse of write_chunks: the rank-major buffer's chunks at `column` into `full`'s rows.
  void read_chunks(const at::Tensor& by_rank, int64_t column, const at::Tensor& full) const;
  /// This rank's shard into `chunk` (chunk_numel elements, any dtype), zeros past its rows.
  void write_shard(const at::Tensor& chunk) const;
  /// Adds an averaged gradient to what is kept for the step.
  void accumulate(at::Tensor averaged);
};

}  // namespace shampoo::detail
