#pragma once
/// Which dims of a block keep a Kronecker factor: the per-parameter defaults by cost
/// (docs/math.md, "Which dims get a factor"). A factor along a dim of size d costs d² entries
/// (and as many for its root) whatever the rest of the block holds, so two kinds of parameter pay
/// far more than they gain:
///   - 1-D parameters (biases, norm scales): a [5000] bias blocked by 1024 keeps five 1024×1024
///     factors and roots, about 1000× its own bytes;
///   - very large dims (a [50000, 128] embedding's vocabulary dim): every block along it keeps a
///     factor of the block size, 8× the block for [1024, 128] blocks.
/// By default (ShampooOptions::precondition_1d false, max_factored_dim 4096) these get no factor:
/// a 1-D parameter, and a block none of whose dims keeps a factor, takes the grafting method's
/// update (AdamW's with Adam grafting); a block with some dims left keeps the factors of those
/// (one-sided Shampoo). ShampooOptions::reference_defaults() factors every dim, as the reference.

#include <cstdint>
#include <string>
#include <vector>

#include "distributor/block_plan.h"
#include "shampoo/shampoo_options.h"

namespace shampoo::detail {

/// The exponents of one block, and whether it is diagonal.
struct BlockFactorChoice {
  /// Per block dim: the root-inverse exponent; 0 = no factor along that dim.
  std::vector<double> dim_exponents;
  /// A rule removed a factor of this block, none is left, and grafting is on: its update is the
  /// grafting method's own (not the identity direction scaled to the grafting norm, which is what
  /// an inverse_exponent_override of 0 for every dim gives, as in the reference).
  bool diagonal = false;
};

/// True when the family of `options.preconditioner()` keeps Kronecker factors (root-inverse,
/// eigendecomposed and eigenvalue-corrected Shampoo); the rules apply to those only.
bool keeps_kronecker_factors(const ShampooOptions& options);
/// Whether factored_grafting is in effect for a group with these options: asked for, and the
/// family keeps Kronecker factors (which 2-D blocks of the group then factor V is
/// update/elementwise_state.h's factors_second_moment).
bool factors_grafting_statistics(const ShampooOptions& options);

/// The exponents of block `block_shape` of a parameter with plan `plan`: dim_exponents() of the
/// block's order (the inverse_exponent_override), then the rules: no factor for a 1-D parameter
/// (unless precondition_1d) nor along a merged dim larger than max_factored_dim.
BlockFactorChoice block_factor_choice(const ShampooOptions& options, const BlockPlan& plan,
                                      const std::vector<int64_t>& block_shape);

/// What a parameter gets, for logs and memory_summary(): "Kronecker factors on every dim",
/// "a Kronecker factor on dim 1 of [10000, 128] (dim 0: 10000 > max_factored_dim 4096)",
/// "the grafting update (1-D parameter)", ...
std::string describe_factor_choice(const ShampooOptions& options, const BlockPlan& plan);

}  // namespace shampoo::detail
