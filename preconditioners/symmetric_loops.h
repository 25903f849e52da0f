#pragma once
/// CPU loops of the packed symmetric layout that do arithmetic
/// (preconditioners/symmetric_matrices.h), compiled apart without LibTorch and with
/// -ffp-contract=off, so that every product and sum rounds once whatever the target (no fused
/// multiply-add), as the ATen operations they stand for.

#include <cstdint>

namespace shampoo::detail {

/// The packed factor update for the rows task ∈ [begin, end) of a stack of d×d matrices (task =
/// m·d + i: row i of matrix m): stored[m](i, j) = beta2[m]·stored[m](i, j) + weight[m]·outer[m](i,
/// j) for j ≤ i. `stored` holds d(d+1)/2 entries per matrix, `outer` d².
template <typename T>
void decay_add_packed_rows(T* stored, const T* outer, const T* beta2, const T* weight, int64_t d,
                           int64_t begin, int64_t end);

/// Rows per band of the CPU's tiled loops over symmetric matrices.
inline constexpr int64_t kSymmetricBand = 32;

/// The symmetric part of one d×d matrix in place, for the band of rows [i0, i1) (i1 − i0 ≤
/// kSymmetricBand):
/// x(i, j) and x(j, i) ← (x(i, j) + x(j, i))·0.5 for i ∈ [i0, i1) and j ≥ i, so the diagonal is
/// (x + x)·0.5. The sum and the product round once each, as ATen's (X + Xᵀ) * 0.5 does. Bands
/// touch disjoint entries: a matrix's bands may run in parallel.
template <typename T>
void symmetric_part_band(T* x, int64_t d, int64_t i0, int64_t i1);

}  // namespace shampoo::detail
