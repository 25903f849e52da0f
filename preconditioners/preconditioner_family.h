#pragma once
/// What the engine needs of a preconditioner family, made from its config type alone: the list
/// it runs (`C::List`, built from the blocks' stacks, the config and the common settings), the
/// list's state-size estimate, and the order its blocks are merged down to. Templates, so that a
/// family defined outside the library (docs/extending.md) gets the same treatment as the built-in
/// ones; preconditioner_factory.h applies them to PreconditionerConfig.

#include <memory>
#include <utility>
#include <vector>

#include "preconditioners/preconditioner_list.h"

namespace shampoo::detail {

/// The list of family C for `stacks`; KL-Shampoo's configs set the factors' statistics.
template <typename C>
std::unique_ptr<PreconditionerList> make_family_list(const C& config, std::vector<StackSpec> stacks,
                                                     MatrixPreconditionerSettings settings) {
  if constexpr (requires { factor_statistics(config); }) {
    settings.statistics = factor_statistics(config);
  }
  return std::make_unique<typename C::List>(std::move(stacks), config, std::move(settings));
}

/// Bytes family C's list allocates for one block when it is built.
template <typename C>
int64_t family_state_bytes(const C& config, const BlockLayout& layout) {
  return C::List::estimated_state_bytes(config, layout);
}

/// The number of dims blocking merges a parameter down to (distributor/block_plan.h): the list's
/// kBlockOrder where it has one (spectral descent: 2), else 1.
template <typename C>
constexpr int64_t family_block_order() {
  if constexpr (requires { C::List::kBlockOrder; }) {
    return C::List::kBlockOrder;
  } else {
    return 1;
  }
}

}  // namespace shampoo::detail
