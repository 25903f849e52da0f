#pragma once
/// Tensor contractions of Kronecker-factored preconditioners over stacks of equal-shape blocks.
/// A stack holds n blocks as [n, d_0, ..., d_{k-1}]; matrices acting on block dim j are
/// [n, d_j, d_j]. Every block is computed on its own, from 64-byte-aligned operands: batched
/// BLAS/LAPACK calls on this CPU round differently depending on the batch (its size, the
/// alignment of each matrix), which would break "merged ≡ unmerged" and "distributed ≡ single
/// process" bit for bit. A block's result depends on its values only.

#include <ATen/ATen.h>

#include <cstdint>

namespace shampoo::detail {

/// Whether `t` is contiguous and starts on a 64-byte boundary, as a fresh allocation does: as a
/// BLAS operand or output it rounds as fresh memory would.
bool aligned_output(const at::Tensor& t);
/// `t` itself when it is contiguous and starts on a 64-byte boundary, else a fresh (aligned) copy.
at::Tensor aligned_matrix_operand(const at::Tensor& t);

/// One block (no leading stack dim): the contraction with itself over every dim but `dim`,
/// [d_dim, d_dim], computed from aligned operands (CPU) like the stacked version.
at::Tensor block_outer_product(const at::Tensor& block, int64_t dim);
/// One block multiplied along `dim` by `matrix` [d_dim, d_dim] (or its transpose).
at::Tensor block_multiply_along_dim(const at::Tensor& block, const at::Tensor& matrix, int64_t dim,
                                    bool transpose = false);

/// block_multiply_along_dim written into `out` (the block's shape, contiguous): the product goes
/// straight into it where it starts on a 64-byte boundary and overlaps neither operand (the same
/// bits as into fresh memory), else through a fresh result.
void block_multiply_along_dim_out(at::Tensor& out, const at::Tensor& block,
                                  const at::Tensor& matrix, int64_t dim, bool transpose = false);

/// The Kronecker factor contribution of every block along block dim `dim`: the block contracted
/// with itself over every other dim, [n, d_dim, d_dim] (for a matrix block: G·Gᵀ for dim 0,
/// Gᵀ·G for dim 1; for a vector block: g·gᵀ).
at::Tensor stacked_outer_product(const at::Tensor& blocks, int64_t dim);

/// stacked_outer_product where only the lower triangle (diagonal included) is read; the rest of
/// the upper triangle may be left unwritten. On the CPU, the same panel products as
/// stacked_outer_product (the lower triangle bit for bit its), without mirroring them. On CUDA, for
/// d_dim ≥ 256, two batched products fill the lower blocks only, [0, d)×[0, h) and [h, d)×[h, d)
/// with h ≈ d/2 (3/4 of the multiplications); otherwise the full product. Kronecker factor updates
/// keep the lower triangle only.
at::Tensor stacked_outer_product_lower(const at::Tensor& blocks, int64_t dim);

/// Whether stacked_outer_product_lower skips the upper blocks on CUDA (default true); false
/// computes full products, for benchmarks that compare the two.
void set_lower_outer_products_for_benchmarks(bool enabled);

/// Multiplies every block along block dim `dim` by its matrix: with M [n, d_dim, d_dim],
/// out[..., i, ...] = Σ_j M[i, j] · in[..., j, ...] (or M[j, i] when `transpose`).
/// For a matrix block: dim 0 gives M·B, dim 1 gives B·Mᵀ.
at::Tensor stacked_multiply_along_dim(const at::Tensor& blocks, const at::Tensor& matrices,
                                      int64_t dim, bool transpose = false);

}  // namespace shampoo::detail
