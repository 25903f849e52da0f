#include "update/elementwise_chain_cpu.h"

#include <algorithm>
#include <cmath>

namespace shampoo::kernels {
namespace {

/// A tile's intermediates: G', Ḡ (when it differs from G') and P (then the update U).
template <typename T>
struct TileBuffers {
  alignas(64) T g[kChainTile];
  alignas(64) T f[kChainTile];
  alignas(64) T p[kChainTile];
};

/// out = lerp(self, end, w), torch.lerp's two formulas as in kernels::lerp (the branch on the
/// weight taken once per tile).
template <typename T>
void lerp_tile(T* __restrict out, const T* __restrict self, const T* __restrict end, T w,
               int64_t n) {
  if (w < T(0.5) && w > T(-0.5)) {
    for (int64_t i = 0; i < n; ++i) out[i] = self[i] + w * (end[i] - self[i]);
  } else {
    const T complement = T(1) - w;
    for (int64_t i = 0; i < n; ++i) out[i] = end[i] - (end[i] - self[i]) * complement;
  }
}

/// m = lerp(m, end, w) in place.
template <typename T>
void lerp_in_place(T* __restrict m, const T* __restrict end, T w, int64_t n) {
  if (w < T(0.5) && w > T(-0.5)) {
    for (int64_t i = 0; i < n; ++i) m[i] = m[i] + w * (end[i] - m[i]);
  } else {
    const T complement = T(1) - w;
    for (int64_t i = 0; i < n; ++i) m[i] = end[i] - (end[i] - m[i]) * complement;
  }
}

/// chain_filter_element over the n elements from o: G' into t.g (and gradient_out), V and M
/// updated; returns Ḡ (t.g without filtering, else t.f).
template <typename T>
const T* filter_tile(const ChainBlock<T>& b, int64_t o, int64_t n, TileBuffers<T>& t) {
  const ChainScalars& s = b.s;
  T* __restrict g = t.g;
  const T* grad = b.grad + o;
  if (s.l2_weight_decay != 0.0) {
    const T wd = T(s.l2_weight_decay);
    const T* param = b.param + o;
    for (int64_t i = 0; i < n; ++i) g[i] = grad[i] + wd * param[i];
  } else {
    std::copy_n(grad, n, g);
  }
  if (b.gradient_out != nullptr) std::copy_n(g, n, b.gradient_out + o);
  if (b.diagonal_state != nullptr) {
    T* __restrict v = b.diagonal_state + o;
    const T beta2 = T(s.diagonal_beta2);
    const T weight = T(s.diagonal_weight);
    for (int64_t i = 0; i < n; ++i) v[i] = beta2 * v[i] + weight * g[i] * g[i];
  }
  if (b.filter_state == nullptr) return g;
  T* __restrict m = b.filter_state + o;
  T* __restrict f = t.f;
  const T weight1 = T(1.0 - s.beta1);
  if (s.separate_beta3) {
    lerp_tile(f, m, g, T(1.0 - s.beta3), n);  // from M before its update
    lerp_in_place(m, g, weight1, n);
  } else {
    lerp_in_place(m, g, weight1, n);
    std::copy_n(m, n, f);
  }
  if (s.filter_bias_correction != 1.0) {
    const T correction = T(s.filter_bias_correction);
    for (int64_t i = 0; i < n; ++i) f[i] = f[i] / correction;
  }
  return f;
}

/// chain_direction over the tile into p.
template <typename T>
void direction_tile(const ChainBlock<T>& b, int64_t o, int64_t n, const T* filtered,
                    T* __restrict p) {
  const ChainScalars& s = b.s;
  switch (static_cast<DirectionMode>(s.direction_mode)) {
    case DirectionMode::kDiagonal: {
      if (b.diagonal_state == nullptr) {
        std::copy_n(filtered, n, p);
        return;
      }
      const T* v = b.diagonal_state + o;
      const T correction = T(s.diagonal_bias_correction);
      const T epsilon = T(s.diagonal_epsilon);
      for (int64_t i = 0; i < n; ++i) p[i] = filtered[i] / (std::sqrt(v[i] / correction) + epsilon);
      return;
    }
    case DirectionMode::kGraftNorm: {
      const T ratio = T(s.graft_ratio);
      const T* preconditioned = b.preconditioned + o;
      for (int64_t i = 0; i < n; ++i) p[i] = preconditioned[i] * ratio;
      return;
    }
    case DirectionMode::kSign:
      for (int64_t i = 0; i < n; ++i) p[i] = sign_of(filtered[i]);
      return;
    case DirectionMode::kPreconditioned:
    default:
      std::copy_n(b.preconditioned != nullptr ? b.preconditioned + o : filtered, n, p);
  }
}

/// chain_apply_element over the n elements from o, from Ḡ = `filtered`.
template <typename T>
void apply_tile(const ChainBlock<T>& b, int64_t o, int64_t n, const T* filtered,
                TileBuffers<T>& t) {
  const ChainScalars& s = b.s;
  T* __restrict p = t.p;
  direction_tile(b, o, n, filtered, p);
  const T* param = b.param != nullptr ? b.param + o : nullptr;
  if (s.decoupled_weight_decay != 0.0) {
    const T wd = T(s.decoupled_weight_decay);
    for (int64_t i = 0; i < n; ++i) p[i] = p[i] + wd * param[i];
  }
  if (b.momentum_state != nullptr) {
    T* __restrict buffer = b.momentum_state + o;
    const T momentum = T(s.momentum);
    const T one_minus_dampening = T(1.0 - s.dampening);
    if (s.nesterov) {
      for (int64_t i = 0; i < n; ++i) {
        const T next = momentum * buffer[i] + one_minus_dampening * p[i];
        buffer[i] = next;
        p[i] = one_minus_dampening * p[i] + momentum * next;
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        const T next = momentum * buffer[i] + one_minus_dampening * p[i];
        buffer[i] = next;
        p[i] = next;
      }
    }
  }
  const T minus_lr = T(-s.lr);
  for (int64_t i = 0; i < n; ++i) p[i] = minus_lr * p[i];
  if (b.average_state != nullptr) {
    T* __restrict z = b.average_state + o;
    const T decay = T(s.average_decay);
    const T step = T(s.average_step);
    const T pull = T(s.average_pull);
    for (int64_t i = 0; i < n; ++i) {
      const T decayed = decay * z[i];
      z[i] = decayed + p[i];
      p[i] = step * p[i] + pull * (decayed - param[i]);
    }
  }
  if (b.param_out != nullptr) {
    T* out = b.param_out + o;
    if (out == param) {
      for (int64_t i = 0; i < n; ++i) out[i] = out[i] + p[i];
    } else {
      for (int64_t i = 0; i < n; ++i) out[i] = param[i] + p[i];
    }
  } else if (s.output_updated_param) {
    T* out = b.update_out + o;
    for (int64_t i = 0; i < n; ++i) out[i] = param[i] + p[i];
  } else {
    std::copy_n(p, n, b.update_out + o);
  }
}

}  // namespace

template <typename T>
void chain_pre_tiles(const ChainBlock<T>& b, int64_t begin, int64_t end) {
  TileBuffers<T> t;
  for (int64_t o = begin; o < end; o += kChainTile) {
    const int64_t n = std::min(kChainTile, end - o);
    std::copy_n(filter_tile(b, o, n, t), n, b.filtered_out + o);
  }
}

template <typename T>
void chain_post_tiles(const ChainBlock<T>& b, int64_t begin, int64_t end) {
  TileBuffers<T> t;
  for (int64_t o = begin; o < end; o += kChainTile) {
    const int64_t n = std::min(kChainTile, end - o);
    apply_tile(b, o, n, b.filtered_out + o, t);
  }
}

template <typename T>
void chain_fused_tiles(const ChainBlock<T>& b, int64_t begin, int64_t end) {
  TileBuffers<T> t;
  for (int64_t o = begin; o < end; o += kChainTile) {
    const int64_t n = std::min(kChainTile, end - o);
    apply_tile(b, o, n, filter_tile(b, o, n, t), t);
  }
}

template void chain_pre_tiles<float>(const ChainBlock<float>&, int64_t, int64_t);
template void chain_pre_tiles<double>(const ChainBlock<double>&, int64_t, int64_t);
template void chain_post_tiles<float>(const ChainBlock<float>&, int64_t, int64_t);
template void chain_post_tiles<double>(const ChainBlock<double>&, int64_t, int64_t);
template void chain_fused_tiles<float>(const ChainBlock<float>&, int64_t, int64_t);
template void chain_fused_tiles<double>(const ChainBlock<double>&, int64_t, int64_t);

}  // namespace shampoo::kernels
