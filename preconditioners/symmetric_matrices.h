#pragma once
/// Stacks of symmetric matrices (the Kronecker factors and the inverse roots), stored dense or as
/// packed lower triangles. Packed, a d×d matrix keeps its d(d+1)/2 entries (i ≥ j) row by row:
/// (0,0), (1,0), (1,1), (2,0), …, (d−1,d−1), about half the bytes. Both layouts hold the same
/// numbers: a matrix written into the stack is its lower triangle, mirrored in the dense layout,
/// so a computation reads the same values whichever layout keeps them (packed ≡ dense bit for
/// bit). The lower triangle is the one LAPACK's eigh reads (torch.linalg.eigh, UPLO 'L'): a
/// product G·Gᵀ whose two triangles round differently decomposes as before packing. Pack and
/// unpack are copies, no arithmetic.
///
/// A stack may also be kept compact (CompactState, for the inverse roots): the stored entries in
/// bfloat16, or in int8 with one power-of-two scale per group of kCompactGroup entries and the
/// diagonal apart in the compute dtype. Power-of-two scales make encoding a decoded matrix
/// give back the same bytes, so a checkpoint (which holds decoded values) resumes bit for bit.

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

#include "preconditioners/preconditioner_configs.h"
#include "preconditioners/rows.h"

namespace shampoo::detail {

/// d(d+1)/2: the entries of a packed d×d symmetric matrix.
constexpr int64_t packed_size(int64_t d) { return d * (d + 1) / 2; }

/// The lower triangles of `dense` [..., d, d] packed: [..., d(d+1)/2] (a new tensor).
at::Tensor pack_lower(const at::Tensor& dense);
/// The symmetric matrices [..., d, d] whose lower triangles `packed` [..., d(d+1)/2] holds.
at::Tensor unpack_symmetric(const at::Tensor& packed, int64_t d);
/// unpack_symmetric into `out` [..., d, d] (as many matrices as `packed` holds): no allocation on
/// the CPU where `out` is contiguous and of packed's dtype (a scratch matrix reused block after
/// block), else through a copy.
void unpack_symmetric_into(at::Tensor& out, const at::Tensor& packed);
/// The packed factor update in one pass over memory: for `stored` [n, d(d+1)/2] (packed rows,
/// contiguous, float or double), `outer` [n, d, d], and `beta2` and `weight` of n entries each
/// (contiguous, one per row), stored ← beta2·stored + pack(weight·outer), each product and the sum
/// rounded once: the bits of that ATen sequence, on the CPU and on CUDA (a kernel of its own).
/// Returns false, and changes nothing, where it does not apply (other dtypes or shapes, mixed
/// devices, CUDA tensors in a build without CUDA); the caller then runs the ATen sequence.
bool decay_add_packed_(at::Tensor& stored, const at::Tensor& outer, const at::Tensor& beta2,
                       const at::Tensor& weight);
/// Copies the lower triangle of each matrix of `dense` [..., d, d] onto its upper triangle.
void mirror_lower_(at::Tensor& dense);
/// (X + Xᵀ) * 0.5 of each matrix of `dense` [..., d, d], with ATen's bits: in place and returned
/// on the CPU for contiguous float and double stacks (one tiled pass), else a new tensor.
at::Tensor symmetric_part(at::Tensor dense);

/// Stored entries per int8 scale of a CompactState::kInt8 stack.
inline constexpr int64_t kCompactGroup = 64;

class SymmetricMatrices {
 public:
  SymmetricMatrices() = default;
  /// n matrices of size d×d, zeros or (identity) the identity; `options` is the compute dtype
  /// (what dense() returns), `compact` how they are kept.
  SymmetricMatrices(int64_t n, int64_t d, const at::TensorOptions& options, bool packed,
                    bool identity, CompactState compact = CompactState::kNone);

  bool defined() const { return storage_.defined(); }
  bool packed() const { return packed_; }
  CompactState compact() const { return compact_; }
  int64_t dim() const { return d_; }
  /// The stored entries: [n, d(d+1)/2] packed, [n, d, d] dense. Elementwise updates may act on
  /// them directly (they touch the same numbers in either layout). Not for compact stacks.
  const at::Tensor& stored() const;
  at::Tensor& stored();
  /// Dims of a row-scalar tensor broadcasting against stored rows: 2 packed, 3 dense.
  int64_t stored_dims() const { return packed_ ? 2 : 3; }
  /// The entries `dense` [rows, d, d] would be stored as: packed lower triangles (a new tensor),
  /// or `dense` itself with its lower triangle mirrored (in place).
  at::Tensor to_stored(at::Tensor dense) const;

  /// The matrices of `rows` as [rows, d, d]: unpacked into a new tensor, or in the dense layout
  /// gather_rows of the storage (the storage itself, a view or a copy). Read-only.
  at::Tensor dense(const Rows& rows) const;
  /// Matrix `row` as [d, d] (read-only, as dense()).
  at::Tensor dense_row(int64_t row) const;
  /// Matrix `row` as dense_row(row), unpacked into `scratch` where the stack is packed and not
  /// compact (then `scratch` is returned; it is allocated [d, d] here when undefined), so a loop
  /// over rows reuses one matrix. Dense and compact stacks ignore `scratch`.
  at::Tensor dense_row(int64_t row, at::Tensor& scratch) const;
  /// Writes the lower triangle of `value` [d, d] into matrix `row` (mirrored when dense).
  void assign_row(int64_t row, const at::Tensor& value);

  /// Per matrix, max |entry| as [n] float64 on the storage's device.
  at::Tensor max_abs() const;

  /// A copy of matrix `row` as stored ([d(d+1)/2] or [d, d]), for checkpoints.
  at::Tensor export_row(int64_t row) const;
  /// Reads matrix `row` from a checkpoint entry in either layout ([d, d]: its lower triangle;
  /// [d(d+1)/2]: packed); another shape is an error naming `key`, `owner` and both shapes.
  void import_row(int64_t row, const at::Tensor& value, const std::string& key,
                  const std::string& owner);

  int64_t bytes() const;

 private:
  /// Entries of one stored matrix: d(d+1)/2 packed, d² dense.
  int64_t entries() const { return packed_ ? packed_size(d_) : d_ * d_; }
  /// The stored entries of `index` rows ([r], long) decoded: [r, entries()] in the compute dtype.
  at::Tensor decode(const at::Tensor& index) const;
  /// Encodes `values` [r, entries()] (stored layout, compute dtype) into the rows `index`.
  void encode(const at::Tensor& index, const at::Tensor& values);
  /// Per stored entry of the diagonal, its position in a stored row ([d], long).
  at::Tensor diagonal_positions() const;

  at::Tensor storage_;   ///< compute dtype, bfloat16, or int8 [n, groups · kCompactGroup]
  at::Tensor scales_;    ///< kInt8: [n, groups] float32 powers of two
  at::Tensor diagonal_;  ///< kInt8: [n, d] in the compute dtype
  at::ScalarType dtype_ = at::kFloat;
  int64_t d_ = 0;
  bool packed_ = false;
  CompactState compact_ = CompactState::kNone;
};

}  // namespace shampoo::detail
