#include "shampoo/step_plan.h"

#include <cmath>

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
  scalars.step.push_back(t);
}

namespace {

/// Docs/math.md step 5: the graft warm-up before the start step, the grafted norm after it.
kernels::DirectionMode direction_mode(const ShampooOptions& options, int64_t t) {
  const bool grafting = grafting_kind(options.grafting()) != GraftingKind::kNone;
  if (!grafting) return kernels::DirectionMode::kPreconditioned;
  return t < options.resolved_start_preconditioning_step() ? kernels::DirectionMode::kGraft
                                                           : kernels::DirectionMode::kGraftNorm;
}

}  // namespace

kernels::ChainScalars chain_scalars(const ShampooOptions& options, int64_t t,
                                    bool communicate_params) {
  kernels::ChainScalars k;
  const double beta1 = std::get<0>(options.betas());
  const double weight_decay = options.weight_decay();
  const bool l2 = options.weight_decay_type() == WeightDecayType::kL2;
  k.l2_weight_decay = l2 ? weight_decay : 0.0;
  k.decoupled_weight_decay = l2 ? 0.0 : weight_decay;
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
  return k;
}

bool chain_reads_param(const kernels::ChainScalars& k) {
  return k.l2_weight_decay != 0.0 || k.decoupled_weight_decay != 0.0 || k.output_updated_param != 0;
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
