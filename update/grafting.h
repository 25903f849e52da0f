#pragma once
/// Grafting methods: the diagonal methods (SGD, AdaGrad, RMSprop, Adam) whose per-block step size
/// the Shampoo direction takes (docs/math.md, step 5), and which run alone until
/// `start_preconditioning_step`. Everything that depends on the method is here: its public config
/// (an alternative of GraftingConfig), its kind (the alternative's index, also its checkpoint
/// code) and one row of the method table (name, whether it keeps statistics V, the coefficients
/// of V and of the graft direction). Options, merging, checkpoints and the elementwise chain read
/// this file; adding a method is a config struct here and a row in grafting.cpp.
///
/// Plain C++ (no LibTorch), so the kernel layer may include it too.

#include <cstdint>
#include <utility>
#include <variant>

#include "update/elementwise_chain_kernels.h"

namespace shampoo {

/// SGD grafting: P_graft = Ḡ.
struct SGDGraftingConfig {
  bool operator==(const SGDGraftingConfig&) const = default;
};
/// AdaGrad grafting: V += G², P_graft = Ḡ / (sqrt(V) + epsilon).
struct AdaGradGraftingConfig {
  double epsilon = 1e-10;
  bool operator==(const AdaGradGraftingConfig&) const = default;
};
/// RMSprop grafting: V = beta2·V + (1 − beta2)·G², P_graft = Ḡ / (sqrt(V) + epsilon).
struct RMSpropGraftingConfig {
  double beta2 = 0.99;
  double epsilon = 1e-10;
  bool operator==(const RMSpropGraftingConfig&) const = default;
};
/// Adam grafting: as RMSprop with the bias correction 1 − beta2^t (always on).
struct AdamGraftingConfig {
  double beta2 = 0.999;
  double epsilon = 1e-10;
  bool operator==(const AdamGraftingConfig&) const = default;
};
/// std::monostate = no grafting. The order of the alternatives is the GraftingKind and the code
/// written to checkpoints: append new methods at the end.
using GraftingConfig = std::variant<std::monostate, SGDGraftingConfig, AdaGradGraftingConfig,
                                    RMSpropGraftingConfig, AdamGraftingConfig>;

}  // namespace shampoo

namespace shampoo::detail {

/// The grafting method of a config: the index of its GraftingConfig alternative.
enum class GraftingKind : int32_t { kNone = 0, kSGD = 1, kAdaGrad = 2, kRMSprop = 3, kAdam = 4 };
inline constexpr int64_t kGraftingKinds = static_cast<int64_t>(std::variant_size_v<GraftingConfig>);
static_assert(kGraftingKinds == static_cast<int64_t>(GraftingKind::kAdam) + 1,
              "one GraftingKind per GraftingConfig alternative");

/// The float hyperparameters of a config: beta2 and epsilon where its method has them, else 0.
struct GraftingFloats {
  double beta2 = 0.0;
  double epsilon = 0.0;
  bool operator==(const GraftingFloats&) const = default;
};

/// Coefficients of V ← beta2·V + weight·G'² and P_graft = Ḡ / (sqrt(V / bias_correction2) +
/// epsilon) at step t (from 1). A method without statistics has P_graft = Ḡ.
struct GraftingCoefficients {
  double beta2 = 1.0;
  double weight = 1.0;
  double bias_correction2 = 1.0;
  double epsilon = 0.0;
};

/// One row of the method table.
struct GraftingMethod {
  GraftingKind kind;
  const char* name;  ///< in messages and option descriptions
  bool has_state;    ///< keeps statistics V (one value per parameter element)
  GraftingCoefficients (*coefficients)(const GraftingFloats& floats, int64_t step);
};

const GraftingMethod& grafting_method(GraftingKind kind);
/// Checked conversion of a checkpoint code (an error naming the value and the range).
GraftingKind grafting_kind_from_code(int64_t code);

inline GraftingKind grafting_kind(const GraftingConfig& config) {
  return static_cast<GraftingKind>(config.index());
}
/// The config of `kind` with its default values.
GraftingConfig default_grafting(GraftingKind kind);
GraftingFloats grafting_floats(const GraftingConfig& config);
/// The config with its kind kept and the values its method has set from `floats`.
GraftingConfig with_grafting_floats(GraftingConfig config, const GraftingFloats& floats);

/// Checks the values of a config (an error naming the method, the field, the value and the range):
/// epsilon > 0 and beta2 in (0, 1] for the methods that have them.
void check_grafting(const GraftingConfig& config);

/// Writes the grafting fields of the chain scalars of one block at step t.
void fill_chain_scalars(const GraftingConfig& config, int64_t step, kernels::ChainScalars& scalars);

}  // namespace shampoo::detail
