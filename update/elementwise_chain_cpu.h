#pragma once
/// The CPU loops of the elementwise chain's passes over a range of one block's elements. They run
/// the formulas of elementwise_chain_kernels.h operation for operation (so the results are the
/// same bits) but in tiles of kChainTile elements, one feature at a time: each feature's loop is
/// branch-free inside the tile, so the compiler vectorizes it, and a tile's intermediates (G', Ḡ,
/// P) stay in the cache. A range may alias as the per-element loops allow (filtered_out on
/// gradient_out, grad on gradient_out, param_out on param, update_out on filtered_out).
///
/// The loops (elementwise_chain_tiles.inc) are compiled once per instruction set, without
/// LibTorch and with their own flags (update/CMakeLists.txt): the baseline of the target, and on
/// x86-64 also AVX2 and AVX-512; the widest one the CPU runs is used. Every variant rounds every
/// operation alone (no contraction into fused multiply-adds; sqrt and division are IEEE's), so
/// all give the same bits, which the tests check.

#include <cstdint>
#include <vector>

#include "update/elementwise_chain_kernels.h"

namespace shampoo::kernels {

inline constexpr int64_t kChainTile = 256;

/// The passes over elements [begin, end) of a block, for one instruction set.
template <typename T>
struct ChainTiles {
  void (*pre)(const ChainBlock<T>&, int64_t, int64_t);
  void (*post)(const ChainBlock<T>&, int64_t, int64_t);
  void (*fused)(const ChainBlock<T>&, int64_t, int64_t);  ///< pre and post, Ḡ not stored
  /// The norm pass: adds Σ P² and Σ P_graft² of the range to the last two arguments.
  void (*norms)(const ChainBlock<T>&, int64_t, int64_t, double&, double&);
};

/// The instruction sets the loops are compiled for.
enum class ChainIsa { kBaseline, kAvx2, kAvx512 };
const char* chain_isa_name(ChainIsa isa);
/// Those this build has and this CPU runs, the baseline first.
std::vector<ChainIsa> chain_isas_available();
/// The one used: the last of chain_isas_available().
ChainIsa chain_isa();

/// The loops of one instruction set (which must be available).
template <typename T>
ChainTiles<T> chain_tiles(ChainIsa isa);
/// The loops used (of chain_isa()).
template <typename T>
const ChainTiles<T>& chain_tiles();

}  // namespace shampoo::kernels
