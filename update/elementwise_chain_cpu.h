#pragma once
/// The CPU loops of the elementwise chain's passes over a range of one block's elements. They run
/// the formulas of elementwise_chain_kernels.h operation for operation (so the results are the
/// same bits) but in tiles of kChainTile elements, one feature at a time: each feature's loop is
/// branch-free inside the tile, so the compiler vectorizes it, and a tile's intermediates (G', Ḡ,
/// P) stay in the cache. A range may alias as the per-element loops allow (filtered_out on
/// gradient_out, grad on gradient_out, param_out on param, update_out on filtered_out).
/// No LibTorch here: compiled in its own translation unit with its own flags (update/CMakeLists).

#include <cstdint>

#include "update/elementwise_chain_kernels.h"

namespace shampoo::kernels {

inline constexpr int64_t kChainTile = 256;

/// The pre pass over elements [begin, end) of a block.
template <typename T>
void chain_pre_tiles(const ChainBlock<T>& b, int64_t begin, int64_t end);
/// The post pass over elements [begin, end) of a block.
template <typename T>
void chain_post_tiles(const ChainBlock<T>& b, int64_t begin, int64_t end);
/// The fused pass (pre and post, Ḡ not stored) over elements [begin, end) of a block.
template <typename T>
void chain_fused_tiles(const ChainBlock<T>& b, int64_t begin, int64_t end);

extern template void chain_pre_tiles<float>(const ChainBlock<float>&, int64_t, int64_t);
extern template void chain_pre_tiles<double>(const ChainBlock<double>&, int64_t, int64_t);
extern template void chain_post_tiles<float>(const ChainBlock<float>&, int64_t, int64_t);
extern template void chain_post_tiles<double>(const ChainBlock<double>&, int64_t, int64_t);
extern template void chain_fused_tiles<float>(const ChainBlock<float>&, int64_t, int64_t);
extern template void chain_fused_tiles<double>(const ChainBlock<double>&, int64_t, int64_t);

}  // namespace shampoo::kernels
