#include "shampoo/rank_agreement.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <string>

#include "parallel/communication/collectives.h"
#include "shampoo/option_fields.h"
#include "shampoo/shampoo_engine.h"

namespace shampoo::detail {

void check_distributed_options_agree(const DistributedOptions& d) {
  if (!d.process_group()) return;
  using Setting = SharedSetting;
  check_settings_agree(
      *d.process_group(), "DistributedShampoo: ",
      {Setting::dtype("DistributedOptions.communication_dtype", d.communication_dtype()),
       Setting::number("DistributedOptions.num_trainers_per_group", d.num_trainers_per_group()),
       Setting::flag("DistributedOptions.communicate_params", d.communicate_params()),
       Setting::flag("DistributedOptions.merge_param_groups", d.merge_param_groups()),
       Setting::flag("DistributedOptions.shard_by_parameter", d.shard_by_parameter()),
       Setting::flag("DistributedOptions.agree_before_update", d.agree_before_update())});
}

std::vector<int64_t> float_option_prints(
    const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  Fingerprint lrs;
  Fingerprint others;
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& options = options_of(groups[g], g);
    for (const auto& field : option_fields()) {
      if (field.kind != OptionKind::kFloat) continue;
      (field.name == "lr" ? lrs : others).add_list(field.code(options));
    }
  }
  return {lrs.value(), others.value()};
}

std::string float_options_disagreement(const std::vector<std::vector<int64_t>>& all,
                                       const std::vector<double>& lrs) {
  std::string which;
  std::vector<size_t> ranks;
  for (size_t i = 0; i < all[0].size(); ++i) {
    for (size_t r = 1; r < all.size(); ++r) {
      if (all[r][i] == all[0][i]) continue;
      if (which.empty()) which = i == 0 ? "lrs" : "float options other than the lr";
      if (std::find(ranks.begin(), ranks.end(), r) == ranks.end()) ranks.push_back(r);
    }
    if (!which.empty()) break;
  }
  if (which.empty()) return {};
  return fmt::format(
      "DistributedShampoo: the param groups' {} differ between the ranks of the trainer group at "
      "this step: rank(s) {} differ from rank 0 (this rank's lr per group: {}). Every rank must "
      "set the same options: a scheduler stepped on some ranks only, or driven by a rank's own "
      "metric (ReduceLROnPlateau on a local loss), sets them apart. Nothing changed: the ranks "
      "agreed on it before any state changed, so parameters, state and step counts are as "
      "before it",
      which, fmt::join(ranks, ", "), fmt::join(lrs, ", "));
}

void check_ranks_agree(Distributor& distributor,
                       const std::vector<torch::optim::OptimizerParamGroup>& groups,
                       const ParamRegistry& registry) {
  if (!distributor.distributed()) return;
  // The structure that every rank must share.
  Fingerprint print;
  int64_t numel = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& options = options_of(groups[g], g);
    for (const auto& field : option_fields()) {
      if (field.kind == OptionKind::kStructural) print.add_list(field.code(options));
    }
    print.add(registry.group_sizes[g]);
  }
  for (const auto& p : registry.params) {
    print.add(p.group).add(static_cast<int64_t>(p.param.scalar_type())).add_list(p.param.sizes());
    numel += p.param.numel();
  }
  const std::vector<int64_t> mine{print.value(),
                                  static_cast<int64_t>(registry.params.size()), numel,
                                  static_cast<int64_t>(groups.size())};
  const auto all = distributor.gather_from_all_ranks(mine);
  std::string differing;
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r] == all[0]) continue;
    const bool same_counts = all[r][1] == all[0][1] && all[r][2] == all[0][2];
    differing += fmt::format(
        " rank {} has {} parameters ({} elements) in {} groups, rank 0 has {} ({} elements) in {} "
        "groups{};",
        r, all[r][1], all[r][2], all[r][3], all[0][1], all[0][2], all[0][3],
        same_counts ? " with other shapes, dtypes or structural options" : "");
  }
  TORCH_CHECK(differing.empty(),
              "DistributedShampoo: the ranks registered different "
              "parameters or structural options:",
              differing, " every rank must build the same model and param groups");
}

}  // namespace shampoo::detail
