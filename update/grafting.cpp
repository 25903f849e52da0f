#include "update/grafting.h"

#include <c10/util/Exception.h>

#include <array>
#include <cmath>

namespace shampoo::detail {
namespace {

GraftingCoefficients stateless(const GraftingFloats&, int64_t) { return {}; }

GraftingCoefficients adagrad(const GraftingFloats& f, int64_t) {
  GraftingCoefficients c;  // V += G²
  c.epsilon = f.epsilon;
  return c;
}

GraftingCoefficients rmsprop(const GraftingFloats& f, int64_t) {
  GraftingCoefficients c;
  c.beta2 = f.beta2;
  c.weight = 1.0 - f.beta2;
  c.epsilon = f.epsilon;
  return c;
}

GraftingCoefficients adam(const GraftingFloats& f, int64_t step) {
  auto c = rmsprop(f, step);
  c.bias_correction2 = 1.0 - std::pow(f.beta2, static_cast<double>(step));
  return c;
}

// One row per GraftingKind, in its order.
constexpr std::array<GraftingMethod, kGraftingKinds> kMethods{{
    {GraftingKind::kNone, "none", false, stateless},
    {GraftingKind::kSGD, "SGD", false, stateless},
    {GraftingKind::kAdaGrad, "AdaGrad", true, adagrad},
    {GraftingKind::kRMSprop, "RMSprop", true, rmsprop},
    {GraftingKind::kAdam, "Adam", true, adam},
}};

template <size_t... I>
std::array<GraftingConfig, sizeof...(I)> default_configs(std::index_sequence<I...>) {
  return {GraftingConfig(std::in_place_index<I>)...};
}

}  // namespace

const GraftingMethod& grafting_method(GraftingKind kind) {
  const auto& method = kMethods.at(static_cast<size_t>(kind));
  TORCH_INTERNAL_ASSERT(method.kind == kind, "grafting table out of order");
  return method;
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
  const char* name = grafting_method(grafting_kind(config)).name;
  std::visit(
      [name](const auto& g) {
        if constexpr (requires { g.epsilon; }) {
          TORCH_CHECK(g.epsilon > 0.0, "ShampooOptions.grafting (", name, ").epsilon: got ",
                      g.epsilon, ", expected > 0");
        }
        if constexpr (requires { g.beta2; }) {
          TORCH_CHECK(g.beta2 > 0.0 && g.beta2 <= 1.0, "ShampooOptions.grafting (", name,
                      ").beta2: got ", g.beta2, ", expected a value in (0, 1]");
        }
      },
      config);
}

void fill_chain_scalars(const GraftingConfig& config, int64_t step, kernels::ChainScalars& s) {
  const auto c = grafting_method(grafting_kind(config)).coefficients(grafting_floats(config), step);
  s.diagonal_beta2 = c.beta2;
  s.diagonal_weight = c.weight;
  s.diagonal_bias_correction = c.bias_correction2;
  s.diagonal_epsilon = c.epsilon;
}

}  // namespace shampoo::detail
