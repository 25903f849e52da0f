#pragma once
/// Stacks and rows: the blocks of a virtual group that share a shape and dtype are kept as one
/// stack (every state tensor [n, block_shape]), and each call works on some of its members (rows).
/// These helpers select, gather and scatter rows and carry per-row values; the matrix
/// preconditioners and the elementwise state both use them.

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace shampoo::detail {

/// Blocks of one shape and dtype, in a fixed member order (rows of every stacked state tensor).
struct StackSpec {
  std::vector<int64_t> block_shape;
  at::TensorOptions options;       ///< dtype and device of the blocks
  std::vector<std::string> names;  ///< per member, for messages ("parameter 3 block 1")
  /// Per block dim: exponent e of the root-inverse preconditioner A^(−e); 0 = the dim is not
  /// preconditioned (no factor is kept for it).
  std::vector<double> dim_exponents;

  int64_t size() const { return static_cast<int64_t>(names.size()); }
};

/// Members of a stack taking part in a call: rows into the stack, ascending.
struct Rows {
  std::vector<int64_t> rows;
  bool all = false;  ///< rows == 0..size-1 (no gather/scatter needed)

  int64_t size() const { return static_cast<int64_t>(rows.size()); }
  /// rows == first, first + 1, ... (a slice of the stack: gathered as a view, no copy).
  bool consecutive() const;
  /// rows as an int64 index tensor on `device`.
  at::Tensor index(const at::Device& device) const;
  static Rows every(int64_t n);
};

/// Per-row scalars of the statistics and preconditioning of one call (aligned with Rows).
struct RowScalars {
  std::vector<double> beta2;             ///< factor EMA coefficient
  std::vector<double> factor_weight;     ///< 1 − β2, or 1 when β2 = 1
  std::vector<double> bias_correction2;  ///< 1 − β2^t, or 1 (no bias correction or β2 = 1)
  std::vector<double> epsilon;
  /// Root-inverse Shampoo: the factor is regularized with epsilon + relative_epsilon·tr(A)
  /// (ShampooOptions::relative_epsilon); empty = 0 for every row.
  std::vector<double> relative_epsilon;
  std::vector<int64_t> step;
};

/// The rows (and their scalars) whose flag is set: the sub-selection of a call.
std::pair<Rows, RowScalars> select_rows(const Rows& rows, const RowScalars& scalars,
                                        const std::vector<bool>& selected);
/// Gathers `rows` of a stacked tensor: the stacked tensor itself when rows.all, a view of it when
/// the rows are consecutive (callers that update the result in place then scatter it back), a
/// copy otherwise.
at::Tensor gather_rows(const at::Tensor& stacked, const Rows& rows);
/// Writes `values` back into `rows` of a stacked tensor (nothing to copy when `values` is the
/// view gather_rows gave).
void scatter_rows(at::Tensor& stacked, const Rows& rows, const at::Tensor& values);
/// A small host-built tensor (indices, per-row scalars) in `dtype` on `device`. On CUDA through
/// pinned memory, asynchronously on the current stream: ATen waits for the stream to drain after
/// a copy from pageable memory, and the GPU then idles while the host prepares the next launches
/// (10 such waits in a plain step of bench_transformer, 2026-11-26). ATen's caching host
/// allocator keeps the pinned buffer until the copy has run.
at::Tensor host_to_device(const at::Tensor& host, const at::Device& device, at::ScalarType dtype);
/// Per-row scalars as a [rows, 1, ..., 1] tensor broadcasting against [rows, ...] of `dims` dims.
at::Tensor row_scalars(const std::vector<double>& values, const at::TensorOptions& options,
                       int64_t dims);
/// The imported tensor under `key`; its absence is an error naming `owner` and `key`.
const at::Tensor& checked_entry(const std::map<std::string, at::Tensor>& in, const std::string& key,
                                const std::string& owner);
/// Checks that an imported tensor exists and has the expected shape; returns it converted.
at::Tensor checked_state(const std::map<std::string, at::Tensor>& in, const std::string& key,
                         at::IntArrayRef shape, const at::TensorOptions& options,
                         const std::string& owner);

}  // namespace shampoo::detail
