#pragma once
/// CUDA kernels of the packed symmetric layout (preconditioners/symmetric_matrices.h), without
/// LibTorch: pack and unpack as copies with the layout's index arithmetic (no index tensor to
/// read), and the packed factor update in one pass. Every pointer is device memory, every matrix
/// contiguous: `count` matrices of d×d (dense) or of d(d+1)/2 entries (packed, the lower triangle
/// row by row). Built only with CUDA (SHAMPOO_WITH_CUDA).

#include <cuda_runtime_api.h>

#include <cstdint>

namespace shampoo::kernels::cuda {

/// packed[m] = the lower triangle of dense[m]. `element_size`: 1, 2, 4 or 8 bytes (the values
/// are copied as bytes); anything else is cudaErrorInvalidValue.
cudaError_t launch_pack_lower(const void* dense, void* packed, int64_t count, int64_t d,
                              int element_size, cudaStream_t stream);

/// dense[m] = the symmetric matrix whose lower triangle packed[m] holds (both triangles written).
cudaError_t launch_unpack_symmetric(const void* packed, void* dense, int64_t count, int64_t d,
                                    int element_size, cudaStream_t stream);

/// The packed factor update, for each stored entry (i, j), i ≥ j, of matrix m:
///   stored[m](i, j) = beta2[m]·stored[m](i, j) + weight[m]·outer[m](i, j),
/// each product and the sum rounded once (no fused multiply-add), as the ATen sequence
/// outer·weight, pack, stored·beta2, + rounds. T: float or double.
template <typename T>
cudaError_t launch_packed_decay_add(T* stored, const T* outer, const T* beta2, const T* weight,
                                    int64_t count, int64_t d, cudaStream_t stream);

}  // namespace shampoo::kernels::cuda
