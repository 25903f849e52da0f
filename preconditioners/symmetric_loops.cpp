#include "preconditioners/symmetric_loops.h"

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

}  // namespace shampoo::detail
