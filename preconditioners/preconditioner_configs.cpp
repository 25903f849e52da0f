#include "preconditioners/preconditioner_configs.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace shampoo {

const RootInvShampooConfig* root_inverse_config(const PreconditionerConfig& config) {
  if (const auto* c = std::get_if<RootInvShampooConfig>(&config)) return c;
  return std::get_if<RootInvKLShampooConfig>(&config);
}

std::vector<std::array<double, 3>> default_newton_schulz_coefficients() {
  // The reference's defaults (NewtonSchulzRootInvConfig in its matrix_functions_types.py).
  return {{8.28721201814563, -23.595886519098837, 17.300387312530933},
          {4.107059111542203, -2.9478499167379106, 0.5448431082926601},
          {3.9486908534822946, -2.9089021159629490, 0.5518191394370137},
          {3.3184196573706015, -2.4884880243148740, 0.5100489401237200},
          {2.300652019954817, -1.6689039845747493, 0.4188073119525673},
          {1.891301407787398, -1.2679958271945868, 0.3768040894852483},
          {1.8750014808534479, -1.2500016453999487, 0.3750001645474248},
          {1.875, -1.25, 0.375},
          {1.875, -1.25, 0.375},
          {1.875, -1.25, 0.375}};
}

const EigendecomposedShampooConfig* eigendecomposed_config(const PreconditionerConfig& config) {
  if (const auto* c = std::get_if<EigendecomposedShampooConfig>(&config)) return c;
  return std::get_if<EigendecomposedKLShampooConfig>(&config);
}

const RankDeficientStabilityConfig* rank_deficient_stability(const PreconditionerConfig& config) {
  return std::visit(
      [](const auto& c) -> const RankDeficientStabilityConfig* {
        if constexpr (requires { c.rank_deficient_stability; }) {
          return &c.rank_deficient_stability;
        } else {
          return nullptr;
        }
      },
      config);
}

bool uses_pseudo_inverse(const PreconditionerConfig& config) {
  const auto* stability = rank_deficient_stability(config);
  return stability != nullptr && std::holds_alternative<PseudoInverseConfig>(*stability);
}

}  // namespace shampoo

