#include "shampoo/state_size.h"

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <fmt/format.h>

#include <algorithm>

#include "distributor/block_plan.h"
#include "preconditioners/preconditioner_factory.h"
#include "shampoo/factor_choice.h"
#include "shampoo/virtual_group.h"
#include "update/elementwise_state.h"

namespace shampoo::detail {
namespace {

/// Bytes the preconditioner list (its family's estimate, preconditioners/preconditioner_factory.h)
/// and the grafting state allocate for one block from the start; the grafting part added to
/// `grafting_bytes`.
int64_t block_state_bytes(const ShampooOptions& options, const std::vector<int64_t>& shape,
                          const std::vector<double>& exponents, int64_t numel,
                          int64_t state_element_size, int64_t& grafting_bytes) {
  BlockLayout layout;
  layout.shape = shape;
  layout.dim_exponents = exponents;
  layout.factor_element_size =
      static_cast<int64_t>(c10::elementSize(options.factor_matrix_dtype()));
  layout.state_element_size = state_element_size;
  layout.symmetric_packing = options.use_symmetric_packing();
  layout.compact = options.compact_state();
  int64_t bytes = estimated_state_bytes(options.preconditioner(), layout);
  // Grafting statistics V (bfloat16 when compact; factored_grafting: row and column sums).
  if (grafting_method(grafting_kind(options.grafting())).has_state) {
    const bool factored =
        factors_grafting_statistics(options) && factors_second_moment(shape, exponents);
    const int64_t v =
        factored ? (shape[0] + shape[1]) * state_element_size
                 : numel * (options.compact_state() == CompactState::kNone ? state_element_size
                                                                           : int64_t{2});
    bytes += v;
    grafting_bytes += v;
  }
  return bytes;
}

std::string megabytes(int64_t bytes) {
  return fmt::format("{:.1f} MB", static_cast<double>(bytes) / 1e6);
}

}  // namespace

std::optional<StateSizeEstimate> estimate_state_size(
    const std::vector<torch::optim::OptimizerParamGroup>& groups, const ShampooOptions& defaults) {
  StateSizeEstimate estimate;
  int64_t param_index = 0;
  for (const auto g : c10::irange(groups.size())) {
    const auto& group = groups[g];
    const auto* options =
        group.has_options() ? dynamic_cast<const ShampooOptions*>(&group.options()) : &defaults;
    if (options == nullptr) return std::nullopt;
    try {
      options->validate();
    } catch (const c10::Error&) {
      return std::nullopt;
    }
    for (const auto& param : group.params()) {
      if (!param.defined()) return std::nullopt;
      const auto element_size = static_cast<int64_t>(param.element_size());
      // bf16/fp16 parameters keep float32 state (virtual_group.h, compute_dtype).
      const auto state_element_size =
          static_cast<int64_t>(c10::elementSize(compute_dtype(param.scalar_type())));
      const auto plan = make_block_plan(param.sizes(), options->max_preconditioner_dim(),
                                        options->use_merge_dims(), block_target_order(*options));
      int64_t bytes = 0;
      ParamStateSize entry;
      entry.one_dimensional = true;
      for (const auto& block : plan.blocks) {
        const auto exponents = block_factor_choice(*options, plan, block.sizes).dim_exponents;
        bytes += block_state_bytes(*options, block.sizes, exponents, block.numel,
                                   state_element_size, estimate.grafting_bytes);
        for (size_t k = 0; k < block.sizes.size(); ++k) {
          if (exponents[k] != 0.0) entry.largest_dim = std::max(entry.largest_dim, block.sizes[k]);
        }
        entry.one_dimensional = entry.one_dimensional && block.sizes.size() == 1;
      }
      entry.treatment = describe_factor_choice(*options, plan);
      entry.param = param_index;
      entry.group = static_cast<int64_t>(g);
      entry.shape = param.sizes().vec();
      entry.blocks = static_cast<int64_t>(plan.blocks.size());
      entry.param_bytes = param.numel() * element_size;
      entry.state_bytes = bytes;
      estimate.params.push_back(entry);
      estimate.param_bytes += param.numel() * element_size;
      estimate.state_bytes += bytes;
      if (bytes > estimate.largest_param_state_bytes) {
        estimate.largest_param = param_index;
        estimate.largest_param_group = static_cast<int64_t>(g);
        estimate.largest_param_shape = param.sizes().vec();
        estimate.largest_param_blocks = static_cast<int64_t>(plan.blocks.size());
        estimate.largest_param_state_bytes = bytes;
      }
      ++param_index;
    }
  }
  return estimate;
}

std::vector<ParamStateSize> oversized_params(const StateSizeEstimate& estimate) {
  std::vector<ParamStateSize> out;
  for (const auto& p : estimate.params) {
    if (p.state_bytes > kParamStateWarningMinBytes &&
        p.state_bytes > kParamStateWarningRatio * p.param_bytes) {
      out.push_back(p);
    }
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const auto& a, const auto& b) { return a.state_bytes > b.state_bytes; });
  return out;
}

