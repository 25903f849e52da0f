#pragma once
/// optimizer()'s param groups (the user's): registered on every rank alike, their options copied
/// into the rank's optimizers at one point per iteration, parameters added late.
/// Internal: not installed.

#include <torch/optim/optimizer.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "parallel/full_sharding/fully_sharded.h"
#include "parallel/optimizers/local_optimizer.h"
#include "parallel/optimizers/options_push.h"

namespace shampoo::detail {

struct FsdpState;

class FsdpGroups {
 public:
  explicit FsdpGroups(FsdpState& state);

  /// Builds optimizer(): its defaults and, without the user's groups (`given` empty), its one
  /// group's options are the factory's, read off an optimizer the factory makes over the
  /// smallest parameter (while the parameters are still whole) and then drops. Then the groups'
  /// parameters are registered. Collective.
  void make(FullyShardedDataParallel& owner,
            std::optional<std::vector<torch::optim::OptimizerParamGroup>> given);
  FullyShardedOptimizer& optimizer() const { return *facade_; }
  /// The options of optimizer()'s param groups, as the rank optimizer asks for them.
  LocalOptimizer::GroupOptions options_of();
  /// Copies each group's options into the optimizers of its parameters where they changed since
  /// the last copy, taking over an lr set on optimizers() alone (options_push.h's rule): the one
  /// point per iteration where options take effect (the start of backward with overlap, of
  /// step() without).
  void push_options();
  /// Registers what was appended to optimizer()'s param groups since the last call (through its
  /// add_param_group, or the base class's add_param_group or add_parameters). Collective when
  /// something was; only between iterations.
  void sync();
  /// Forgets the groups from `before` on that registered no parameter (add_param_group failed).
  void forget_after(size_t before);
  /// Installs a checkpoint's options, one per group; copied into the optimizers at the next
  /// defined point.
  void install_options(std::vector<std::unique_ptr<torch::optim::OptimizerOptions>>& options);
  /// state() of optimizer(): per parameter of a group, its steps since it joined and its owner.
  void write_state_entries();

 private:
  /// A group appended to optimizer(): its options checked to be the factory's type.
  void add_group(size_t g);
  /// Registers the parameters of param group `g` from position `first` on: unit parameters in
  /// no other group, the same on every rank (checked before anything changes, then agreed on).
  /// Returns the registered parameters. Collective.
  std::vector<at::Tensor> register_params(size_t g, size_t first);
  /// Parameters that joined a group after construction (lossless): every rank gathers each one's
  /// full value (collective), its owner adds it to its optimizer. Only between iterations.
  void add_later_params(const std::vector<at::Tensor>& added, size_t g);

  FsdpState& state_;
  std::unique_ptr<FullyShardedOptimizer> facade_;
  std::vector<size_t> sizes_;  // per group: the parameters registered
  OptionsPush push_;           // the groups' options into the optimizers
};

}  // namespace shampoo::detail
