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

#include <memory>
#include <optional>
#include <string>
#include <typeinfo>
#include <vector>

namespace shampoo::detail {

class LocalOptimizer;

/// Whether two options of one type are equal (both are of the type it was registered for).
using OptionsEqual = bool (*)(const torch::optim::OptimizerOptions&,
                              const torch::optim::OptimizerOptions&);

/// Equality by the type's own operator==.
template <typename Options>
bool options_equal_as(const torch::optim::OptimizerOptions& a,
                      const torch::optim::OptimizerOptions& b) {
  return static_cast<const Options&>(a) == static_cast<const Options&>(b);
}

/// How the push notices a change in options of `type`: LibTorch's options types (Adam, AdamW,
/// SGD, Adagrad, RMSprop, LBFGS) are known; an optimizer class of the library registers its own
/// from its constructors (DistributedShampoo: ShampooOptions); any other type is compared by its
/// serialized bytes (slower: 10 to 70 µs per group, benchmarks/RESULTS.md). Thread-safe; a second
/// registration of a type does nothing.
void register_options_equality(const std::type_info& type, OptionsEqual equal);

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
    // The user's options as last copied (null: copy at the next push); of a type without a
    // registered equality, also their serialized bytes.
    std::unique_ptr<torch::optim::OptimizerOptions> options;
    std::string bytes;
    std::optional<double> lr;  // their lr (nullopt: no lr, or nothing to take over)
  };
  static Pushed pushed_as(const torch::optim::OptimizerOptions& options);
  /// Whether `options` equal those last copied.
  static bool unchanged(const Pushed& pushed, const torch::optim::OptimizerOptions& options);
  /// The lr set on the driven optimizers' copy of group `g` since the last push, if one was.
  std::optional<double> lr_set_on_driven(size_t g, const std::vector<LocalOptimizer*>& driven,
                                         bool single_group) const;

  std::string who_;
  std::string user_;
  std::string driven_;
  std::vector<Pushed> pushed_;
};

}  // namespace shampoo::detail
