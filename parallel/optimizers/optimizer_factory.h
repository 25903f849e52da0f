#pragma once
/// Factories of optimizers: over a parameter set, as optimizer-in-backward takes them; over this
/// rank's share of a param group, as full sharding and state sharding take them; and the size of
/// an optimizer's state.

#include <torch/optim/optimizer.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace shampoo {

/// Makes the optimizer of a parameter set (called once per set, with the whole set):
/// apply_optimizer_in_backward and InBackwardOptimizer::add.
using OptimizerFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;

/// The factory of full sharding (FullyShardedDataParallel) and of state sharding
/// (ShardedOptimizer). It is called once per rank, not once per parameter, with a param group:
/// this rank's parameters of the first of the user's param groups that it steps (several, one or
/// none) and, when the user gave that group options, those options. It returns an optimizer with
/// that one group, built the way a LibTorch optimizer is built from param groups (a group without
/// options takes the defaults given to the constructor):
///
///   [](torch::optim::OptimizerParamGroup group) -> std::unique_ptr<torch::optim::Optimizer> {
///     return std::make_unique<torch::optim::Adam>(
///         std::vector<torch::optim::OptimizerParamGroup>{std::move(group)},
///         torch::optim::AdamOptions(1e-3));
///   }
///
/// or, the same,
/// shampoo::group_optimizer_factory<torch::optim::Adam>(torch::optim::AdamOptions(1e-3)). The
/// wrapper adds this rank's parameters of the user's other groups to that optimizer, each group
/// with its own options, and copies the options of the wrapper's param_groups() into it before each
/// step: choose per-parameter options with param groups, not in the factory.
///
/// A callable that takes a std::vector<torch::Tensor> does not convert (a static_assert says
/// so): until 2026-12-02 these wrappers took an OptimizerFactory and called it once per
/// parameter, and a factory written for that, which picks options by looking at its parameter,
/// would now silently give every parameter of the rank the options it picked for the first.
class GroupOptimizerFactory {
 public:
  using Function =
      std::function<std::unique_ptr<torch::optim::Optimizer>(torch::optim::OptimizerParamGroup)>;

  GroupOptimizerFactory() = default;
  GroupOptimizerFactory(std::nullptr_t) {}  // NOLINT(google-explicit-constructor)

  /// Any callable that takes a torch::optim::OptimizerParamGroup and returns a
  /// std::unique_ptr<torch::optim::Optimizer> (or a pointer convertible to one).
  template <typename F,
            typename = std::enable_if_t<!std::is_same_v<std::decay_t<F>, GroupOptimizerFactory> &&
                                        !std::is_same_v<std::decay_t<F>, std::nullptr_t>>>
  GroupOptimizerFactory(F&& factory)  // NOLINT(google-explicit-constructor)
  {
    using Callable = std::decay_t<F>;
    if constexpr (std::is_invocable_r_v<std::unique_ptr<torch::optim::Optimizer>, Callable&,
                                        torch::optim::OptimizerParamGroup>) {
      function_ = std::forward<F>(factory);
    } else if constexpr (std::is_invocable_v<Callable&, std::vector<torch::Tensor>>) {
      static_assert(
          sizeof(Callable) == 0,
          "FullyShardedDataParallel and ShardedOptimizer call their optimizer factory "
          "once per rank with a torch::optim::OptimizerParamGroup (this rank's "
          "parameters of a param group, with that group's options), not once per "
          "parameter with a std::vector<torch::Tensor>: take a "
          "torch::optim::OptimizerParamGroup and build the optimizer from it "
          "(std::vector<torch::optim::OptimizerParamGroup>{group}), and give "
          "per-parameter options as param groups (parallel/optimizers/optimizer_factory.h)");
    } else {
      static_assert(sizeof(Callable) == 0,
                    "an optimizer factory of FullyShardedDataParallel or ShardedOptimizer takes a "
                    "torch::optim::OptimizerParamGroup and returns a "
                    "std::unique_ptr<torch::optim::Optimizer>");
    }
  }

  /// The optimizer over `group` (null when the callable returned null).
  std::unique_ptr<torch::optim::Optimizer> operator()(
      torch::optim::OptimizerParamGroup group) const {
    return function_(std::move(group));
  }
  explicit operator bool() const { return static_cast<bool>(function_); }

 private:
  Function function_;
};

/// A GroupOptimizerFactory that makes an `OptimizerType` (torch::optim::Adam,
/// shampoo::DistributedShampoo, ...) over the group it is given, with `defaults` for a group
/// given without options.
template <typename OptimizerType, typename Options>
GroupOptimizerFactory group_optimizer_factory(Options defaults) {
  return [defaults](
             torch::optim::OptimizerParamGroup group) -> std::unique_ptr<torch::optim::Optimizer> {
    return std::make_unique<OptimizerType>(
        std::vector<torch::optim::OptimizerParamGroup>{std::move(group)}, defaults);
  };
}

namespace detail {
/// An error starting with `who` unless `optimizer`, which a GroupOptimizerFactory returned, has
/// one param group whose options are of its own options type.
void check_factory_optimizer(const torch::optim::Optimizer& optimizer, const std::string& who);
}  // namespace detail

/// Bytes of the per-parameter state tensors of LibTorch's SGD, Adam, AdamW, Adagrad and RMSprop
/// (-1 for another optimizer type, whose state this cannot see).
int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer);

}  // namespace shampoo
