#pragma once
/// Kernel layer of the elementwise chain of one Shampoo step (no LibTorch here: raw pointers,
/// sizes and per-block scalars in). The chain runs for all blocks of a virtual group at once, each
/// block with its own hyperparameters, in three passes:
///   pre:   L2 weight decay, diagonal (grafting) statistics, β1/β3 filtering   -> G', Ḡ
///   norms: ‖P‖² and ‖P_graft‖² per block (only for blocks that match norms)
///   post:  grafting, decoupled weight decay, momentum, × (−lr), iterate averaging, apply or
///          write the update
/// When no matrix preconditioner sits between them (the diagonal families and sign descent as the
/// main preconditioner, without grafting), pre and post run as one fused pass that keeps Ḡ in a
/// register instead of writing it out.
/// The per-element math is shared by the CPU path and the CUDA kernels (update/cuda/), so both
/// compute the same formulas (docs/math.md); the CPU path runs them in tiles
/// (elementwise_chain_cpu.h), operation for operation the same, so bit for bit the same.

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define SHAMPOO_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SHAMPOO_HOST_DEVICE inline
#endif

namespace shampoo::kernels {

/// What the post pass uses as the search direction P of a block.
enum class DirectionMode : int32_t {
  kPreconditioned = 0,  ///< P = the matrix-preconditioned Ḡ (or Ḡ itself when none is given)
  /// P = the diagonal direction Ḡ / (sqrt(V / bc2) + ε) with statistics V, Ḡ without: grafting's
  /// warm-up before preconditioning, or a diagonal main preconditioner in the fused pass.
  kDiagonal = 1,
  kGraftNorm = 2,  ///< P = preconditioned · ‖P_graft‖ / (‖preconditioned‖ + 1e−16)
  kSign = 3,       ///< P = sign(Ḡ) (sign descent with scale 1, in the fused pass)
};

/// Per-block scalars of one step, resolved on the host (double; cast to the compute type).
struct ChainScalars {
  double l2_weight_decay = 0.0;         ///< G' = G + wd·W (0 = off)
  double beta1 = 0.0;                   ///< M ← lerp(M, G', 1 − β1) (0 = no filtering)
  double beta3 = 0.0;                   ///< Ḡ = lerp(M_prev, G', 1 − β3) when separate_beta3
  int32_t separate_beta3 = 0;           ///< β3 ≠ β1
  double filter_bias_correction = 1.0;  ///< Ḡ ← Ḡ / this
  double diagonal_beta2 = 1.0;  ///< grafting statistics V ← β2·V + weight·G'² (update/grafting.h)
  double diagonal_weight = 1.0;
  double diagonal_bias_correction = 1.0;  ///< P_graft = Ḡ / (sqrt(V / bc2) + ε)
  double diagonal_epsilon = 0.0;
  int32_t direction_mode = 0;           ///< DirectionMode
  double graft_ratio = 1.0;             ///< filled in between the norm and post passes
  double decoupled_weight_decay = 0.0;  ///< P ← P + wd·W (0 = off)
  double momentum = 0.0;                ///< B ← μ·B + (1 − dampening)·P (0 = off)
  double dampening = 0.0;
  int32_t nesterov = 0;
  double lr = 0.0;                   ///< U = −lr·P
  int32_t output_updated_param = 0;  ///< write W + U instead of U (communicate_params)
  /// Iterate averaging (docs/math.md, "Iterate averaging"), with the averaging sequence Z:
  /// Z_d = average_decay·Z, Z ← Z_d + U, U ← average_step·U + average_pull·(Z_d − W).
  int32_t averaging = 0;
  double average_decay = 1.0;  ///< 1 − lr·wd with decoupled weight decay (which then skips P)
  double average_step = 1.0;   ///< 1 − μx·μy
  double average_pull = 0.0;   ///< 1 − μx
};

/// Pointers of one block for the three passes. Rows of stacks or views of parameters; every
/// pointer addresses `numel` contiguous elements. Null means "not used by this block".
template <typename T>
struct ChainBlock {
  int64_t numel = 0;
  const T* grad = nullptr;      ///< G (read)
  const T* param = nullptr;     ///< W (read)
  T* gradient_out = nullptr;    ///< G' (pre pass)
  T* filtered_out = nullptr;    ///< Ḡ (pre pass writes, post pass reads); may alias gradient_out
  T* filter_state = nullptr;    ///< M
  T* diagonal_state = nullptr;  ///< V
  const T* preconditioned = nullptr;  ///< matrix-preconditioned Ḡ (post pass)
  T* momentum_state = nullptr;        ///< B
  T* average_state = nullptr;         ///< Z (iterate averaging)
  T* param_out = nullptr;             ///< apply W ← W + U in place (single process) ...
  T* update_out = nullptr;            ///< ... or write U (or W + U) here (distributed)
  /// CUDA: the grafting ratio in device memory, written by the norm pass on the device; the post
  /// kernel reads it instead of s.graft_ratio (no round trip through the host). Null elsewhere.
  const double* graft_ratio_device = nullptr;
  ChainScalars s;
};

/// A chunk of one block, the unit of parallel work: elements [begin, end) of blocks[block].
struct ChainWorkItem {
  int64_t block;
  int64_t begin;
  int64_t end;
};

/// torch.lerp's formula (ATen/native/Lerp.h): exact at weight 0 and 1.
template <typename T>
SHAMPOO_HOST_DEVICE T lerp(T self, T end, T weight) {
  return (weight < T(0.5) && weight > T(-0.5)) ? self + weight * (end - self)
                                               : end - (end - self) * (T(1) - weight);
}

/// The diagonal direction of element i (grafting's P_graft, or a diagonal main preconditioner's
/// P): Ḡ, divided by sqrt(V / bc2) + ε when the block has statistics V (AdaGrad, RMSprop, Adam;
/// SGD has none).
template <typename T>
SHAMPOO_HOST_DEVICE T diagonal_direction(const ChainBlock<T>& b, int64_t i, T filtered) {
  if (b.diagonal_state == nullptr) return filtered;
  using std::sqrt;
  const ChainScalars& s = b.s;
  const T denom = sqrt(b.diagonal_state[i] / T(s.diagonal_bias_correction)) + T(s.diagonal_epsilon);
  return filtered / denom;
}

/// torch.sign's value (ATen's sign kernel): −1, 0 or 1; 0 for ±0 and NaN.
template <typename T>
SHAMPOO_HOST_DEVICE T sign_of(T x) {
  return T(T(0) < x) - T(x < T(0));
}

/// The first half of the chain for element i of a block: G' (written to gradient_out when
/// given), V and M updated; returns Ḡ.
/// Every load comes before the first store: the compiler must assume the outputs may alias the
/// inputs, so a load after a store waits for it, and on a GPU each waits a memory round trip.
template <typename T>
SHAMPOO_HOST_DEVICE T chain_filter_element(const ChainBlock<T>& b, int64_t i) {
  const ChainScalars& s = b.s;
  T g = b.grad[i];
  const T w = s.l2_weight_decay != 0.0 ? b.param[i] : T(0);
  const T v = b.diagonal_state != nullptr ? b.diagonal_state[i] : T(0);
  const T m_prev = b.filter_state != nullptr ? b.filter_state[i] : T(0);
  if (s.l2_weight_decay != 0.0) g = g + T(s.l2_weight_decay) * w;
  if (b.gradient_out != nullptr) b.gradient_out[i] = g;
  if (b.diagonal_state != nullptr) {
    b.diagonal_state[i] = T(s.diagonal_beta2) * v + T(s.diagonal_weight) * g * g;
  }
  T filtered = g;
  if (b.filter_state != nullptr) {
    const T m = lerp<T>(m_prev, g, T(1.0 - s.beta1));
    b.filter_state[i] = m;
    filtered = s.separate_beta3 ? lerp<T>(m_prev, g, T(1.0 - s.beta3)) : m;
    if (s.filter_bias_correction != 1.0) filtered = filtered / T(s.filter_bias_correction);
  }
  return filtered;
}

/// Pre pass for element i of a block: Ḡ written to filtered_out.
template <typename T>
SHAMPOO_HOST_DEVICE void chain_pre_element(const ChainBlock<T>& b, int64_t i) {
  b.filtered_out[i] = chain_filter_element(b, i);
}

/// The search direction of element i (Ḡ = `filtered`) before weight decay and momentum.
template <typename T>
SHAMPOO_HOST_DEVICE T chain_direction(const ChainBlock<T>& b, int64_t i, T filtered) {
  const ChainScalars& s = b.s;
  switch (static_cast<DirectionMode>(s.direction_mode)) {
    case DirectionMode::kDiagonal:
      return diagonal_direction<T>(b, i, filtered);
    case DirectionMode::kGraftNorm:
      return b.preconditioned[i] * T(s.graft_ratio);
    case DirectionMode::kSign:
      return sign_of(filtered);
    case DirectionMode::kPreconditioned:
    default:
      return b.preconditioned != nullptr ? b.preconditioned[i] : filtered;
  }
}

/// Norm pass for element i: adds P² and P_graft² (kGraftNorm blocks only).
template <typename T>
SHAMPOO_HOST_DEVICE void chain_norm_element(const ChainBlock<T>& b, int64_t i,
                                            double& preconditioned_sq, double& graft_sq) {
  const double p = static_cast<double>(b.preconditioned[i]);
  const double g = static_cast<double>(diagonal_direction<T>(b, i, b.filtered_out[i]));
  preconditioned_sq += p * p;
  graft_sq += g * g;
}

/// Iterate averaging of element i: advances Z by the plain step U (after its decoupled weight
/// decay) and returns the update of the training sequence (the parameter).
template <typename T>
SHAMPOO_HOST_DEVICE T primal_average(const ChainBlock<T>& b, int64_t i, T update) {
  const ChainScalars& s = b.s;
  const T decayed = T(s.average_decay) * b.average_state[i];
  b.average_state[i] = decayed + update;
  return T(s.average_step) * update + T(s.average_pull) * (decayed - b.param[i]);
}

/// The second half of the chain for element i, from its Ḡ (`filtered`). The parameter is read
/// only when needed (decoupled weight decay, an in-place update, averaging, or writing the
/// updated parameter), so callers may leave it null otherwise.
template <typename T>
SHAMPOO_HOST_DEVICE void chain_apply_element(const ChainBlock<T>& b, int64_t i, T filtered) {
  const ChainScalars& s = b.s;
  T p = chain_direction<T>(b, i, filtered);
  if (s.decoupled_weight_decay != 0.0) p = p + T(s.decoupled_weight_decay) * b.param[i];
  if (b.momentum_state != nullptr) {
    const T one_minus_dampening = T(1.0 - s.dampening);
    const T buffer = T(s.momentum) * b.momentum_state[i] + one_minus_dampening * p;
    b.momentum_state[i] = buffer;
    p = s.nesterov ? one_minus_dampening * p + T(s.momentum) * buffer : buffer;
  }
  T update = T(-s.lr) * p;
  if (b.average_state != nullptr) update = primal_average<T>(b, i, update);
  if (b.param_out != nullptr) {
    b.param_out[i] = b.param[i] + update;
  } else {
    b.update_out[i] = s.output_updated_param ? b.param[i] + update : update;
  }
}

/// Whether chain_direction reads Ḡ: not for a grafted or a matrix-preconditioned direction.
template <typename T>
SHAMPOO_HOST_DEVICE bool direction_reads_filtered(const ChainBlock<T>& b) {
  switch (static_cast<DirectionMode>(b.s.direction_mode)) {
    case DirectionMode::kGraftNorm:
      return false;
    case DirectionMode::kPreconditioned:
      return b.preconditioned == nullptr;
    default:
      return true;
  }
}

/// Post pass for element i: reads Ḡ from filtered_out where the direction needs it.
template <typename T>
SHAMPOO_HOST_DEVICE void chain_post_element(const ChainBlock<T>& b, int64_t i) {
  chain_apply_element(b, i, direction_reads_filtered(b) ? b.filtered_out[i] : T(0));
}

/// Fused pass for element i: both halves, Ḡ never stored (filtered_out may be null).
template <typename T>
SHAMPOO_HOST_DEVICE void chain_fused_element(const ChainBlock<T>& b, int64_t i) {
  chain_apply_element(b, i, chain_filter_element(b, i));
}

/// Grafting ratio from the two squared norms (docs/math.md step 5).
SHAMPOO_HOST_DEVICE double graft_ratio(double preconditioned_sq, double graft_sq) {
  using std::sqrt;
  return sqrt(graft_sq) / (sqrt(preconditioned_sq) + 1e-16);
}

/// Loops over a range of one block's elements, one element at a time: the formulas as written
/// (the CPU launcher runs the tiled loops of elementwise_chain_cpu.h instead, which tests check
/// against these). The launcher splits blocks into chunks of kChainChunk elements and runs chunks
/// in parallel; norms are summed per chunk and combined in chunk order, so results do not depend
/// on the number of threads.
inline constexpr int64_t kChainChunk = 1 << 14;

template <typename T>
void chain_pre_range(const ChainBlock<T>& b, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) chain_pre_element(b, i);
}
/// The norm pass over a range adds its squares in kNormLanes interleaved partial sums (lane k
/// takes elements begin + k, begin + k + kNormLanes, ...), then adds the lanes to the totals in
/// lane order: a fixed order, so the CPU loops can add eight elements at once (one chain of
/// dependent additions per element took ~14 ms for 4.2M elements on one thread).
inline constexpr int64_t kNormLanes = 8;

template <typename T>
void chain_norm_range(const ChainBlock<T>& b, int64_t begin, int64_t end, double& p_sq,
                      double& g_sq) {
  double p_lanes[kNormLanes] = {};
  double g_lanes[kNormLanes] = {};
  for (int64_t i = begin; i < end; ++i) {
    const int64_t lane = (i - begin) % kNormLanes;
    chain_norm_element(b, i, p_lanes[lane], g_lanes[lane]);
  }
  for (int64_t k = 0; k < kNormLanes; ++k) {
    p_sq += p_lanes[k];
    g_sq += g_lanes[k];
  }
}
template <typename T>
void chain_post_range(const ChainBlock<T>& b, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) chain_post_element(b, i);
}
template <typename T>
void chain_fused_range(const ChainBlock<T>& b, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) chain_fused_element(b, i);
}

}  // namespace shampoo::kernels
