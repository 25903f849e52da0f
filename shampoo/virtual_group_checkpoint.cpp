// VirtualGroup's state in and out of checkpoints: a block's state as one record (export_member),
// every owned block's (export_states) and back (import_states). The group's step and its undo
// journal are in virtual_group.cpp.
#include <c10/util/Exception.h>

#include <map>

#include "shampoo/virtual_group.h"

namespace shampoo::detail {

BlockState VirtualGroup::export_member(int64_t s, int64_t r) const {
  auto state = preconditioner_->export_member(s, r);
  elementwise_->export_member(s, r, state);
  return state;
}

void VirtualGroup::export_states(std::map<BlockId, BlockState>& out) const {
  for (size_t s = 0; s < stacks_.size(); ++s) {
    for (int64_t r = 0; r < stacks_[s].spec.size(); ++r) {
      out[stacks_[s].ids[r]] = export_member(static_cast<int64_t>(s), r);
    }
  }
}

void VirtualGroup::import_states(const std::map<BlockId, BlockState>& states, bool require_all) {
  for (size_t s = 0; s < stacks_.size(); ++s) {
    const auto& stack = stacks_[s];
    for (int64_t r = 0; r < stack.spec.size(); ++r) {
      const auto it = states.find(stack.ids[r]);
      if (it == states.end()) {
        TORCH_CHECK(!require_all, "checkpoint: no state for ", stack.spec.names[r],
                    " (the checkpoint was written for another model or another rank layout)");
        continue;
      }
      preconditioner_->import_member(static_cast<int64_t>(s), r, it->second);
      elementwise_->import_member(static_cast<int64_t>(s), r, it->second);
    }
  }
}

}  // namespace shampoo::detail
