#include "shampoo/step_scalars.h"

#include <c10/util/StringUtil.h>

#include <cmath>
#include <limits>
#include <string>
#include <variant>

#include "preconditioners/preconditioner_factory.h"
#include "update/grafting.h"

namespace shampoo::detail {

bool amortized_at(const ShampooOptions& structure, int64_t t) {
  const int64_t start = structure.resolved_start_preconditioning_step();
  return (t % structure.precondition_frequency() == 0 && t > start) || t == start;
}

bool matrix_preconditioned_at(const ShampooOptions& structure, int64_t t,
                              bool identity_before_amortization) {
  const bool grafting = grafting_kind(structure.grafting()) != GraftingKind::kNone;
  return t >= structure.resolved_start_preconditioning_step() ||
         (!grafting && !identity_before_amortization);
}

void push_statistics_scalars(const ShampooOptions& options, int64_t t, RowScalars& scalars) {
  const double beta2 = std::get<1>(options.betas());
  scalars.beta2.push_back(beta2);
  scalars.factor_weight.push_back(beta2 < 1.0 ? 1.0 - beta2 : 1.0);
  scalars.bias_correction2.push_back(
      options.use_bias_correction() && beta2 < 1.0 ? 1.0 - std::pow(beta2, double(t)) : 1.0);
  scalars.epsilon.push_back(options.epsilon());
  scalars.relative_epsilon.push_back(options.relative_epsilon());
  scalars.step.push_back(t);
}

namespace {

/// Docs/math.md step 5: the graft warm-up before the start step, the grafted norm after it.
kernels::DirectionMode direction_mode(const ShampooOptions& options, int64_t t) {
  const bool grafting = grafting_kind(options.grafting()) != GraftingKind::kNone;
  if (!grafting) return kernels::DirectionMode::kPreconditioned;
  return t < options.resolved_start_preconditioning_step() ? kernels::DirectionMode::kDiagonal
                                                           : kernels::DirectionMode::kGraftNorm;
}

}  // namespace

bool averaging_enabled(const ShampooOptions& options) {
  return !std::holds_alternative<std::monostate>(options.iterate_averaging());
}

double lr_power_term(const ShampooOptions& options) {
  const auto* c = std::get_if<ScheduleFreeConfig>(&options.iterate_averaging());
  return c == nullptr ? 0.0 : std::pow(options.lr(), c->eval_coeff_lr_power);
}

AveragingCoefficients averaging_coefficients(const ShampooOptions& options, double lr_sum) {
  AveragingCoefficients k;
  if (const auto* c = std::get_if<GeneralizedPrimalAveragingConfig>(&options.iterate_averaging())) {
    k.eval = c->eval_interp_coeff;
    k.train = c->train_interp_coeff;
  } else if (const auto* c = std::get_if<ScheduleFreeConfig>(&options.iterate_averaging())) {
    // The Road Less Scheduled, eq. (23): x_t averages the z_i with weights lr_i^p.
    k.eval = lr_sum > 0.0 ? 1.0 - lr_power_term(options) / lr_sum : 1.0;
    k.train = c->train_interp_coeff;
  }
  return k;
}

namespace {

/// With averaging, decoupled weight decay shrinks Z (Z ← (1 − lr·wd)·Z) instead of adding to P.
void fill_averaging(const ShampooOptions& options, double lr_sum, kernels::ChainScalars& k) {
  if (!averaging_enabled(options)) return;
  const auto mu = averaging_coefficients(options, lr_sum);
  k.averaging = 1;
  k.average_decay = 1.0 - options.lr() * k.decoupled_weight_decay;
  k.decoupled_weight_decay = 0.0;
  k.average_step = 1.0 - mu.eval * mu.train;
  k.average_pull = 1.0 - mu.eval;
}

}  // namespace

kernels::ChainScalars chain_scalars(const ShampooOptions& options, int64_t t,
                                    bool communicate_params, double lr_sum) {
  kernels::ChainScalars k;
  const double beta1 = std::get<0>(options.betas());
  const bool l2 = options.weight_decay_type() == WeightDecayType::kL2;
  k.l2_weight_decay = l2 ? options.weight_decay() : 0.0;
  // kDecoupled, kCorrected and kIndependent: one term added to P, its factor set by the type.
  k.decoupled_weight_decay = options.decoupled_weight_decay();
  k.beta1 = beta1;
  k.beta3 = options.resolved_beta3();
  k.separate_beta3 = beta1 != 0.0 && k.beta3 != beta1;
  k.filter_bias_correction = options.use_bias_correction() && beta1 != 0.0
                                 ? 1.0 - k.beta3 * std::pow(beta1, static_cast<double>(t - 1))
                                 : 1.0;
  if (grafting_kind(options.grafting()) != GraftingKind::kNone) {
    fill_chain_scalars(options.grafting(), t, k);
  }
  k.direction_mode = static_cast<int32_t>(direction_mode(options, t));
  k.momentum = options.momentum();
  k.dampening = options.dampening();
  k.nesterov = options.use_nesterov() ? 1 : 0;
  k.lr = options.lr();
  k.output_updated_param = communicate_params ? 1 : 0;
  fill_averaging(options, lr_sum, k);
  return k;
}

bool chain_reads_param(const kernels::ChainScalars& k) {
  return k.l2_weight_decay != 0.0 || k.decoupled_weight_decay != 0.0 ||
         k.output_updated_param != 0 || k.averaging != 0;
}

namespace {

bool keeps_squares(const ShampooOptions& options) {
  const auto grafting = grafting_kind(options.grafting());
  if (grafting != GraftingKind::kNone && grafting != GraftingKind::kSGD) return true;
  const auto& family = options.preconditioner();
  return keeps_kronecker_factors(family) ||
         std::holds_alternative<AdaGradPreconditionerConfig>(family) ||
         std::holds_alternative<RMSpropPreconditionerConfig>(family) ||
         std::holds_alternative<AdamPreconditionerConfig>(family);
}

}  // namespace

std::string statistics_overflow(const ShampooOptions& options, at::ScalarType compute_dtype,
                                int64_t block_numel, double grad_abs_max) {
  if (!keeps_squares(options)) return "";
  const bool float64 =
      compute_dtype == at::kDouble && options.factor_matrix_dtype() == c10::ScalarType::Double;
  const double limit = 0.5 * (float64 ? std::numeric_limits<double>::max()
                                      : static_cast<double>(std::numeric_limits<float>::max()));
  // Exact in double: grad_abs_max ≤ float32's or float64's max, squared below double's range
  // for float32 gradients; inf for a float64 one that does not fit, which fails the test too.
  const double added = grad_abs_max * grad_abs_max * static_cast<double>(block_numel);
  if (added <= limit) return "";
  return c10::str("its entries reach ", grad_abs_max, ", whose squares summed over a block of ",
                  block_numel, " entries (up to ", added, ") would overflow the optimizer state's ",
                  float64 ? "float64" : "float32", " (which must stay below ", limit,
                  ") and leave it at inf, the parameter never moving again");
}

double gradient_bound(const ShampooOptions& options, double grad_abs_max,
                      const at::Tensor& param_block) {
  double bound = grad_abs_max;
  if (options.weight_decay_type() == WeightDecayType::kL2 && options.weight_decay() != 0.0) {
    bound += options.weight_decay() *
             at::linalg_vector_norm(param_block, INFINITY, c10::nullopt, false, at::kDouble)
                 .item<double>();
  }
  return bound;
}

}  // namespace shampoo::detail
