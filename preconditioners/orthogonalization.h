#pragma once
/// Orthogonalization of stacks of matrices: the direction U·Vᵀ of each matrix A = U·S·Vᵀ (its
/// nearest semi-orthogonal matrix), by the quintic Newton–Schulz iteration (matrix products only)
/// or by the reduced SVD. The math: docs/math.md, "Spectral descent".

#include <ATen/ATen.h>

#include <array>
#include <cstdint>

#include "preconditioners/preconditioner_configs.h"

namespace shampoo::detail {

/// The quintic Newton–Schulz iteration on a stack [n, m, k], all matrices as one batch: from
/// X₀ = A / max(‖A‖_F, 1e-8) (per matrix), iterated on the orientation with more rows than
/// columns (a wide matrix is transposed and transposed back, so the Gram matrix is the smaller
/// one). Dtype of `blocks`.
at::Tensor newton_schulz(const at::Tensor& blocks, int64_t num_iterations,
                         const std::array<double, 3>& coefficients);

/// U·Vᵀ of every matrix of a stack [n, m, k] by its reduced SVD (times Σ s_i when
/// `scale_by_nuclear_norm`), as one batch.
at::Tensor svd_orthogonalize(const at::Tensor& blocks, bool scale_by_nuclear_norm);

/// The orthogonalized direction of every matrix of a stack [n, m, k], scaled as `settings` says.
/// CUDA: the whole stack as one batch. CPU: every matrix on its own from an aligned copy (a
/// batch of one), since batched CPU BLAS rounds a matrix depending on the rest of its batch and
/// merged ≡ unmerged and distributed ≡ single process must hold bit for bit
/// (kronecker_contractions.h).
at::Tensor stacked_orthogonalize(const at::Tensor& blocks, const SpectralDescentConfig& settings);

}  // namespace shampoo::detail
