#include "preconditioners/symmetric_matrices.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

namespace shampoo::detail {

SymmetricMatrices::SymmetricMatrices(int64_t n, int64_t d, const at::TensorOptions& options,
                                     bool packed, bool identity, CompactState compact)
    : dtype_(c10::typeMetaToScalarType(options.dtype())),
      d_(d),
      packed_(packed),
      compact_(compact) {
  const std::vector<int64_t> shape =
      packed ? std::vector<int64_t>{n, packed_size(d)} : std::vector<int64_t>{n, d, d};
  if (compact_ == CompactState::kNone || compact_ == CompactState::kBfloat16) {
    const auto stored_options =
        compact_ == CompactState::kNone ? options : options.dtype(at::kBFloat16);
    if (!identity) {
      storage_ = at::zeros(shape, stored_options);
      return;
    }
    const auto eye = at::eye(d, options);
    storage_ = (packed ? pack_lower(eye) : eye).expand(shape).to(stored_options).contiguous();
    return;
  }
  const int64_t groups = (entries() + kCompactGroup - 1) / kCompactGroup;
  storage_ = at::zeros({n, groups * kCompactGroup}, options.dtype(at::kChar));
  scales_ = at::ones({n, groups}, options.dtype(at::kFloat));
  diagonal_ = identity ? at::ones({n, d}, options) : at::zeros({n, d}, options);
}

const at::Tensor& SymmetricMatrices::stored() const {
  TORCH_INTERNAL_ASSERT(compact_ == CompactState::kNone, "stored(): a compact stack");
  return storage_;
}

at::Tensor& SymmetricMatrices::stored() {
  TORCH_INTERNAL_ASSERT(compact_ == CompactState::kNone, "stored(): a compact stack");
  return storage_;
}

at::Tensor SymmetricMatrices::diagonal_positions() const {
  const auto i = at::arange(d_, at::TensorOptions().dtype(at::kLong).device(storage_.device()));
  // Packed: row i starts at i(i+1)/2 and its diagonal entry is its last; dense: i·d + i.
  return packed_ ? at::div(i * (i + 3), 2, "floor") : i * (d_ + 1);
}

at::Tensor SymmetricMatrices::decode(const at::Tensor& index) const {
  const int64_t r = index.size(0);
  const auto rows = storage_.index_select(0, index).reshape({r, -1});
  if (compact_ != CompactState::kInt8) return rows.to(dtype_);
  const int64_t groups = scales_.size(1);
  auto values = (rows.to(dtype_).view({r, groups, kCompactGroup}) *
                 scales_.index_select(0, index).to(dtype_).unsqueeze(-1))
                    .view({r, groups * kCompactGroup})
                    .narrow(1, 0, entries())
                    .contiguous();
  values.index_copy_(1, diagonal_positions(), diagonal_.index_select(0, index));
  if (!packed_) {
    // Dense 8-bit stacks keep the lower triangle (the upper one encodes as zeros).
    auto matrices = values.view({r, d_, d_});
    mirror_lower_(matrices);
  }
  return values;
}

void SymmetricMatrices::encode(const at::Tensor& index, const at::Tensor& values) {
  const int64_t r = index.size(0);
  if (compact_ != CompactState::kInt8) {
    auto shape = storage_.sizes().vec();
    shape[0] = r;
    storage_.index_copy_(0, index, values.reshape(shape).to(storage_.scalar_type()));
    return;
  }
  const auto positions = diagonal_positions();
  diagonal_.index_copy_(0, index, values.index_select(1, positions).to(dtype_));
  // The off-diagonal entries, float32, padded to whole groups.
  const int64_t groups = scales_.size(1);
  auto lower = values.to(at::kFloat);
  if (!packed_) lower = lower.view({r, d_, d_}).tril(-1).reshape({r, entries()});
  auto x = at::constant_pad_nd(lower, {0, groups * kCompactGroup - entries()})
               .index_fill_(1, positions, 0.0)
               .view({r, groups, kCompactGroup});
  const auto absmax = x.abs().amax(-1);
  // The smallest power of two s with 127·s ≥ max |x| (frexp: m ∈ [0.5, 1), exact powers of two
  // have m = 0.5); 1 for a group of zeros.
  auto [mantissa, exponent] = at::frexp(absmax / 127.0);
  exponent = exponent - mantissa.eq(0.5).to(exponent.scalar_type());
  const auto scales =
      at::where(absmax.gt(0), at::ldexp(at::ones_like(absmax), exponent), at::ones_like(absmax));
  const auto q = at::round(x / scales.unsqueeze(-1)).clamp_(-127, 127).to(at::kChar);
  storage_.index_copy_(0, index, q.view({r, groups * kCompactGroup}));
  scales_.index_copy_(0, index, scales);
}

at::Tensor SymmetricMatrices::to_stored(at::Tensor dense) const {
  if (packed_) return pack_lower(dense);
  mirror_lower_(dense);
  return dense;
}

at::Tensor SymmetricMatrices::dense(const Rows& rows) const {
  if (compact_ != CompactState::kNone) {
    const auto values = decode(rows.index(storage_.device()));
    return packed_ ? unpack_symmetric(values, d_) : values.view({rows.size(), d_, d_});
  }
  const auto stored_rows = gather_rows(storage_, rows);
  return packed_ ? unpack_symmetric(stored_rows, d_) : stored_rows;
}

at::Tensor SymmetricMatrices::dense_row(int64_t row) const {
  if (compact_ != CompactState::kNone) {
    Rows one;
    one.rows = {row};
    return dense(one)[0];
  }
  return packed_ ? unpack_symmetric(storage_[row], d_) : storage_[row];
}

at::Tensor SymmetricMatrices::dense_row(int64_t row, at::Tensor& scratch) const {
  if (compact_ != CompactState::kNone || !packed_) return dense_row(row);
  if (!scratch.defined()) scratch = at::empty({d_, d_}, storage_.options());
  TORCH_INTERNAL_ASSERT(scratch.sizes() == (at::IntArrayRef{d_, d_}));
  unpack_symmetric_into(scratch, storage_[row]);
  return scratch;
}

void SymmetricMatrices::assign_row(int64_t row, const at::Tensor& value) {
  TORCH_INTERNAL_ASSERT(value.dim() == 2 && value.size(0) == d_ && value.size(1) == d_);
  if (compact_ != CompactState::kNone) {
    const auto stored = to_stored(value.to(dtype_).clone()).reshape({1, entries()});
    encode(at::full({1}, row, at::TensorOptions().dtype(at::kLong).device(storage_.device())),
           stored);
    return;
  }
  if (packed_) {
    storage_[row].copy_(pack_lower(value));
    return;
  }
  auto target = storage_[row];
  target.copy_(value);
  mirror_lower_(target);
}

at::Tensor SymmetricMatrices::max_abs() const {
  const int64_t n = storage_.size(0);
  if (n == 0) return at::zeros({0}, storage_.options().dtype(at::kDouble));
  if (compact_ != CompactState::kNone) {
    return at::linalg_vector_norm(decode(Rows::every(n).index(storage_.device())), INFINITY,
                                  std::vector<int64_t>{1}, false, at::kDouble);
  }
  const std::vector<int64_t> dims = packed_ ? std::vector<int64_t>{1} : std::vector<int64_t>{1, 2};
  return at::linalg_vector_norm(storage_, INFINITY, dims, false, at::kDouble);
}

at::Tensor SymmetricMatrices::export_row(int64_t row) const {
  if (compact_ == CompactState::kNone) return storage_[row].clone();
  const auto values =
      decode(at::full({1}, row, at::TensorOptions().dtype(at::kLong).device(storage_.device())));
  return packed_ ? values[0] : values[0].view({d_, d_});
}

void SymmetricMatrices::import_row(int64_t row, const at::Tensor& value, const std::string& key,
                                   const std::string& owner) {
  const bool as_packed = value.dim() == 1 && value.size(0) == packed_size(d_);
  const bool as_dense = value.dim() == 2 && value.size(0) == d_ && value.size(1) == d_;
  TORCH_CHECK(as_packed || as_dense, "checkpoint: ", owner, " entry '", key, "' has shape ",
              value.sizes(), ", expected [", d_, ", ", d_, "] (a dense symmetric matrix) or [",
              packed_size(d_), "] (its packed lower triangle)");
  const auto converted = value.to(storage_.options().dtype(dtype_));
  if (as_dense) {
    assign_row(row, converted);
  } else if (compact_ != CompactState::kNone) {
    assign_row(row, unpack_symmetric(converted, d_));
  } else if (packed_) {
    storage_[row].copy_(converted);
  } else {
    storage_[row].copy_(unpack_symmetric(converted, d_));
  }
}

int64_t SymmetricMatrices::bytes() const {
  int64_t total = 0;
  for (const auto* t : {&storage_, &scales_, &diagonal_}) {
    if (t->defined()) total += t->numel() * static_cast<int64_t>(t->element_size());
  }
  return total;
}

}  // namespace shampoo::detail
