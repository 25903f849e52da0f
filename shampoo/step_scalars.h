#pragma once
/// The one place where a param group's live options meet the kernels: what a block's options
/// mean at step t (its schedule, the scalars of its statistics and of its elementwise chain).
/// The float options are read here from each group's live options at every step; the structural
/// ones (equal across a virtual group) decide the schedule. docs/math.md has the formulas.

#include <ATen/ATen.h>

#include "preconditioners/rows.h"
#include "shampoo/shampoo_options.h"
#include "update/elementwise_chain_kernels.h"

namespace shampoo::detail {

/// Whether the amortized computation (roots, eigenbases) runs at step t (docs/math.md, step 3):
/// at the start step, then every precondition_frequency steps.
bool amortized_at(const ShampooOptions& structure, int64_t t);

/// Whether the block is matrix-preconditioned at step t. Before the start step: with grafting the
/// grafting method runs alone; without it the preconditioner runs unless it is still the
/// identity (root-inverse Shampoo before its first root), which is skipped.
bool matrix_preconditioned_at(const ShampooOptions& structure, int64_t t,
                              bool identity_before_amortization);

/// Appends the scalars of the factor statistics of one block at step t (docs/math.md, steps 2
/// and 3): β2, the factor weight, the bias correction, ε, t.
void push_statistics_scalars(const ShampooOptions& options, int64_t t, RowScalars& scalars);

/// The coefficients of iterate averaging (docs/math.md, "Iterate averaging"): μx (eval) and μy
/// (train). Schedule-Free's μx = 1 − lr^p / lr_sum, with `lr_sum` the group's Σ lr^p including
/// this step's (μx = 1 while the sum is 0, i.e. lr = 0 so far).
struct AveragingCoefficients {
  double eval = 0.0;
  double train = 1.0;
};
AveragingCoefficients averaging_coefficients(const ShampooOptions& options, double lr_sum);

/// What a step adds to its group's Σ lr^p: lr^p with Schedule-Free, 0 otherwise.
double lr_power_term(const ShampooOptions& options);

/// Whether the options select iterate averaging (GPA or Schedule-Free).
bool averaging_enabled(const ShampooOptions& options);

/// The scalars of the elementwise chain of one block at step t: L2 or decoupled weight decay,
/// β1/β3 filtering and its bias correction, the grafting coefficients and the direction mode,
/// momentum, dampening, Nesterov, lr, iterate averaging (`lr_sum`: as for
/// averaging_coefficients). `communicate_params`: the block's owner sends W + U.
kernels::ChainScalars chain_scalars(const ShampooOptions& options, int64_t t,
                                    bool communicate_params, double lr_sum = 0.0);

/// Whether the chain of this block reads the parameter W (weight decay, averaging, or W + U
/// written out).
bool chain_reads_param(const kernels::ChainScalars& scalars);

/// Docs/math.md "Gradients too large for the state": why a gradient whose entries reach
/// `grad_abs_max` (finite) would overflow the group's state, or "" when it fits. The state keeps
/// squares of the gradient (Kronecker factors, the second moments of the diagonal families and of
/// grafting); one step adds at most grad_abs_max² · block_numel to any entry of it (a factor's
/// contraction, a row sum of factored grafting, a rotated SOAP entry), which must stay within half
/// the largest value of the dtype that keeps it: float32 unless the compute dtype and the factor
/// dtype are both float64. A state already at inf would never change again (every later step
/// then moves the parameter by 0 or NaN).
std::string statistics_overflow(const ShampooOptions& options, at::ScalarType compute_dtype,
                                int64_t block_numel, double grad_abs_max);

/// A bound on max |G'| of a block, G' = G + wd·W under L2 weight decay, from max |G|.
double gradient_bound(const ShampooOptions& options, double grad_abs_max,
                      const at::Tensor& param_block);

}  // namespace shampoo::detail
