#include "parallel/clip_grad_norm.h"

#include <c10/util/Exception.h>
#include <torch/nn/utils/clip_grad.h>

#include <optional>
#include <vector>

#include "parallel/data_parallel/spread_grad_norm.h"
#include "parallel/full_sharding/fully_sharded.h"
#include "parallel/in_backward/in_backward.h"
#include "parallel/optimizers/capabilities.h"
#include "parallel/optimizers/parameter_owners.h"

namespace shampoo {
namespace {

constexpr const char* kWho = "shampoo::clip_grad_norm_";

std::vector<at::Tensor> parameters_of(const torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> params;
  for (const auto& group : optimizer.param_groups()) {
    params.insert(params.end(), group.params().begin(), group.params().end());
  }
  return params;
}

/// Each parameter's owner (nullopt: every rank holds it), or nullopt for the whole list when
/// `owners` cannot name one owner per parameter (DistributedShampoo splitting a parameter's
/// blocks over ranks: then every rank holds every gradient, as gradient sharding needs owners).
std::optional<std::vector<std::optional<int>>> owners_of(const ParameterOwners& owners,
                                                         const std::vector<at::Tensor>& params) {
  std::vector<std::optional<int>> out;
  for (const auto& p : params) {
    try {
      out.push_back(owners.owner_of(p));
    } catch (const c10::Error&) {
      return std::nullopt;
    }
  }
  return out;
}

}  // namespace

double clip_grad_norm_(torch::optim::Optimizer& optimizer, double max_norm, double norm_type) {
  if (auto* fully_sharded = dynamic_cast<FullyShardedOptimizer*>(&optimizer)) {
    return fully_sharded->clip_grad_norm_(max_norm, norm_type);
  }
  TORCH_CHECK(dynamic_cast<InBackwardOptimizer*>(&optimizer) == nullptr, kWho,
              ": an InBackwardOptimizer steps each parameter during backward as soon as its "
              "gradient is ready, before the other gradients exist, so there is no global norm "
              "to clip by; clip with an optimizer stepped after backward");
  const auto params = parameters_of(optimizer);
  if (const ParameterOwners* owners = detail::capabilities_of(optimizer).owners) {
    const auto group = owners->owners_group();
    const auto owner_list = group ? owners_of(*owners, params) : std::nullopt;
    if (owner_list) {
      const int rank = group->getRank();
      std::vector<detail::SpreadGradient> spread;
      for (size_t i = 0; i < params.size(); ++i) {
        const auto owner = (*owner_list)[i].value_or(ParameterOwners::kEveryRank);
        const bool counted = owner == ParameterOwners::kEveryRank ? rank == 0 : owner == rank;
        const auto& grad = params[i].grad();
        spread.push_back({counted ? grad : at::Tensor(), grad, params[i].options()});
      }
      return detail::clip_spread_grad_norm_(*group, spread, max_norm, norm_type, kWho);
    }
  }
  return torch::nn::utils::clip_grad_norm_(params, max_norm, norm_type);
}

}  // namespace shampoo
