#include "python/src/options_from_python.h"

#include <torch/csrc/utils/pybind.h>

#include <map>
#include <string>
#include <vector>

namespace py = pybind11;

namespace shampoo::python {
namespace {

/// d[key] converted to T; an error naming the key when it is missing or of another type.
template <typename T>
T get(const py::dict& d, const char* key) {
  TORCH_CHECK(d.contains(key), "distributed_shampoo_cpp: option '", key, "' is missing");
  try {
    return d[key].cast<T>();
  } catch (const py::cast_error&) {
    TORCH_CHECK(false, "distributed_shampoo_cpp: option '", key,
                "' has the wrong type: ", std::string(py::str(d[key])));
  }
}

py::dict get_dict(const py::dict& d, const char* key) { return get<py::dict>(d, key); }

c10::ScalarType dtype_from(const std::string& name, const char* key) {
  if (name == "float32") return c10::ScalarType::Float;
  if (name == "float64") return c10::ScalarType::Double;
  if (name == "bfloat16") return c10::ScalarType::BFloat16;
  if (name == "float16") return c10::ScalarType::Half;
  TORCH_CHECK(false, "distributed_shampoo_cpp: option '", key, "': unknown dtype ", name);
}

RankDeficientStabilityConfig rank_deficient_from(const py::dict& d) {
  const auto kind = get<std::string>(d, "kind");
  if (kind == "perturbation") return PerturbationConfig{};
  TORCH_CHECK(kind == "pseudo_inverse", "distributed_shampoo_cpp: unknown rank_deficient kind ",
              kind);
  PseudoInverseConfig config;
  config.rank_atol = get<double>(d, "rank_atol");
  config.rank_rtol = get<double>(d, "rank_rtol");
  return config;
}

RootInvShampooConfig root_inv_from(const py::dict& d) {
  RootInvShampooConfig config;
  const auto solver = get<std::string>(d, "solver");
  const std::map<std::string, RootSolver> solvers{
      {"eigh", RootSolver::kEigh},
      {"coupled_newton", RootSolver::kCoupledNewton},
      {"coupled_higher_order", RootSolver::kCoupledHigherOrder},
      {"newton_schulz", RootSolver::kNewtonSchulz}};
  const auto found = solvers.find(solver);
  TORCH_CHECK(found != solvers.end(), "distributed_shampoo_cpp: unknown root solver ", solver);
  config.solver = found->second;
  if (config.solver == RootSolver::kCoupledHigherOrder) {
    config.order = get<int64_t>(d, "order");
    config.rel_epsilon = get<double>(d, "rel_epsilon");
    config.abs_epsilon = get<double>(d, "abs_epsilon");
  }
  if (config.solver == RootSolver::kNewtonSchulz) {
    config.relative_epsilon = get<double>(d, "relative_epsilon");
    if (d.contains("coefficients")) {
      config.coefficients.clear();
      for (const auto& t : get<std::vector<std::vector<double>>>(d, "coefficients")) {
        TORCH_CHECK(t.size() == 3, "NewtonSchulzRootInvConfig.coefficients: got a triple of ",
                    t.size(), " numbers, expected (a, b, c) for p(x) = a x + b x^3 + c x^5");
        config.coefficients.push_back({t[0], t[1], t[2]});
      }
    }
  }
  config.retry_double_precision = get<bool>(d, "retry_double_precision");
  config.max_iterations = get<int64_t>(d, "max_iterations");
  config.tolerance = get<double>(d, "tolerance");
  config.rank_deficient_stability = rank_deficient_from(get_dict(d, "rank_deficient"));
  return config;
}

EigenbasisMethod eigenbasis_from(const py::dict& d) {
  const auto method = get<std::string>(d, "eigenbasis_method");
  TORCH_CHECK(method == "eigh" || method == "qr",
              "distributed_shampoo_cpp: unknown eigenbasis method ", method);
  return method == "eigh" ? EigenbasisMethod::kEigh : EigenbasisMethod::kQR;
}

EigendecomposedShampooConfig eigendecomposed_from(const py::dict& d) {
  EigendecomposedShampooConfig config;
  config.eigenbasis_method = eigenbasis_from(d);
  config.retry_double_precision = get<bool>(d, "retry_double_precision");
  config.rank_deficient_stability = rank_deficient_from(get_dict(d, "rank_deficient"));
  return config;
}

template <typename Config>
Config moving_average_from(const py::dict& d) {
  Config config;
  config.beta2 = get<double>(d, "beta2");
  config.epsilon = get<double>(d, "epsilon");
  config.drop_weighting_factor_on_gsquare = get<bool>(d, "drop_weighting_factor_on_gsquare");
  return config;
}

/// The diagonal families, as main preconditioner or grafting; nullopt for another kind.
std::optional<GraftingConfig> diagonal_from(const py::dict& d) {
  const auto kind = get<std::string>(d, "kind");
  if (kind == "sgd") return SGDPreconditionerConfig{};
  if (kind == "adagrad") return AdaGradPreconditionerConfig{get<double>(d, "epsilon")};
  if (kind == "rmsprop") return moving_average_from<RMSpropPreconditionerConfig>(d);
  if (kind == "adam") return moving_average_from<AdamPreconditionerConfig>(d);
  return std::nullopt;
}

SpectralDescentConfig spectral_from(const py::dict& d) {
  SpectralDescentConfig config;
  const auto method = get<std::string>(d, "method");
  TORCH_CHECK(method == "newton_schulz" || method == "svd",
              "distributed_shampoo_cpp: unknown orthogonalization ", method);
  config.method =
      method == "svd" ? OrthogonalizationMethod::kSVD : OrthogonalizationMethod::kNewtonSchulz;
  config.num_iterations = get<int64_t>(d, "num_iterations");
  const auto c = get<std::vector<double>>(d, "coefficients");
  TORCH_CHECK(c.size() == 3, "distributed_shampoo_cpp: coefficients need 3 values");
  config.coefficients = {c[0], c[1], c[2]};
  config.scale_by_nuclear_norm = get<bool>(d, "scale_by_nuclear_norm");
  return config;
}

PreconditionerConfig preconditioner_from(const py::dict& d) {
  const auto kind = get<std::string>(d, "kind");
  if (auto diagonal = diagonal_from(d)) {
    return std::visit(
        [](const auto& c) -> PreconditionerConfig {
          if constexpr (std::is_same_v<std::decay_t<decltype(c)>, std::monostate>) {
            return RootInvShampooConfig{};  // not reached: diagonal_from gives a family
          } else {
            return c;
          }
        },
        *diagonal);
  }
  if (kind == "root_inv") return root_inv_from(d);
  if (kind == "root_inv_kl") return RootInvKLShampooConfig{root_inv_from(d)};
  if (kind == "eigendecomposed") return eigendecomposed_from(d);
  if (kind == "eigendecomposed_kl") return EigendecomposedKLShampooConfig{eigendecomposed_from(d)};
  if (kind == "eigenvalue_corrected") {
    return EigenvalueCorrectedShampooConfig{
        eigenbasis_from(d), get<bool>(d, "retry_double_precision"),
        get<std::map<int64_t, std::vector<int64_t>>>(d, "ignored_basis_change_dims")};
  }
  if (kind == "spectral_descent") return spectral_from(d);
  if (kind == "sign_descent") return SignDescentConfig{};
  TORCH_CHECK(false, "distributed_shampoo_cpp: unknown preconditioner kind ", kind);
}

GraftingConfig grafting_from(const py::object& value) {
  if (value.is_none()) return std::monostate{};
  auto grafting = diagonal_from(value.cast<py::dict>());
  TORCH_CHECK(grafting.has_value(), "distributed_shampoo_cpp: unknown grafting kind");
  return *grafting;
}

IterateAveragingConfig averaging_from(const py::object& value) {
  if (value.is_none()) return std::monostate{};
  const auto d = value.cast<py::dict>();
  const auto kind = get<std::string>(d, "kind");
  if (kind == "gpa") {
    return GeneralizedPrimalAveragingConfig{get<double>(d, "eval_interp_coeff"),
                                            get<double>(d, "train_interp_coeff")};
  }
  TORCH_CHECK(kind == "schedule_free", "distributed_shampoo_cpp: unknown averaging ", kind);
  return ScheduleFreeConfig{get<double>(d, "train_interp_coeff"),
                            get<double>(d, "eval_coeff_lr_power")};
}

CompactState compact_from(const std::string& name) {
  if (name == "none") return CompactState::kNone;
  if (name == "bfloat16") return CompactState::kBfloat16;
  TORCH_CHECK(name == "int8", "distributed_shampoo_cpp: unknown compact_state ", name);
  return CompactState::kInt8;
}

/// The fields that are numbers or flags.
void set_scalars(ShampooOptions& o, const py::dict& d) {
  o.betas({get<double>(d, "beta1"), get<double>(d, "beta2")})
      .beta3(get<double>(d, "beta3"))
      .epsilon(get<double>(d, "epsilon"))
      .relative_epsilon(get<double>(d, "relative_epsilon"))
      .weight_decay(get<double>(d, "weight_decay"))
      .momentum(get<double>(d, "momentum"))
      .dampening(get<double>(d, "dampening"))
      .use_nesterov(get<bool>(d, "use_nesterov"))
      .max_preconditioner_dim(get<int64_t>(d, "max_preconditioner_dim"))
      .use_merge_dims(get<bool>(d, "use_merge_dims"))
      .precondition_1d(get<bool>(d, "precondition_1d"))
      .max_factored_dim(get<int64_t>(d, "max_factored_dim"))
      .precondition_frequency(get<int64_t>(d, "precondition_frequency"))
      .start_preconditioning_step(get<int64_t>(d, "start_preconditioning_step"))
      .use_bias_correction(get<bool>(d, "use_bias_correction"))
      .factored_grafting(get<bool>(d, "factored_grafting"))
      .use_symmetric_packing(get<bool>(d, "use_symmetric_packing"))
      .use_trace_scaling(get<bool>(d, "use_trace_scaling"))
      .trace_scaling_exponent(get<double>(d, "trace_scaling_exponent"))
      .num_tolerated_failed_amortized_computations(
          get<int64_t>(d, "num_tolerated_failed_amortized_computations"));
}

}  // namespace

ShampooOptions shampoo_options_from(const py::dict& d) {
  ShampooOptions o(get<double>(d, "lr"));
  set_scalars(o, d);
  const auto decay = get<std::string>(d, "weight_decay_type");
  const std::map<std::string, WeightDecayType> decay_types{
      {"L2", WeightDecayType::kL2},
      {"DECOUPLED", WeightDecayType::kDecoupled},
      {"CORRECTED", WeightDecayType::kCorrected},
      {"INDEPENDENT", WeightDecayType::kIndependent}};
  const auto type = decay_types.find(decay);
  TORCH_CHECK(type != decay_types.end(), "distributed_shampoo_cpp: unknown weight_decay_type ",
              decay);
  o.weight_decay_type(type->second).peak_lr(get<double>(d, "peak_lr"));
  o.factor_matrix_dtype(
      dtype_from(get<std::string>(d, "factor_matrix_dtype"), "factor_matrix_dtype"));
  o.compact_state(compact_from(get<std::string>(d, "compact_state")));
  o.grafting(grafting_from(get<py::object>(d, "grafting")));
  o.preconditioner(preconditioner_from(get_dict(d, "preconditioner")));
  o.iterate_averaging(averaging_from(get<py::object>(d, "iterate_averaging")));
  o.inverse_exponent_override(
      get<std::map<int64_t, std::map<int64_t, double>>>(d, "inverse_exponent_override"));
  return o;
}

DistributedOptions distributed_options_from(const py::dict& d, const py::object& process_group) {
  DistributedOptions o;
  if (!process_group.is_none()) {
    o.process_group(process_group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>());
  }
  o.communication_dtype(
      dtype_from(get<std::string>(d, "communication_dtype"), "communication_dtype"));
  o.num_trainers_per_group(get<int64_t>(d, "num_trainers_per_group"));
  o.communicate_params(get<bool>(d, "communicate_params"));
  o.merge_param_groups(get<bool>(d, "merge_param_groups"));
  return o;
}

}  // namespace shampoo::python
