#pragma once
/// Blocking of parameters (docs/math.md "Blocking"): squeeze size-1 dims, merge small dims up to
/// max_preconditioner_dim, split every dim into chunks of at most max_preconditioner_dim. The plan
/// of a parameter is computed once; blocks are views of the parameter (and of its gradient).

#include <ATen/ATen.h>

#include <compare>
#include <cstdint>
#include <string>
#include <vector>

namespace shampoo {

/// Stable identity of a block: (parameter index over all groups, block index in the parameter).
struct BlockId {
  int64_t param = 0;
  int64_t block = 0;
  auto operator<=>(const BlockId&) const = default;
  /// "parameter 3 block 1"
  std::string to_string() const;
  /// "p3_b1" (checkpoint keys)
  std::string key() const;
};

}  // namespace shampoo

namespace shampoo::detail {

/// Shape after dropping size-1 dims and, when `merge`, merging dims from the last one backwards
/// while the product stays ≤ max_dim and more than `target_order` dims remain.
/// (1,2,5,1), 10 → (10); (32,3,64,64), 8192 → (96,4096); a zero-size dim → (0); () → (1).
std::vector<int64_t> merge_small_dims(at::IntArrayRef shape, int64_t max_dim, bool merge = true,
                                      int64_t target_order = 1);

/// Chunk sizes of a dim of size `size`: max_dim, ..., max_dim, remainder.
std::vector<int64_t> split_dim(int64_t size, int64_t max_dim);

/// One block: offsets and sizes along every merged dim.
struct BlockSlice {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  int64_t numel = 0;
};

struct BlockPlan {
  std::vector<int64_t> param_shape;
  std::vector<int64_t> merged_shape;
  std::vector<BlockSlice> blocks;  ///< row-major over the chunks of every dim; empty if numel 0

  int64_t numel() const;
};

/// `target_order`: merging stops when this many dims remain (2 for spectral descent, whose
/// blocks must be matrices; 1 otherwise).
BlockPlan make_block_plan(at::IntArrayRef shape, int64_t max_preconditioner_dim,
                          bool use_merge_dims, int64_t target_order = 1);

/// Views of `tensor` (shape = the parameter's) as the blocks of the plan. A tensor that cannot
/// be viewed as merged_shape (non-contiguous gradient) is reshaped (copied) first.
std::vector<at::Tensor> block_views(const at::Tensor& tensor, const BlockPlan& plan);

}  // namespace shampoo::detail
