#include "shampoo/shampoo_options.h"

#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <cmath>
#include <sstream>

namespace shampoo {
namespace {

void check_unit_interval(double value, const char* field, bool allow_one) {
  const bool ok = std::isfinite(value) && value >= 0.0 && (allow_one ? value <= 1.0 : value < 1.0);
  TORCH_CHECK(ok, "ShampooOptions.", field, ": got ", value, ", expected a value in [0, ",
              allow_one ? "1]" : "1)");
}

void check_grafting(const GraftingConfig& grafting) {
  std::visit(
      [](const auto& g) {
        using G = std::decay_t<decltype(g)>;
        if constexpr (std::is_same_v<G, AdaGradGraftingConfig>) {
          TORCH_CHECK(g.epsilon > 0.0, "ShampooOptions.grafting (AdaGrad).epsilon: got ", g.epsilon,
                      ", expected > 0");
        } else if constexpr (std::is_same_v<G, RMSpropGraftingConfig> ||
                             std::is_same_v<G, AdamGraftingConfig>) {
          const char* name = std::is_same_v<G, AdamGraftingConfig> ? "Adam" : "RMSprop";
          TORCH_CHECK(g.epsilon > 0.0, "ShampooOptions.grafting (", name, ").epsilon: got ",
                      g.epsilon, ", expected > 0");
          TORCH_CHECK(g.beta2 > 0.0 && g.beta2 <= 1.0, "ShampooOptions.grafting (", name,
                      ").beta2: got ", g.beta2, ", expected a value in (0, 1]");
        }
      },
      grafting);
}

}  // namespace

double ShampooOptions::resolved_beta3() const {
  return beta3() == -1.0 ? std::get<0>(betas()) : beta3();
}

int64_t ShampooOptions::resolved_start_preconditioning_step() const {
  return start_preconditioning_step() == -1 ? precondition_frequency()
                                            : start_preconditioning_step();
}

void ShampooOptions::validate() const {
  TORCH_CHECK(std::isfinite(lr()) && lr() >= 0.0, "ShampooOptions.lr: got ", lr(),
              ", expected lr >= 0");
  const auto [beta1, beta2] = betas();
  check_unit_interval(beta1, "betas[0] (beta1)", /*allow_one=*/false);
  TORCH_CHECK(std::isfinite(beta2) && beta2 > 0.0 && beta2 <= 1.0,
              "ShampooOptions.betas[1] (beta2): got ", beta2, ", expected a value in (0, 1]");
  TORCH_CHECK(beta3() == -1.0 || (std::isfinite(beta3()) && beta3() >= 0.0 && beta3() < 1.0),
              "ShampooOptions.beta3: got ", beta3(),
              ", expected -1 (= beta1) or a value in [0, 1)");
  TORCH_CHECK(std::isfinite(epsilon()) && epsilon() > 0.0, "ShampooOptions.epsilon: got ",
              epsilon(), ", expected epsilon > 0");
  TORCH_CHECK(std::isfinite(weight_decay()) && weight_decay() >= 0.0,
              "ShampooOptions.weight_decay: got ", weight_decay(), ", expected weight_decay >= 0");
  check_unit_interval(momentum(), "momentum", /*allow_one=*/false);
  check_unit_interval(dampening(), "dampening", /*allow_one=*/true);
  TORCH_CHECK(max_preconditioner_dim() >= 1, "ShampooOptions.max_preconditioner_dim: got ",
              max_preconditioner_dim(), ", expected >= 1");
  TORCH_CHECK(precondition_frequency() >= 1, "ShampooOptions.precondition_frequency: got ",
              precondition_frequency(), ", expected >= 1");
  TORCH_CHECK(start_preconditioning_step() >= -1, "ShampooOptions.start_preconditioning_step: got ",
              start_preconditioning_step(),
              ", expected -1 (= precondition_frequency), a step >= 0, or "
              "kNeverStartPreconditioning");
  TORCH_CHECK(num_tolerated_failed_amortized_computations() >= 0,
              "ShampooOptions.num_tolerated_failed_amortized_computations: got ",
              num_tolerated_failed_amortized_computations(), ", expected >= 0");
  TORCH_CHECK(factor_matrix_dtype() == c10::ScalarType::Float ||
                  factor_matrix_dtype() == c10::ScalarType::Double,
              "ShampooOptions.factor_matrix_dtype: got ", factor_matrix_dtype(),
              ", expected Float or Double");
  check_grafting(grafting());
  for (const auto& [order, dims] : inverse_exponent_override()) {
    TORCH_CHECK(order >= 1, "ShampooOptions.inverse_exponent_override: order ", order,
                " is not a block order (expected >= 1)");
    for (const auto& [dim, exponent] : dims) {
      TORCH_CHECK(dim == kAllDims || (dim >= 0 && dim < order),
                  "ShampooOptions.inverse_exponent_override[", order, "]: dim ", dim,
                  " out of range (expected kAllDims or 0..", order - 1, ")");
      TORCH_CHECK(std::isfinite(exponent) && exponent >= 0.0,
                  "ShampooOptions.inverse_exponent_override[", order, "][", dim, "]: got ",
                  exponent, ", expected an exponent >= 0 (0 = dim not preconditioned)");
    }
  }
}

bool structurally_equal(const ShampooOptions& a, const ShampooOptions& b) {
  auto grafting_kind = [](const GraftingConfig& g) { return g.index(); };
  return a.weight_decay_type() == b.weight_decay_type() && a.use_nesterov() == b.use_nesterov() &&
         a.max_preconditioner_dim() == b.max_preconditioner_dim() &&
         a.use_merge_dims() == b.use_merge_dims() &&
         a.precondition_frequency() == b.precondition_frequency() &&
         a.resolved_start_preconditioning_step() == b.resolved_start_preconditioning_step() &&
         a.use_bias_correction() == b.use_bias_correction() &&
         grafting_kind(a.grafting()) == grafting_kind(b.grafting()) &&
         a.factor_matrix_dtype() == b.factor_matrix_dtype() &&
         a.preconditioner() == b.preconditioner() &&
         a.inverse_exponent_override() == b.inverse_exponent_override() &&
         a.num_tolerated_failed_amortized_computations() ==
             b.num_tolerated_failed_amortized_computations();
}

namespace {

// Float hyperparameters travel in checkpoints (a scheduler may have changed lr); structural ones
// are written too, so a load into an optimizer with other structure is refused with a message.
void write_double(torch::serialize::OutputArchive& a, const std::string& key, double v) {
  a.write(key, c10::IValue(v));
}
void write_int(torch::serialize::OutputArchive& a, const std::string& key, int64_t v) {
  a.write(key, c10::IValue(v));
}
double read_double(torch::serialize::InputArchive& a, const std::string& key) {
  c10::IValue v;
  a.read(key, v);
  return v.toDouble();
}
int64_t read_int(torch::serialize::InputArchive& a, const std::string& key) {
  c10::IValue v;
  a.read(key, v);
  return v.toInt();
}

std::pair<int64_t, std::pair<double, double>> grafting_fields(const GraftingConfig& g) {
  return std::visit(
      [&](const auto& c) -> std::pair<int64_t, std::pair<double, double>> {
        using G = std::decay_t<decltype(c)>;
        if constexpr (std::is_same_v<G, AdaGradGraftingConfig>) {
          return {static_cast<int64_t>(g.index()), {1.0, c.epsilon}};
        } else if constexpr (std::is_same_v<G, RMSpropGraftingConfig> ||
                             std::is_same_v<G, AdamGraftingConfig>) {
          return {static_cast<int64_t>(g.index()), {c.beta2, c.epsilon}};
        } else {
          return {static_cast<int64_t>(g.index()), {0.0, 0.0}};
        }
      },
      g);
}

GraftingConfig make_grafting(int64_t kind, double beta2, double epsilon) {
  switch (kind) {
    case 1:
      return SGDGraftingConfig{};
    case 2:
      return AdaGradGraftingConfig{epsilon};
    case 3:
      return RMSpropGraftingConfig{beta2, epsilon};
    case 4:
      return AdamGraftingConfig{beta2, epsilon};
    default:
      return std::monostate{};
  }
}

}  // namespace

void ShampooOptions::serialize(torch::serialize::OutputArchive& archive) const {
  write_double(archive, "lr", lr());
  write_double(archive, "beta1", std::get<0>(betas()));
  write_double(archive, "beta2", std::get<1>(betas()));
  write_double(archive, "beta3", beta3());
  write_double(archive, "epsilon", epsilon());
  write_double(archive, "weight_decay", weight_decay());
  write_int(archive, "weight_decay_type", static_cast<int64_t>(weight_decay_type()));
  write_double(archive, "momentum", momentum());
  write_double(archive, "dampening", dampening());
  write_int(archive, "use_nesterov", use_nesterov());
  write_int(archive, "max_preconditioner_dim", max_preconditioner_dim());
  write_int(archive, "use_merge_dims", use_merge_dims());
  write_int(archive, "precondition_frequency", precondition_frequency());
  write_int(archive, "start_preconditioning_step", start_preconditioning_step());
  write_int(archive, "use_bias_correction", use_bias_correction());
  const auto [kind, floats] = grafting_fields(grafting());
  write_int(archive, "grafting_kind", kind);
  write_double(archive, "grafting_beta2", floats.first);
  write_double(archive, "grafting_epsilon", floats.second);
  write_int(archive, "factor_matrix_dtype", static_cast<int64_t>(factor_matrix_dtype()));
  write_int(archive, "num_tolerated_failed_amortized_computations",
            num_tolerated_failed_amortized_computations());
}

void ShampooOptions::serialize(torch::serialize::InputArchive& archive) {
  lr(read_double(archive, "lr"));
  betas(std::make_tuple(read_double(archive, "beta1"), read_double(archive, "beta2")));
  beta3(read_double(archive, "beta3"));
  epsilon(read_double(archive, "epsilon"));
  weight_decay(read_double(archive, "weight_decay"));
  weight_decay_type(static_cast<WeightDecayType>(read_int(archive, "weight_decay_type")));
  momentum(read_double(archive, "momentum"));
  dampening(read_double(archive, "dampening"));
  use_nesterov(read_int(archive, "use_nesterov") != 0);
  max_preconditioner_dim(read_int(archive, "max_preconditioner_dim"));
  use_merge_dims(read_int(archive, "use_merge_dims") != 0);
  precondition_frequency(read_int(archive, "precondition_frequency"));
  start_preconditioning_step(read_int(archive, "start_preconditioning_step"));
  use_bias_correction(read_int(archive, "use_bias_correction") != 0);
  grafting(make_grafting(read_int(archive, "grafting_kind"), read_double(archive, "grafting_beta2"),
                         read_double(archive, "grafting_epsilon")));
  factor_matrix_dtype(static_cast<c10::ScalarType>(read_int(archive, "factor_matrix_dtype")));
  num_tolerated_failed_amortized_computations(
      read_int(archive, "num_tolerated_failed_amortized_computations"));
}

void DistributedOptions::validate() const {
  const auto dtype = communication_dtype();
  TORCH_CHECK(dtype == c10::ScalarType::Float || dtype == c10::ScalarType::BFloat16 ||
                  dtype == c10::ScalarType::Half,
              "DistributedOptions.communication_dtype: got ", dtype,
              ", expected Float, BFloat16 or Half");
  TORCH_CHECK(num_trainers_per_group() == -1 || num_trainers_per_group() >= 1,
              "DistributedOptions.num_trainers_per_group: got ", num_trainers_per_group(),
              ", expected -1 (all ranks) or >= 1");
  if (process_group() && num_trainers_per_group() != -1) {
    const int64_t world = process_group()->getSize();
    TORCH_CHECK(num_trainers_per_group() <= world && world % num_trainers_per_group() == 0,
                "DistributedOptions.num_trainers_per_group: got ", num_trainers_per_group(),
                ", expected a divisor of the world size ", world);
  }
}

}  // namespace shampoo
