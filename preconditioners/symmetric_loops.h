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

}  // namespace shampoo::detail
