#pragma once
/// Grafting methods: the diagonal families (SGD, AdaGrad, RMSprop, Adam) whose per-block step size
/// the Shampoo direction takes (docs/math.md, step 5), and which run alone until
/// `start_preconditioning_step`. Their configs are the diagonal preconditioner configs
/// (preconditioners/preconditioner_configs.h: GraftingConfig) and their coefficients are
/// diagonal_coefficients, shared with the diagonal list. Here: the kind (the alternative's index,
/// also its checkpoint code), one row per kind (name, whether it keeps statistics V), and what
/// options, merging, checkpoints and the elementwise chain read of it.
///
/// Plain C++ (no LibTorch), so the kernel layer may include it too.

#include <cstdint>
#include <optional>
#include <utility>
#include <variant>

#include "preconditioners/diagonal_coefficients.h"
#include "preconditioners/preconditioner_configs.h"
#include "update/elementwise_chain_kernels.h"

namespace shampoo::detail {

/// The grafting method of a config: the index of its GraftingConfig alternative.
enum class GraftingKind : int32_t { kNone = 0, kSGD = 1, kAdaGrad = 2, kRMSprop = 3, kAdam = 4 };
inline constexpr int64_t kGraftingKinds = static_cast<int64_t>(std::variant_size_v<GraftingConfig>);
static_assert(kGraftingKinds == static_cast<int64_t>(GraftingKind::kAdam) + 1,
              "one GraftingKind per GraftingConfig alternative");

/// The float hyperparameters of a config: beta2 and epsilon where its method has them, else 0
/// (drop_weighting_factor_on_gsquare is structural, part of the kind's row).
struct GraftingFloats {
  double beta2 = 0.0;
  double epsilon = 0.0;
  bool operator==(const GraftingFloats&) const = default;
};

/// One row of the method table.
struct GraftingMethod {
  GraftingKind kind;
  const char* name;  ///< in messages and option descriptions
  bool has_state;    ///< keeps statistics V (one value per parameter element)
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

/// Checks the values of a config with its family's check_config (an error naming the method, the
/// field, the value and the range).
void check_grafting(const GraftingConfig& config);

/// The diagonal family of a grafting config; nullopt for std::monostate (no grafting).
std::optional<DiagonalConfig> grafting_family(const GraftingConfig& config);

/// Writes the diagonal fields of the chain scalars (β2, weight, bias correction, ε) from a
/// diagonal family's coefficients: grafting's, or a diagonal main preconditioner's in the fused
/// pass.
void fill_diagonal_scalars(const DiagonalCoefficients& coefficients,
                           kernels::ChainScalars& scalars);

/// Writes the grafting fields of the chain scalars of one block at step t.
void fill_chain_scalars(const GraftingConfig& config, int64_t step, kernels::ChainScalars& scalars);

}  // namespace shampoo::detail
