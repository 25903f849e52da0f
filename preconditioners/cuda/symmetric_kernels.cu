#include "preconditioners/cuda/symmetric_kernels.h"

namespace shampoo::kernels::cuda {
namespace {

/// Offset of row i's first stored entry (i, 0) in a packed matrix.
__device__ __forceinline__ int64_t row_offset(int64_t i) { return i * (i + 1) / 2; }

constexpr int kRowThreads = 128;  // pack and the factor update: one CUDA block per matrix row
constexpr int kTile = 32;         // unpack: tiles of 32×32, 32×8 threads
constexpr int kTileRows = 8;
/// Grid sizes stay below the x dimension's limit; kernels stride over the rest.
constexpr int64_t kMaxBlocks = int64_t{1} << 30;

int grid_for(int64_t work) { return static_cast<int>(work < kMaxBlocks ? work : kMaxBlocks); }

/// One block per (matrix, row i): the i + 1 entries of the row, contiguous on both sides.
template <typename E>
__global__ void pack_lower_kernel(const E* dense, E* packed, int64_t count, int64_t d) {
  const int64_t p = d * (d + 1) / 2;
  for (int64_t task = blockIdx.x; task < count * d; task += gridDim.x) {
    const int64_t m = task / d;
    const int64_t i = task % d;
    const E* from = dense + m * d * d + i * d;
    E* to = packed + m * p + row_offset(i);
    for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) to[j] = from[j];
  }
}

/// One block per (matrix, tile (ti, tj) of the lower triangle, ti ≥ tj): the tile's stored
/// entries through shared memory, written to the dense tile and, off the diagonal, transposed to
/// the tile above it; both writes coalesced.
template <typename E>
__global__ void unpack_symmetric_kernel(const E* packed, E* dense, int64_t count, int64_t d) {
  __shared__ E tile[kTile][kTile + 1];
  const int64_t tiles = (d + kTile - 1) / kTile;
  const int64_t lower_tiles = tiles * (tiles + 1) / 2;
  const int64_t p = d * (d + 1) / 2;
  const int tx = static_cast<int>(threadIdx.x);
  for (int64_t task = blockIdx.x; task < count * lower_tiles; task += gridDim.x) {
    const int64_t m = task / lower_tiles;
    int64_t l = task % lower_tiles;
    int64_t ti = 0;  // the tile row: l = ti(ti + 1)/2 + tj
    while ((ti + 1) * (ti + 2) / 2 <= l) ++ti;
    const int64_t tj = l - ti * (ti + 1) / 2;
    const E* src = packed + m * p;
    E* dst = dense + m * d * d;
    for (int r = static_cast<int>(threadIdx.y); r < kTile; r += kTileRows) {
      const int64_t i = ti * kTile + r;
      const int64_t j = tj * kTile + tx;
      if (i < d && j <= i) tile[r][tx] = src[row_offset(i) + j];
    }
    __syncthreads();
    for (int r = static_cast<int>(threadIdx.y); r < kTile; r += kTileRows) {
      // Lower tile: (i, j) = tile[r][tx] on and below the diagonal, its mirror tile[tx][r] above
      // (diagonal tiles only).
      const int64_t i = ti * kTile + r;
      const int64_t j = tj * kTile + tx;
      if (i < d && j < d) dst[i * d + j] = j <= i ? tile[r][tx] : tile[tx][r];
      if (ti != tj) {
        // Upper tile: (tj·32 + r, ti·32 + tx) = (ti·32 + tx, tj·32 + r) of the lower one.
        const int64_t ui = tj * kTile + r;
        const int64_t uj = ti * kTile + tx;
        if (uj < d) dst[ui * d + uj] = tile[tx][r];
      }
    }
    __syncthreads();
  }
}

__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

template <typename T>
__global__ void packed_decay_add_kernel(T* stored, const T* outer, const T* beta2, const T* weight,
                                        int64_t count, int64_t d) {
  const int64_t p = d * (d + 1) / 2;
  for (int64_t task = blockIdx.x; task < count * d; task += gridDim.x) {
    const int64_t m = task / d;
    const int64_t i = task % d;
    const T b = beta2[m];
    const T w = weight[m];
    const T* from = outer + m * d * d + i * d;
    T* to = stored + m * p + row_offset(i);
    for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) {
      to[j] = add_rn(mul_rn(to[j], b), mul_rn(from[j], w));
    }
  }
}

template <typename E>
cudaError_t pack_as(const void* dense, void* packed, int64_t count, int64_t d,
                    cudaStream_t stream) {
  pack_lower_kernel<E><<<grid_for(count * d), kRowThreads, 0, stream>>>(
      static_cast<const E*>(dense), static_cast<E*>(packed), count, d);
  return cudaGetLastError();
}

template <typename E>
cudaError_t unpack_as(const void* packed, void* dense, int64_t count, int64_t d,
                      cudaStream_t stream) {
  const int64_t tiles = (d + kTile - 1) / kTile;
  unpack_symmetric_kernel<E>
      <<<grid_for(count * (tiles * (tiles + 1) / 2)), dim3(kTile, kTileRows), 0, stream>>>(
          static_cast<const E*>(packed), static_cast<E*>(dense), count, d);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_pack_lower(const void* dense, void* packed, int64_t count, int64_t d,
                              int element_size, cudaStream_t stream) {
  if (count == 0 || d == 0) return cudaSuccess;
  switch (element_size) {
    case 1:
      return pack_as<uint8_t>(dense, packed, count, d, stream);
    case 2:
      return pack_as<uint16_t>(dense, packed, count, d, stream);
    case 4:
      return pack_as<uint32_t>(dense, packed, count, d, stream);
    case 8:
      return pack_as<uint64_t>(dense, packed, count, d, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t launch_unpack_symmetric(const void* packed, void* dense, int64_t count, int64_t d,
                                    int element_size, cudaStream_t stream) {
  if (count == 0 || d == 0) return cudaSuccess;
  switch (element_size) {
    case 1:
      return unpack_as<uint8_t>(packed, dense, count, d, stream);
    case 2:
      return unpack_as<uint16_t>(packed, dense, count, d, stream);
    case 4:
      return unpack_as<uint32_t>(packed, dense, count, d, stream);
    case 8:
      return unpack_as<uint64_t>(packed, dense, count, d, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t launch_packed_decay_add(T* stored, const T* outer, const T* beta2, const T* weight,
                                    int64_t count, int64_t d, cudaStream_t stream) {
  if (count == 0 || d == 0) return cudaSuccess;
  packed_decay_add_kernel<T>
      <<<grid_for(count * d), kRowThreads, 0, stream>>>(stored, outer, beta2, weight, count, d);
  return cudaGetLastError();
}

template cudaError_t launch_packed_decay_add<float>(float*, const float*, const float*,
                                                    const float*, int64_t, int64_t, cudaStream_t);
template cudaError_t launch_packed_decay_add<double>(double*, const double*, const double*,
                                                     const double*, int64_t, int64_t, cudaStream_t);

}  // namespace shampoo::kernels::cuda
