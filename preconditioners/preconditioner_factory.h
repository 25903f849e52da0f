#pragma once
/// The preconditioner families of PreconditionerConfig as the engine uses them: build the list of
/// a config, estimate its state, and the block order it needs. Each alternative's `List` decides
/// (preconditioner_family.h); nothing here names a family.

#include <memory>
#include <vector>

#include "preconditioners/preconditioner_list.h"

namespace shampoo::detail {

std::unique_ptr<PreconditionerList> make_preconditioner_list(const PreconditionerConfig& config,
                                                             std::vector<StackSpec> stacks,
                                                             MatrixPreconditionerSettings settings);

/// Bytes the list of `config` allocates for one block when it is built (its
/// estimated_state_bytes); equals its state_bytes() summed over the blocks (the contract tests).
int64_t estimated_state_bytes(const PreconditionerConfig& config, const BlockLayout& layout);

/// The number of dims blocking merges a parameter down to with `config`.
int64_t block_order(const PreconditionerConfig& config);

/// Whether the list of `config` keeps Kronecker factors along the dims of a block (its exponents
/// decide which dims); false for the diagonal and the descent families.
bool keeps_kronecker_factors(const PreconditionerConfig& config);

}  // namespace shampoo::detail
