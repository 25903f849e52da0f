#include "preconditioners/symmetric_loops.h"

#include <algorithm>

namespace shampoo::detail {

template <typename T>
void decay_add_packed_rows(T* stored, const T* outer, const T* beta2, const T* weight, int64_t d,
                           int64_t begin, int64_t end) {
  const int64_t p = d * (d + 1) / 2;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t m = task / d;
    const int64_t i = task % d;
    const T b = beta2[m];
    const T w = weight[m];
    const T* from = outer + m * d * d + i * d;
    T* to = stored + m * p + i * (i + 1) / 2;
    for (int64_t j = 0; j <= i; ++j) to[j] = to[j] * b + from[j] * w;
  }
}

template void decay_add_packed_rows<float>(float*, const float*, const float*, const float*,
                                           int64_t, int64_t, int64_t);
template void decay_add_packed_rows<double>(double*, const double*, const double*, const double*,
                                            int64_t, int64_t, int64_t);

template <typename T>
void symmetric_part_band(T* x, int64_t d, int64_t i0, int64_t i1) {
  constexpr int64_t kBand = kSymmetricBand;
  const T half = T(0.5);
  // The tile on the diagonal: both entries of each pair are in rows or columns [i0, i1).
  for (int64_t i = i0; i < i1; ++i) {
    for (int64_t j = i; j < i1; ++j) {
      const T s = (x[i * d + j] + x[j * d + i]) * half;
      x[i * d + j] = s;
      x[j * d + i] = s;
    }
  }
  // Tiles right of it: (i, j) in rows [i0, i1), its mirror (j, i) read into a local tile first as
  // runs of row j, so that no column is walked in memory.
  T mirror[kBand][kBand];
  const int64_t rows = i1 - i0;
  for (int64_t j0 = i1; j0 < d; j0 += kBand) {
    const int64_t cols = std::min(kBand, d - j0);
    for (int64_t c = 0; c < cols; ++c) {
      const T* from = x + (j0 + c) * d + i0;
      for (int64_t r = 0; r < rows; ++r) mirror[c][r] = from[r];
    }
    for (int64_t r = 0; r < rows; ++r) {
      T* row = x + (i0 + r) * d + j0;
      for (int64_t c = 0; c < cols; ++c) {
        const T s = (row[c] + mirror[c][r]) * half;
        row[c] = s;
        mirror[c][r] = s;
      }
    }
    for (int64_t c = 0; c < cols; ++c) {
      T* to = x + (j0 + c) * d + i0;
      for (int64_t r = 0; r < rows; ++r) to[r] = mirror[c][r];
    }
  }
}

template void symmetric_part_band<float>(float*, int64_t, int64_t, int64_t);
template void symmetric_part_band<double>(double*, int64_t, int64_t, int64_t);

}  // namespace shampoo::detail
