#pragma once
/// The diagonal families' step coefficients, in one place: the diagonal main preconditioner
/// (DiagonalPreconditionerList) and grafting (the elementwise chain) both read them from
/// `diagonal_coefficients` (docs/math.md, "Diagonal main preconditioners" and step 5). Standard
/// library only.

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <variant>

#include "preconditioners/preconditioner_configs.h"

namespace shampoo::detail {

/// The diagonal families: as the main preconditioner (DiagonalPreconditionerList) and as
/// grafting (the elementwise chain).
using DiagonalConfig = std::variant<SGDPreconditionerConfig, AdaGradPreconditionerConfig,
                                    RMSpropPreconditionerConfig, AdamPreconditionerConfig>;

/// Coefficients of V ← beta2·V + weight·G′² and P = Ḡ / (sqrt(V / bias_correction2) + epsilon)
/// at step t (from 1). Without statistics (SGD) P = Ḡ.
struct DiagonalCoefficients {
  bool has_state = false;
  double beta2 = 1.0;
  double weight = 1.0;
  double bias_correction2 = 1.0;
  double epsilon = 0.0;
};

/// The one place the diagonal coefficients are computed (docs/math.md, "Diagonal main
/// preconditioners" and step 5). RMSprop and Adam: weight 1 − beta2, or 1 with
/// drop_weighting_factor_on_gsquare, which also drops the bias correction; Adam's bias
/// correction 1 − beta2^t applies when beta2 < 1.
inline DiagonalCoefficients diagonal_coefficients(const DiagonalConfig& config, int64_t step) {
  return std::visit(
      [step](const auto& c) {
        using C = Plain<decltype(c)>;
        DiagonalCoefficients out;
        if constexpr (!std::is_same_v<C, SGDPreconditionerConfig>) {
          out.has_state = true;
          out.epsilon = c.epsilon;
        }
        if constexpr (requires { c.beta2; }) {
          out.beta2 = c.beta2;
          out.weight = c.drop_weighting_factor_on_gsquare ? 1.0 : 1.0 - c.beta2;
          if constexpr (C::kAdam) {
            if (!c.drop_weighting_factor_on_gsquare && c.beta2 < 1.0) {
              out.bias_correction2 = 1.0 - std::pow(c.beta2, static_cast<double>(step));
            }
          }
        }
        return out;
      },
      config);
}

}  // namespace shampoo::detail
