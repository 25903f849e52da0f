#pragma once
/// The elementwise state of the first-order update for the stacks of a virtual group: the filter
/// M (β1), the grafting statistics V and the momentum B, one [n, block_shape] tensor per stack
/// each. V exists from construction when the grafting method keeps statistics; M and B are
/// allocated on a block's first use (a group may turn them on later through its live options).

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

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

  /// Which of the lazily allocated stacks exist (to undo a step that allocated one).
  struct Allocated {
    std::vector<bool> filter;
    std::vector<bool> momentum;
  };
  Allocated allocated() const;
  /// Drops the stacks allocated after `before` was taken.
  void release_since(const Allocated& before);

  /// Copies of the state of one member: "filter", "diagonal" (V), "momentum" where they exist.
  void export_member(int64_t stack, int64_t row, std::map<std::string, at::Tensor>& out) const;
  void import_member(int64_t stack, int64_t row, const std::map<std::string, at::Tensor>& in);
  int64_t state_bytes() const;

 private:
  at::Tensor& lazy(std::vector<at::Tensor>& states, int64_t stack);

  std::vector<StackSpec> stacks_;
  std::vector<at::Tensor> filter_;
  std::vector<at::Tensor> diagonal_;
  std::vector<at::Tensor> momentum_;
};

}  // namespace shampoo::detail
