#pragma once
/// What full sharding needs of an optimizer that keeps its state by block, across its parameters
/// (one step count per param group, roots batched over every block): to register parameters
/// appended through the base class, and to checkpoint each parameter's blocks under the wrapper's
/// own name for it, so that any world size loads it. (A step of some of its parameters while the
/// others have no storage is its PhasedStep.) DistributedShampoo implements it; LibTorch's
/// optimizers need none of it (their state is per parameter).

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "parallel/checkpoints/distributed_checkpoint.h"

namespace shampoo {

class BlockStates {
 public:
  virtual ~BlockStates() = default;

  /// Registers, now, parameters and groups appended through the base class (whose parameters
  /// must have their full values at this point).
  virtual void register_appended() = 0;

  /// Names the piece of block `block` of parameter `param`.
  using BlockPieceName = std::function<std::string(const at::Tensor& param, int64_t block)>;
  /// Saves the state of every block this optimizer holds as a piece named by `name_of`.
  virtual void save_block_pieces(PieceWriter& pieces, const BlockPieceName& name_of) const = 0;
  /// Reads the pieces of every registered parameter's blocks; the returned function installs
  /// them with each param group's step count and lr sum (as group_step and group_lr_sum give
  /// them) and, when given, the eval mode (in_eval_mode), the groups' options unchanged. Nothing
  /// changes unless it runs.
  virtual std::function<void()> prepare_block_load(PieceReader& pieces,
                                                   const BlockPieceName& name_of,
                                                   std::vector<int64_t> group_steps,
                                                   std::vector<double> group_lr_sums,
                                                   std::optional<bool> eval_mode) = 0;
  /// Iterate averaging: whether the parameters hold the evaluation sequence (eval()).
  virtual bool in_eval_mode() const = 0;
  /// Completed steps of param group `group`, and its Σ lr^p (Schedule-Free; 0 otherwise).
  virtual int64_t group_step(size_t group) const = 0;
  virtual double group_lr_sum(size_t group) const = 0;

 protected:
  BlockStates() = default;
  BlockStates(const BlockStates&) = default;
  BlockStates& operator=(const BlockStates&) = default;
  BlockStates(BlockStates&&) = default;
  BlockStates& operator=(BlockStates&&) = default;
};

}  // namespace shampoo
