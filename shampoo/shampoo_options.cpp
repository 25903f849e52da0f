#include "shampoo/shampoo_options.h"

#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <cmath>
#include <type_traits>
#include <variant>

#include "preconditioners/iterative_roots.h"
#include "preconditioners/preconditioner_factory.h"
#include "shampoo/option_fields.h"
#include "update/grafting.h"

namespace shampoo {
namespace {

void check_unit_interval(double value, const char* field, bool allow_one) {
  const bool ok = std::isfinite(value) && value >= 0.0 && (allow_one ? value <= 1.0 : value < 1.0);
  TORCH_CHECK(ok, "ShampooOptions.", field, ": got ", value, ", expected a value in [0, ",
              allow_one ? "1]" : "1)");
}

/// The family's own ranges (check_config, preconditioners/preconditioner_configs.cpp), and what
/// depends on other options: the iterative root solvers need integer roots (every exponent 1/p).
void check_preconditioner(const PreconditionerConfig& preconditioner,
                          const InverseExponentOverride& overrides) {
  std::visit([](const auto& c) { detail::check_config(c, "ShampooOptions.preconditioner"); },
             preconditioner);
  const auto* c = root_inverse_config(preconditioner);
  if (c == nullptr || c->solver == RootSolver::kEigh) return;
  for (const auto& [order, dims] : overrides) {
    for (const auto& [dim, exponent] : dims) {
      TORCH_CHECK(c->solver != RootSolver::kNewtonSchulz || exponent == 0.0 ||
                      detail::power_of_two_root(detail::integer_root(exponent)),
                  "ShampooOptions.inverse_exponent_override[", order, "][", dim, "]: exponent ",
                  exponent,
                  " is not 1/p for p a power of two >= 2; RootSolver::kNewtonSchulz computes "
                  "only those roots (use another solver)");
      TORCH_CHECK(
          exponent == 0.0 || detail::integer_root(exponent) != 0,
          "ShampooOptions.inverse_exponent_override[", order, "][", dim, "]: exponent ", exponent,
          " is not 1/p for an integer p; the iterative root solvers "
          "(kCoupledNewton, kNewtonDB, kCoupledHigherOrder, kNewtonSchulz) need integer roots (use "
          "RootSolver::kEigh)");
    }
  }
}

/// The iterate averaging config's ranges (the reference's), and momentum 0 with it.
void check_iterate_averaging(const IterateAveragingConfig& averaging, double momentum) {
  if (std::holds_alternative<std::monostate>(averaging)) return;
  const char* name = std::holds_alternative<GeneralizedPrimalAveragingConfig>(averaging)
                         ? "GeneralizedPrimalAveragingConfig"
                         : "ScheduleFreeConfig";
  const double train = std::visit(
      [](const auto& c) {
        if constexpr (requires { c.train_interp_coeff; }) return c.train_interp_coeff;
        return 1.0;
      },
      averaging);
  TORCH_CHECK(std::isfinite(train) && train > 0.0 && train <= 1.0,
              "ShampooOptions.iterate_averaging.train_interp_coeff: got ", train,
              ", expected a value in (0, 1] (", name, ")");
  if (const auto* c = std::get_if<GeneralizedPrimalAveragingConfig>(&averaging)) {
    TORCH_CHECK(std::isfinite(c->eval_interp_coeff) && c->eval_interp_coeff >= 0.0 &&
                    c->eval_interp_coeff < 1.0,
                "ShampooOptions.iterate_averaging.eval_interp_coeff: got ", c->eval_interp_coeff,
                ", expected a value in [0, 1) (", name, ")");
  }
  if (const auto* c = std::get_if<ScheduleFreeConfig>(&averaging)) {
    TORCH_CHECK(std::isfinite(c->eval_coeff_lr_power) && c->eval_coeff_lr_power >= 0.0,
                "ShampooOptions.iterate_averaging.eval_coeff_lr_power: got ",
                c->eval_coeff_lr_power, ", expected a finite value >= 0 (", name, ")");
  }
  TORCH_CHECK(momentum == 0.0, "ShampooOptions.momentum: got ", momentum,
              ", expected 0 with iterate averaging (", name,
              "): averaging takes the place of momentum");
}

/// weight_decay ≥ 0; peak_lr −1 or > 0, and > 0 once resolved for the types that divide by it.
void check_weight_decay(const ShampooOptions& o) {
  TORCH_CHECK(std::isfinite(o.weight_decay()) && o.weight_decay() >= 0.0,
              "ShampooOptions.weight_decay: got ", o.weight_decay(),
              ", expected weight_decay >= 0");
  TORCH_CHECK(o.peak_lr() == -1.0 || (std::isfinite(o.peak_lr()) && o.peak_lr() > 0.0),
              "ShampooOptions.peak_lr: got ", o.peak_lr(),
              ", expected -1 (the group's lr when it is added) or a finite value > 0");
  const bool scaled_decay = o.weight_decay_type() == WeightDecayType::kCorrected ||
                            o.weight_decay_type() == WeightDecayType::kIndependent;
  TORCH_CHECK(!scaled_decay || o.peak_lr() > 0.0 || o.lr() > 0.0, "ShampooOptions.peak_lr: got ",
              o.peak_lr(), " with lr ", o.lr(),
              ", expected peak_lr > 0 (or lr > 0, which peak_lr -1 takes) with weight_decay_type "
              "kCorrected or kIndependent: they divide by peak_lr");
}

/// Trace scaling needs a Kronecker family and an exponent in (0, 1] (the reference's range).
void check_trace_scaling(bool enabled, double exponent,
                         const PreconditionerConfig& preconditioner) {
  if (!enabled) return;
  TORCH_CHECK(std::isfinite(exponent) && exponent > 0.0 && exponent <= 1.0,
              "ShampooOptions.trace_scaling_exponent: got ", exponent,
              ", expected a value in (0, 1] with use_trace_scaling");
  TORCH_CHECK(detail::keeps_kronecker_factors(preconditioner),
              "ShampooOptions.use_trace_scaling: got true with the ",
              std::visit([](const auto& c) { return detail::family_name(c); }, preconditioner),
              ", expected a Kronecker family (root-inverse, eigendecomposed or "
              "eigenvalue-corrected Shampoo, KL-Shampoo): only Kronecker factors are scaled");
}

/// A diagonal main preconditioner (SGD, AdaGrad, RMSprop, Adam) is its own first-order method:
/// the default Adam grafting would rescale its steps to Adam's and run Adam alone until the start
/// step, so that the family chosen would not be the method run. Grafting must then be chosen.
void check_diagonal_family_grafting(const ShampooOptions& o) {
  const bool diagonal = std::visit(
      [](const auto& c) {
        return std::is_same_v<typename std::decay_t<decltype(c)>::List,
                              detail::DiagonalPreconditionerList>;
      },
      o.preconditioner());
  if (!diagonal || o.grafting_given()) return;
  TORCH_CHECK(false, "ShampooOptions.grafting: left at its default (Adam grafting) with the ",
              std::visit([](const auto& c) { return detail::family_name(c); }, o.preconditioner()),
              ", which would then take Adam's step sizes and run as Adam before step ",
              o.resolved_start_preconditioning_step(),
              "; expected a grafting chosen for a diagonal main preconditioner: "
              "grafting(std::monostate{}) for the method itself (= its torch::optim optimizer, "
              "docs/training.md \"Diagonal families\"), or the grafting config wanted");
}

/// ε > 0 with the perturbation, ε = 0 with the pseudo-inverse (the reference's rule).
void check_epsilon(double epsilon, const PreconditionerConfig& preconditioner) {
  if (uses_pseudo_inverse(preconditioner)) {
    TORCH_CHECK(epsilon == 0.0, "ShampooOptions.epsilon: got ", epsilon,
                ", expected 0 with PseudoInverseConfig (the pseudo-inverse drops small "
                "eigenvalues instead of adding epsilon)");
    return;
  }
  TORCH_CHECK(std::isfinite(epsilon) && epsilon > 0.0, "ShampooOptions.epsilon: got ", epsilon,
              ", expected epsilon > 0");
}

}  // namespace

double ShampooOptions::resolved_beta3() const {
  return beta3() == -1.0 ? std::get<0>(betas()) : beta3();
}

int64_t ShampooOptions::resolved_start_preconditioning_step() const {
  return start_preconditioning_step() == -1 ? precondition_frequency()
                                            : start_preconditioning_step();
}

double ShampooOptions::decoupled_weight_decay() const {
  switch (weight_decay_type()) {
    case WeightDecayType::kL2:
      return 0.0;
    case WeightDecayType::kDecoupled:
      return weight_decay();
    case WeightDecayType::kCorrected:
    case WeightDecayType::kIndependent:
      break;
  }
  if (weight_decay() == 0.0) return 0.0;
  TORCH_CHECK(peak_lr() > 0.0, "ShampooOptions.peak_lr: got ", peak_lr(),
              ", expected > 0 with weight_decay_type kCorrected or kIndependent (-1 is resolved "
              "to the group's lr when the group is added to DistributedShampoo)");
  return weight_decay_type() == WeightDecayType::kCorrected ? weight_decay() * lr() / peak_lr()
                                                            : weight_decay() / peak_lr();
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
  check_epsilon(epsilon(), preconditioner());
  check_weight_decay(*this);
  check_trace_scaling(use_trace_scaling(), trace_scaling_exponent(), preconditioner());
  check_unit_interval(momentum(), "momentum", /*allow_one=*/false);
  check_unit_interval(dampening(), "dampening", /*allow_one=*/true);
  TORCH_CHECK(max_factored_dim() == -1 || max_factored_dim() >= 1,
              "ShampooOptions.max_factored_dim: got ", max_factored_dim(),
              ", expected -1 (no limit) or >= 1");
  TORCH_CHECK(std::isfinite(relative_epsilon()) && relative_epsilon() >= 0.0,
              "ShampooOptions.relative_epsilon: got ", relative_epsilon(),
              ", expected a finite value >= 0");
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
  detail::check_grafting(grafting());
  check_diagonal_family_grafting(*this);
  check_preconditioner(preconditioner(), inverse_exponent_override());
  check_iterate_averaging(iterate_averaging(), momentum());
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

ShampooOptions ShampooOptions::reference_defaults(double lr) {
  return ShampooOptions(lr)
      .betas({0.9, 1.0})
      .precondition_frequency(1)
      .grafting(std::monostate{})
      .relative_epsilon(0.0)
      .factor_matrix_dtype(c10::ScalarType::Float)
      .precondition_1d(true)
      .max_factored_dim(-1)
      .factored_grafting(false);
}

bool structurally_equal(const ShampooOptions& a, const ShampooOptions& b) {
  return detail::structural_difference(a, b) == nullptr;
}

// The table's codes are canonical (two values agree exactly when their codes do), so a field
// added to the table is compared here without another line.
bool ShampooOptions::operator==(const ShampooOptions& other) const {
  for (const auto& field : detail::option_fields()) {
    if (field.code(*this) != field.code(other)) return false;
  }
  return true;
}

// Every field is written (shampoo/option_fields.cpp): the float ones so a checkpoint restores
// what a scheduler changed, the structural ones so a load into an optimizer of other structure
// is refused naming the field.
void ShampooOptions::serialize(torch::serialize::OutputArchive& archive) const {
  for (const auto& field : detail::option_fields()) field.write(*this, archive);
}

void ShampooOptions::serialize(torch::serialize::InputArchive& archive) {
  for (const auto& field : detail::option_fields()) field.read(archive, *this);
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
  TORCH_CHECK(!shard_by_parameter() || num_trainers_per_group() == -1 ||
                  (process_group() && num_trainers_per_group() == process_group()->getSize()),
              "DistributedOptions.shard_by_parameter: not with num_trainers_per_group (got ",
              num_trainers_per_group(),
              "): gradient sharding reduces each gradient to one owner among all ranks");
}

}  // namespace shampoo
