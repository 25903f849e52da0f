#pragma once
/// The elementwise state of the first-order update for the stacks of a virtual group: the filter
/// M (β1), the grafting statistics V, the momentum B and the averaging sequence Z (iterate
/// averaging), one [n, block_shape] tensor per stack each. V exists from construction when the
/// grafting method keeps statistics; M, B and Z are allocated on a block's first use (a group may
/// turn M and B on later through its live options). A row of Z is set to its block of the
/// parameter at that block's first step (so weights loaded after construction count); until then
/// the row does not exist (Z = W).

#include <ATen/ATen.h>

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
  ElementwiseState(GraftingKind grafting, const std::vector<StackSpec>& stacks);

  /// Sets the state pointers of block `row` of stack `stack` in `c`: M when `filter`, V when the
  /// grafting method keeps statistics, B when `momentum` (allocating M and B on first use).
  void bind(int64_t stack, int64_t row, bool filter, bool momentum, ChainBlockTensors& c);
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

  /// Copies of the state of one member: "filter", "diagonal" (V), "momentum", "average" (Z)
  /// where they exist.
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
};

}  // namespace shampoo::detail
