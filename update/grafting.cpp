#include "update/grafting.h"

#include <c10/util/Exception.h>

#include <array>
#include <cmath>
#include <string>

namespace shampoo::detail {
namespace {

// The name of each GraftingKind, in its order.
constexpr std::array<const char*, kGraftingKinds> kNames{"none", "SGD", "AdaGrad", "RMSprop",
                                                         "Adam"};

template <size_t... I>
std::array<GraftingConfig, sizeof...(I)> default_configs(std::index_sequence<I...>) {
  return {GraftingConfig(std::in_place_index<I>)...};
}

}  // namespace

// Whether a method keeps statistics is its diagonal family's fact (diagonal_coefficients), read
// once per kind.
const GraftingMethod& grafting_method(GraftingKind kind) {
  static const auto methods = [] {
    std::array<GraftingMethod, kGraftingKinds> table{};
    for (size_t k = 0; k < table.size(); ++k) {
      const auto family = grafting_family(default_grafting(static_cast<GraftingKind>(k)));
      table[k] = {static_cast<GraftingKind>(k), kNames[k],
                  family && diagonal_coefficients(*family, 1).has_state};
    }
    return table;
  }();
  return methods.at(static_cast<size_t>(kind));
}

GraftingKind grafting_kind_from_code(int64_t code) {
  TORCH_CHECK(code >= 0 && code < kGraftingKinds, "grafting kind: code ", code,
              " is out of range (0..", kGraftingKinds - 1, ")");
  return static_cast<GraftingKind>(code);
}

GraftingConfig default_grafting(GraftingKind kind) {
  static const auto configs = default_configs(std::make_index_sequence<kGraftingKinds>());
  return configs.at(static_cast<size_t>(kind));
}

GraftingFloats grafting_floats(const GraftingConfig& config) {
  return std::visit(
      [](const auto& g) {
        GraftingFloats f;
        if constexpr (requires { g.beta2; }) f.beta2 = g.beta2;
        if constexpr (requires { g.epsilon; }) f.epsilon = g.epsilon;
        return f;
      },
      config);
}

GraftingConfig with_grafting_floats(GraftingConfig config, const GraftingFloats& floats) {
  std::visit(
      [&](auto& g) {
        if constexpr (requires { g.beta2; }) g.beta2 = floats.beta2;
        if constexpr (requires { g.epsilon; }) g.epsilon = floats.epsilon;
      },
      config);
  return config;
}

void check_grafting(const GraftingConfig& config) {
  const auto family = grafting_family(config);
  if (!family) return;
  const std::string where =
      std::string("ShampooOptions.grafting (") + grafting_method(grafting_kind(config)).name + ")";
  std::visit([&](const auto& c) { check_config(c, where); }, *family);
}

std::optional<DiagonalConfig> grafting_family(const GraftingConfig& config) {
  return std::visit(
      [](const auto& c) -> std::optional<DiagonalConfig> {
        if constexpr (std::is_same_v<Plain<decltype(c)>, std::monostate>) {
          return std::nullopt;
        } else {
          return DiagonalConfig(c);
        }
      },
      config);
}

void fill_chain_scalars(const GraftingConfig& config, int64_t step, kernels::ChainScalars& s) {
  const auto family = grafting_family(config);
  fill_diagonal_scalars(family ? diagonal_coefficients(*family, step) : DiagonalCoefficients{}, s);
}

void fill_diagonal_scalars(const DiagonalCoefficients& c, kernels::ChainScalars& s) {
  s.diagonal_beta2 = c.beta2;
  s.diagonal_weight = c.weight;
  s.diagonal_bias_correction = c.bias_correction2;
  s.diagonal_epsilon = c.epsilon;
}

}  // namespace shampoo::detail
