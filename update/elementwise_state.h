#pragma once
/// The elementwise state of the first-order update for the stacks of a virtual group: the filter
/// M (β1), the grafting statistics V, the momentum B and the averaging sequence Z (iterate
/// averaging), one [n, block_shape] tensor per stack each. V exists from construction when the
/// grafting method keeps statistics; M, B and Z are allocated on a block's first use (a group may
/// turn M and B on later through its live options). A row of Z is set to its block of the
/// parameter at that block's first step (so weights loaded after construction count); until then
/// the row does not exist (Z = W).
///
/// Compact (ShampooOptions::compact_state), M, V and B are kept in bfloat16. A step binds float
/// copies of a block's rows (scratch the size of the step's chunk), the chain updates those, and
/// commit() rounds them back stochastically: up with probability equal to the fraction cut off,
/// so the rounding is unbiased and an exponential average does not drift as it would rounded to
/// nearest. The random bits are a hash of (block, step, state, element): the same at any world
/// size, chunking or merging of groups.
///
/// Factored (ShampooOptions::factored_grafting), the V of a stack of 2-D blocks that keep a
/// Kronecker factor is kept as its row sums r [n, m] and column sums c [n, k] (Adafactor's
/// factorization, Shazeer & Stern 2018): m + k numbers per block instead of m·k. A step binds
/// V̂ = r·cᵀ / Σr (a float scratch the size of the block), the chain updates it as it would V
/// (V̂ ← β2·V̂ + w·G′², so the newest G′² enters exactly) and reads it for the grafting norm, and
/// commit() keeps its row and column sums: since those are linear, r ← β2·r + w·rowsum(G′²) and
/// c likewise, Adafactor's update. Such blocks only take the grafting method's norm (their
/// direction is the Kronecker preconditioner's), so the grafting state shrinks from the size of
/// the parameters to a few percent of it. Blocks without factors (1-D, or every dim above
/// max_factored_dim) take the grafting update itself and keep V exact.

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "preconditioners/memory_summary.h"
#include "preconditioners/rows.h"
#include "update/elementwise_chain.h"
#include "update/grafting.h"

namespace shampoo::detail {

class ElementwiseState {
 public:
  /// `compact`: M, V and B in bfloat16; `factored`: V factored where a stack's blocks are 2-D
  /// and keep a Kronecker factor (see above; not compacted).
  ElementwiseState(GraftingKind grafting, const std::vector<StackSpec>& stacks,
                   bool compact = false, bool factored = false);
  /// Whether V of stack `stack` is kept factored.
  bool factored(int64_t stack) const { return rows_[stack].defined(); }

  /// Sets the state pointers of block `row` of stack `stack` in `c`: M when `filter`, V when the
  /// grafting method keeps statistics, B when `momentum` (allocating M and B on first use).
  /// Compact, they point at float copies that commit() writes back; `block` (the registry's
  /// block index) and `step` (the step being computed) seed its rounding.
  void bind(int64_t stack, int64_t row, bool filter, bool momentum, ChainBlockTensors& c,
            int64_t block = 0, int64_t step = 0);
  /// Factored V: forms V̂ of the members `rows` (ascending) of stack `stack` in one batched
  /// operation, which bind() then hands out row by row, and which commit() sums back in one
  /// operation per stack (rather than a few launches per block). A member bound without it is
  /// prepared alone.
  void prepare_factored(int64_t stack, const Rows& rows);
  /// Compact: rounds the float copies bound since the last commit into the kept state; factored:
  /// keeps the row and column sums of the V̂ bound. Until then the kept state is unchanged.
  void commit();
  /// Drops the float copies bound and not committed (a step that failed before commit).
  void discard();
  /// Sets Z of block `row` of stack `stack` in `c`, first setting it to `param_block` (the
  /// block's current values) at the block's first step.
  void bind_average(int64_t stack, int64_t row, const at::Tensor& param_block,
                    ChainBlockTensors& c);
  /// Z of one block ([block_shape], a view), undefined before the block's first step.
  at::Tensor average(int64_t stack, int64_t row) const;

  /// Which of the lazily allocated stacks exist (to undo a step that allocated one).
  struct Allocated {
    std::vector<bool> filter;
    std::vector<bool> momentum;
    std::vector<std::vector<bool>> average;  // per stack, per row: Z set
  };
  Allocated allocated() const;
  /// Drops the stacks allocated (and forgets the rows of Z set) after `before` was taken.
  void release_since(const Allocated& before);

  /// Copies of the state of one member: "filter", "diagonal" (V; factored, "diagonal_rows" and
  /// "diagonal_cols" instead), "momentum", "average" (Z) where they exist. Import takes either
  /// form of V and converts (V ← r·cᵀ / Σr, or r and c ← V's row and column sums).
  void export_member(int64_t stack, int64_t row, std::map<std::string, at::Tensor>& out) const;
  void import_member(int64_t stack, int64_t row, const std::map<std::string, at::Tensor>& in);
  int64_t state_bytes() const;
  /// Adds the bytes held to `out`: V as grafting, M, B and Z.
  void add_memory(MemorySummary& out) const;

 private:
  at::Tensor& lazy(std::vector<at::Tensor>& states, int64_t stack);

  std::vector<StackSpec> stacks_;
  std::vector<at::Tensor> filter_;
  std::vector<at::Tensor> diagonal_;
  std::vector<at::Tensor> momentum_;
  std::vector<at::Tensor> average_;
  std::vector<std::vector<bool>> average_set_;  // per stack, per row
  bool compact_ = false;
  struct Pending {
    at::Tensor kept;     // the bfloat16 row
    at::Tensor scratch;  // its float copy, updated by the chain
    uint32_t key;
  };
  std::vector<Pending> pending_;
  std::vector<at::Tensor> rows_, cols_;  // factored V per stack: [n, m] and [n, k], else undefined
  /// prepare_factored's V̂ of members of one stack: [k, m, n] for `rows`, updated by the chain.
  struct PreparedFactored {
    Rows rows;
    at::Tensor scratch;
    bool bound = false;  // bind() handed out a row of it
  };
  std::map<int64_t, PreparedFactored> prepared_factored_;  // by stack
};

/// Whether factored_grafting keeps V of a block of this shape and these exponents factored: a 2-D
/// block with at least one Kronecker factor.
bool factors_second_moment(const std::vector<int64_t>& block_shape,
                           const std::vector<double>& dim_exponents);
/// V̂ = r·cᵀ / Σr of one block from its row sums r [m] and column sums c [k]; zeros while r is.
at::Tensor unfactor_second_moment(const at::Tensor& rows, const at::Tensor& cols);

/// `x` rounded to bfloat16 stochastically: each element up (in magnitude) with probability equal
/// to the fraction its truncation cuts off, the random bits a hash of `key` and the element's
/// index. Deterministic; CPU and CUDA give the same bits.
at::Tensor round_bfloat16_stochastic(const at::Tensor& x, uint32_t key);
/// The same into `out` (bfloat16, x's number of elements): one pass on the CPU.
void round_bfloat16_stochastic_into(at::Tensor& out, const at::Tensor& x, uint32_t key);
/// The same in ATen tensor operations (what CUDA tensors use; tests compare the CPU pass to it).
at::Tensor round_bfloat16_stochastic_aten(const at::Tensor& x, uint32_t key);

}  // namespace shampoo::detail