namespace {

std::string times(int64_t state, int64_t param) {
  return fmt::format("{:.0f}x",
                     static_cast<double>(state) / static_cast<double>(std::max<int64_t>(1, param)));
}

/// One oversized parameter: what it is, what it costs, and what would shrink it.
std::string describe_oversized(const ParamStateSize& p) {
  const auto rank = static_cast<int64_t>(p.shape.size());
  std::string remedy;
  if (p.one_dimensional) {
    remedy = fmt::format(
        "its blocks are 1-D, each with a {0}x{0} factor and root for {0} elements: "
        "precondition_1d(false) (the default) gives a 1-D parameter the grafting update and no "
        "factor; for a parameter merged into 1-D blocks, exponent 0 for 1-D blocks "
        "(inverse_exponent_override {{{{1, {{{{shampoo::kAllDims, 0.0}}}}}}}}) keeps none, or put "
        "it in a param group with a diagonal method "
        "(grafting(std::monostate{{}}).preconditioner(shampoo::AdamPreconditionerConfig{{}}))",
        p.largest_dim);
  } else {
    remedy = fmt::format(
        "its largest block dim is {0} (a {0}x{0} factor and root per block): a max_factored_dim "
        "below the parameter's dim along it (4096 by default) keeps no factor along that dim, as "
        "does exponent 0 for that dim (inverse_exponent_override {{{{{1}, {{{{dim, 0.0}}}}}}}}); "
        "or a smaller max_preconditioner_dim, or a diagonal method in a param group of its own",
        p.largest_dim, rank);
  }
  return fmt::format(
      " parameter {} (group {}, shape {}, {} block{}): {} of parameters, {} of state "
      "({}); {}.",
      p.param, p.group, c10::str(c10::IntArrayRef(p.shape)), p.blocks, p.blocks == 1 ? "" : "s",
      megabytes(p.param_bytes), megabytes(p.state_bytes), times(p.state_bytes, p.param_bytes),
      remedy);
}

}  // namespace

bool warn_if_state_is_large(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                            const ShampooOptions& defaults) {
  const auto estimate = estimate_state_size(groups, defaults);
  if (!estimate) return false;
  const auto& e = *estimate;
  const bool total_large = e.state_bytes > kStateSizeWarningMinBytes &&
                           e.state_bytes > kStateSizeWarningRatio * e.param_bytes;
  const auto oversized = oversized_params(e);
  if (!total_large && oversized.empty()) return false;
  const auto& options =
      groups[e.largest_param_group].has_options()
          ? static_cast<const ShampooOptions&>(groups[e.largest_param_group].options())
          : defaults;
  std::string per_param;
  constexpr size_t kListed = 8;
  for (size_t i = 0; i < std::min(oversized.size(), kListed); ++i) {
    per_param += describe_oversized(oversized[i]);
  }
  if (oversized.size() > kListed) {
    per_param += fmt::format(" ({} more)", oversized.size() - kListed);
  }
  TORCH_WARN(
      "DistributedShampoo: Shampoo's state will take ", megabytes(e.state_bytes), " (",
      megabytes(e.state_bytes - e.grafting_bytes),
      " preconditioner: factors and what the family keeps, such as inverse roots or "
      "eigenvectors; ",
      megabytes(e.grafting_bytes), " grafting; the β1 filter and momentum come on top), ",
      times(e.state_bytes, e.param_bytes), " the ", megabytes(e.param_bytes),
      " of the parameters it preconditions. Largest: parameter ", e.largest_param, " (group ",
      e.largest_param_group, ", shape ", c10::IntArrayRef(e.largest_param_shape), ", ",
      e.largest_param_blocks, " blocks of at most ", options.max_preconditioner_dim(),
      " per dim) with ", megabytes(e.largest_param_state_bytes), ".",
      oversized.empty() ? "" : " Parameters whose state is above ",
      oversized.empty() ? "" : std::to_string(kParamStateWarningRatio),
      oversized.empty() ? "" : "x their own bytes:", per_param,
      " Options that shrink the state: precondition_1d(false) and max_factored_dim (by default "
      "1-D parameters and dims above 4096 keep no factor); use_symmetric_packing (on by default: "
      "factors and inverse roots as packed triangles); compact_state (bfloat16 or 8-bit inverse "
      "roots, bfloat16 "
      "first-order state; changes the results); a smaller max_preconditioner_dim; "
      "inverse_exponent_override with exponent 0 for a dim, which keeps no factor or root for it "
      "(e.g. {{1, {{shampoo::kAllDims, 0.0}}}} for 1-D blocks); or a diagonal method for such "
      "parameters (a param group of their own with "
      "grafting(std::monostate{}).preconditioner(shampoo::AdamPreconditionerConfig{}), or "
      "another optimizer). (This "
      "warning: state above ",
      kStateSizeWarningRatio, "x the parameters and ", kStateSizeWarningMinBytes >> 20,
      " MiB, or a parameter's above ", kParamStateWarningRatio, "x its bytes and ",
      kParamStateWarningMinBytes >> 20, " MiB.)");
  return true;
}

}  // namespace shampoo::detail