namespace shampoo::detail {
namespace {

/// An enum member must be one of its enumerators (a value cast from an int may not be).
template <typename E>
void check_enumerator(E value, const std::string& where, const char* field, const char* config) {
  const auto names = enumerator_names(value);
  const auto v = static_cast<int64_t>(value);
  if (v >= 0 && v < static_cast<int64_t>(names.size())) return;
  std::string expected;
  for (size_t i = 0; i < names.size(); ++i) {
    expected += i == 0 ? "" : (i + 1 == names.size() ? " or " : ", ");
    expected += names[i];
  }
  TORCH_CHECK(false, where, ".", field, ": got ", v, ", expected ", expected, " (", config, ")");
}

void check_positive(double value, const std::string& where, const char* field, const char* config) {
  TORCH_CHECK(std::isfinite(value) && value > 0.0, where, ".", field, ": got ", value,
              ", expected > 0 (", config, ")");
}

void check_beta2(double beta2, const std::string& where, const char* config) {
  TORCH_CHECK(std::isfinite(beta2) && beta2 > 0.0 && beta2 <= 1.0, where, ".beta2: got ", beta2,
              ", expected a value in (0, 1] (", config, ")");
}

/// The pseudo-inverse thresholds (the perturbation has none).
void check_stability(const RankDeficientStabilityConfig& stability, const std::string& where) {
  TORCH_CHECK(!stability.valueless_by_exception(), where, ".rank_deficient_stability: no value");
  const auto* c = std::get_if<PseudoInverseConfig>(&stability);
  if (c == nullptr) return;
  TORCH_CHECK(std::isfinite(c->rank_atol) && c->rank_atol >= 0.0, where,
              ".rank_deficient_stability.rank_atol: got ", c->rank_atol,
              ", expected rank_atol >= 0");
  TORCH_CHECK(
      c->rank_rtol == kDtypeRankRtol || (std::isfinite(c->rank_rtol) && c->rank_rtol >= 0.0), where,
      ".rank_deficient_stability.rank_rtol: got ", c->rank_rtol,
      ", expected rank_rtol >= 0 or kDtypeRankRtol (-1)");
}

/// kNewtonSchulz's fields, as the reference's NewtonSchulzRootInvConfig checks them (and
/// relative_epsilon's range; its warning about the last triple is the engine's, once per group).
void check_newton_schulz(const RootInvShampooConfig& c, const std::string& where) {
  TORCH_CHECK(std::isfinite(c.relative_epsilon) && c.relative_epsilon >= 0.0, where,
              ".relative_epsilon: got ", c.relative_epsilon, ", expected a finite value >= 0");
  TORCH_CHECK(!c.coefficients.empty(), where,
              ".coefficients: empty, expected one (a, b, c) per Newton–Schulz iteration");
  for (size_t i = 0; i < c.coefficients.size(); ++i) {
    const auto& [a, b, k] = c.coefficients[i];
    TORCH_CHECK(std::isfinite(a) && std::isfinite(b) && std::isfinite(k), where, ".coefficients[",
                i, "]: got (", a, ", ", b, ", ", k, "), expected finite numbers");
  }
}

}  // namespace

void check_config(const RootInvShampooConfig& c, const std::string& where) {
  constexpr const char* kConfig = "RootInvShampooConfig";
  check_enumerator(c.solver, where, "solver", kConfig);
  check_stability(c.rank_deficient_stability, where);
  if (c.solver == RootSolver::kEigh) return;
  TORCH_CHECK(c.max_iterations >= 1, where, ".max_iterations: got ", c.max_iterations,
              ", expected >= 1");
  TORCH_CHECK(std::isfinite(c.tolerance) && c.tolerance > 0.0, where, ".tolerance: got ",
              c.tolerance, ", expected > 0");
  if (c.solver == RootSolver::kCoupledHigherOrder) {
    TORCH_CHECK(c.order >= 2, where, ".order: got ", c.order,
                ", expected >= 2 (2 is Newton's method) with kCoupledHigherOrder");
    TORCH_CHECK(std::isfinite(c.rel_epsilon) && c.rel_epsilon >= 0.0, where, ".rel_epsilon: got ",
                c.rel_epsilon, ", expected a finite value >= 0");
    TORCH_CHECK(std::isfinite(c.abs_epsilon) && c.abs_epsilon >= 0.0, where, ".abs_epsilon: got ",
                c.abs_epsilon, ", expected a finite value >= 0");
  }
  if (c.solver == RootSolver::kNewtonSchulz) check_newton_schulz(c, where);
  TORCH_CHECK(std::holds_alternative<PerturbationConfig>(c.rank_deficient_stability), where,
              ".rank_deficient_stability: PseudoInverseConfig needs solver kEigh, got ",
              enumerator_names(c.solver)[static_cast<size_t>(c.solver)],
              " (an iterative solver cannot drop eigenvalues)");
}

void check_config(const EigendecomposedShampooConfig& c, const std::string& where) {
  check_enumerator(c.eigenbasis_method, where, "eigenbasis_method", "EigendecomposedShampooConfig");
  check_stability(c.rank_deficient_stability, where);
}

void check_config(const EigenvalueCorrectedShampooConfig& c, const std::string& where) {
  check_enumerator(c.eigenbasis_method, where, "eigenbasis_method",
                   "EigenvalueCorrectedShampooConfig");
  for (const auto& [order, dims] : c.ignored_basis_change_dims) {
    TORCH_CHECK(order >= 0, where, ".ignored_basis_change_dims: order ", order,
                " is not a block order (expected >= 0)");
    std::vector<int64_t> seen;
    for (const int64_t dim : dims) {
      TORCH_CHECK(dim >= 0 && dim <= std::max<int64_t>(order - 1, 0), where,
                  ".ignored_basis_change_dims[", order, "]: dim ", dim,
                  " out of range (expected 0..", std::max<int64_t>(order - 1, 0), ")");
      TORCH_CHECK(std::find(seen.begin(), seen.end(), dim) == seen.end(), where,
                  ".ignored_basis_change_dims[", order, "]: dim ", dim,
                  " is listed twice (expected distinct dims)");
      seen.push_back(dim);
    }
  }
}

void check_config(const SpectralDescentConfig& c, const std::string& where) {
  constexpr const char* kConfig = "SpectralDescentConfig";
  check_enumerator(c.method, where, "method", kConfig);
  TORCH_CHECK(c.num_iterations >= 1, where, ".num_iterations: got ", c.num_iterations,
              ", expected >= 1 (", kConfig, ")");
  for (size_t i = 0; i < c.coefficients.size(); ++i) {
    TORCH_CHECK(std::isfinite(c.coefficients[i]), where, ".coefficients[", i, "]: got ",
                c.coefficients[i], ", expected a finite value (", kConfig, ")");
  }
  TORCH_CHECK(!c.scale_by_nuclear_norm || c.method == OrthogonalizationMethod::kSVD, where,
              ".scale_by_nuclear_norm: got true with method kNewtonSchulz, expected false (the "
              "nuclear norm comes from the SVD: use method kSVD) (",
              kConfig, ")");
  check_enumerator(c.scale, where, "scale", kConfig);
}

void check_config(const SignDescentConfig& c, const std::string& where) {
  check_enumerator(c.scale, where, "scale", "SignDescentConfig");
}

void check_config(const SGDPreconditionerConfig& /*c*/, const std::string& /*where*/) {}

void check_config(const AdaGradPreconditionerConfig& c, const std::string& where) {
  check_positive(c.epsilon, where, "epsilon", "AdaGradPreconditionerConfig");
}

template <bool kAdam>
void check_config(const MovingAveragePreconditionerConfig<kAdam>& c, const std::string& where) {
  const char* config = kAdam ? "AdamPreconditionerConfig" : "RMSpropPreconditionerConfig";
  check_positive(c.epsilon, where, "epsilon", config);
  check_beta2(c.beta2, where, config);
}
template void check_config(const RMSpropPreconditionerConfig&, const std::string&);
template void check_config(const AdamPreconditionerConfig&, const std::string&);

}  // namespace shampoo::detail
