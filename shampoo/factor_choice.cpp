#include "shampoo/factor_choice.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <variant>
#include <vector>

#include "preconditioners/preconditioner_factory.h"
#include "update/grafting.h"

namespace shampoo::detail {
namespace {

/// Dims of the parameter other than size 1 (what "1-D" means: a [1, 512] bias is 1-D).
int64_t squeezed_order(const BlockPlan& plan) {
  return std::count_if(plan.param_shape.begin(), plan.param_shape.end(),
                       [](int64_t d) { return d != 1; });
}

bool one_dimensional_rule(const ShampooOptions& options, const BlockPlan& plan) {
  return !options.precondition_1d() && squeezed_order(plan) <= 1;
}

bool large_dim_rule(const ShampooOptions& options, int64_t merged_dim) {
  return options.max_factored_dim() > 0 && merged_dim > options.max_factored_dim();
}

/// SOAP's ignored_basis_change_dims for blocks of this order (none for other families).
std::vector<int64_t> ignored_basis_dims(const ShampooOptions& options, int64_t order) {
  const auto* soap = std::get_if<EigenvalueCorrectedShampooConfig>(&options.preconditioner());
  if (soap == nullptr) return {};
  const auto it = soap->ignored_basis_change_dims.find(order);
  return it == soap->ignored_basis_change_dims.end() ? std::vector<int64_t>{} : it->second;
}

bool basis_ignored(const ShampooOptions& options, int64_t order, int64_t dim) {
  const auto dims = ignored_basis_dims(options, order);
  return std::find(dims.begin(), dims.end(), dim) != dims.end();
}

std::string shape_string(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", c10::Join(", ", shape));
}

}  // namespace

std::vector<double> dim_exponents(const ShampooOptions& options, int64_t order) {
  std::vector<double> exponents(order, 1.0 / (2.0 * static_cast<double>(order)));
  const auto& overrides = options.inverse_exponent_override();
  const auto it = overrides.find(order);
  if (it == overrides.end()) return exponents;
  const auto all = it->second.find(kAllDims);
  if (all != it->second.end()) exponents.assign(order, all->second);
  for (const auto& [dim, exponent] : it->second) {
    if (dim != kAllDims) exponents[dim] = exponent;
  }
  return exponents;
}

bool keeps_kronecker_factors(const ShampooOptions& options) {
  return keeps_kronecker_factors(options.preconditioner());
}

bool factors_grafting_statistics(const ShampooOptions& options) {
  return options.factored_grafting() && keeps_kronecker_factors(options);
}

BlockFactorChoice block_factor_choice(const ShampooOptions& options, const BlockPlan& plan,
                                      const std::vector<int64_t>& block_shape) {
  BlockFactorChoice choice;
  const auto order = static_cast<int64_t>(block_shape.size());
  choice.dim_exponents = dim_exponents(options, order);
  if (!keeps_kronecker_factors(options)) return choice;
  // Asked for, as an exponent-0 override is: the block keeps its family (no diagonal fallback).
  for (const int64_t k : ignored_basis_dims(options, order)) {
    if (k < order) choice.dim_exponents[k] = 0.0;
  }
  TORCH_INTERNAL_ASSERT(plan.merged_shape.size() == block_shape.size());
  bool ruled_out = false;
  const bool one_dimensional = one_dimensional_rule(options, plan);
  for (int64_t k = 0; k < order; ++k) {
    if (one_dimensional || large_dim_rule(options, plan.merged_shape[k])) {
      ruled_out = true;
      choice.dim_exponents[k] = 0.0;
    }
  }
  const bool none_left = std::all_of(choice.dim_exponents.begin(), choice.dim_exponents.end(),
                                     [](double e) { return e == 0.0; });
  choice.diagonal =
      ruled_out && none_left && grafting_kind(options.grafting()) != GraftingKind::kNone;
  return choice;
}

std::string describe_factor_choice(const ShampooOptions& options, const BlockPlan& plan) {
  if (!keeps_kronecker_factors(options)) return "a diagonal or descent family (no factors)";
  if (plan.numel() == 0) return "nothing (no elements)";
  const auto& merged = plan.merged_shape;
  // Every block has the exponents of the merged shape: the rules look at merged dims only.
  const auto choice = block_factor_choice(options, plan, merged);
  const char* without_factors =
      choice.diagonal ? "the grafting method's update" : "the identity direction";
  if (one_dimensional_rule(options, plan)) {
    return fmt::format("{} (a 1-D parameter; precondition_1d false)", without_factors);
  }
  std::vector<int64_t> factored;
  std::vector<std::string> reasons;
  for (size_t k = 0; k < merged.size(); ++k) {
    if (choice.dim_exponents[k] != 0.0) {
      factored.push_back(static_cast<int64_t>(k));
    } else if (basis_ignored(options, static_cast<int64_t>(merged.size()),
                             static_cast<int64_t>(k))) {
      reasons.push_back(fmt::format("dim {}: in ignored_basis_change_dims", k));
    } else if (large_dim_rule(options, merged[k])) {
      reasons.push_back(fmt::format("dim {}: {} > max_factored_dim {}", k, merged[k],
                                    options.max_factored_dim()));
    } else {
      reasons.push_back(fmt::format("dim {}: exponent 0 by inverse_exponent_override", k));
    }
  }
  const std::string blocks =
      merged == plan.param_shape ? "" : fmt::format(" (blocked as {})", shape_string(merged));
  if (factored.empty()) {
    return fmt::format("{}{} ({})", without_factors, blocks, c10::Join("; ", reasons));
  }
  if (reasons.empty()) return fmt::format("Kronecker factors on every dim{}", blocks);
  return fmt::format("Kronecker factors on dims {}{} ({})", c10::Join(", ", factored), blocks,
                     c10::Join("; ", reasons));
}

}  // namespace shampoo::detail
