#pragma once
/// The one rule by which a wrapper's param groups (the user's: ShardedOptimizer's param_groups(),
/// full sharding's optimizer()) reach the optimizers it drives on this rank (LocalOptimizer), at
/// the one point per step where options take effect:
/// 1. an lr set on the driven optimizers' copy of a group since the last push, and not on the
///    user's group (a scheduler attached to local_optimizer() or optimizers()), is taken over
///    into the user's group, so that param_groups(), state dicts and checkpoints hold the lr that
///    steps. Every driven optimizer holding the group must have been given the same lr; set on
///    both sides, or on some driven optimizers and not others, it is an error naming both;
/// 2. the user's options are copied into the driven optimizers where they changed since the last
///    push.
/// Other options set on a driven optimizer directly stay until its group's options change.
/// Internal: not installed.

#include <torch/optim/optimizer.h>

#include <optional>
#include <string>
#include <vector>

namespace shampoo::detail {

class LocalOptimizer;

class OptionsPush {
 public:
  /// `who` starts the errors ("ShardedOptimizer: "); `user` and `driven` name the two sides as
  /// the user reaches them ("param_groups()", "local_optimizer()").
  OptionsPush(std::string who, std::string user, std::string driven);

  /// A group registered with these options, as the driven optimizers got them.
  void add_group(const torch::optim::OptimizerOptions& options);
  /// Forgets the last group (its registration failed).
  void pop_group();
  /// The user's options of group `g` were replaced (a checkpoint's): copied at the next push,
  /// whatever the driven optimizers hold.
  void replaced(size_t g);
  /// Group `g`'s options are, on both sides, `options` (read back from a driven optimizer).
  void settled(size_t g, const torch::optim::OptimizerOptions& options);
  /// Applies the rule to every group: `driven[k]` holds the user's group g as its group g, or as
  /// its group 0 when `single_group` (full sharding's units, in the one-group mode). Nothing
  /// changes on an error.
  void push(std::vector<torch::optim::OptimizerParamGroup>& groups,
            const std::vector<LocalOptimizer*>& driven, bool single_group = false);

 private:
  struct Pushed {
    std::string bytes;         // the user's options as last copied (empty: copy at the next push)
    std::optional<double> lr;  // their lr (nullopt: no lr, or nothing to take over)
  };
  /// The lr set on the driven optimizers' copy of group `g` since the last push, if one was.
  std::optional<double> lr_set_on_driven(size_t g, const std::vector<LocalOptimizer*>& driven,
                                         bool single_group) const;

  std::string who_;
  std::string user_;
  std::string driven_;
  std::vector<Pushed> pushed_;
};

}  // namespace shampoo::detail
