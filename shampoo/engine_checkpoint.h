#pragma once
/// The Shampoo engine in checkpoints (checkpoint.cpp): torch::save / torch::load of a rank's
/// state, world-size-independent checkpoint directories (a common part and one piece per block),
/// the blocks under a wrapper's names (full sharding), and the saved options of whole-run
/// checkpoints. A view over one engine, made where it is used: it keeps nothing of its own.
/// Internal: not installed.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shampoo/shampoo_engine.h"

namespace shampoo::detail {

class EngineCheckpoint {
 public:
  explicit EngineCheckpoint(ShampooEngine& engine) : engine_(&engine) {}

  void save(torch::serialize::OutputArchive& archive,
            const std::vector<torch::optim::OptimizerParamGroup>& groups) const;
  void load(torch::serialize::InputArchive& archive,
            std::vector<torch::optim::OptimizerParamGroup>& groups);
  /// World-size-independent checkpoints (parallel/checkpoints/distributed_checkpoint.h): the
  /// header, model and groups as every rank has them; one piece per block this rank owns
  /// ("block/p3_b1"), none on ranks outside the first trainer group (replicas); and a load that
  /// reads the blocks this rank owns now, whichever rank saved them.
  void save_common(torch::serialize::OutputArchive& archive,
                   const std::vector<torch::optim::OptimizerParamGroup>& groups) const;
  void save_pieces(PieceWriter& pieces) const;
  std::function<void()> prepare_load(torch::serialize::InputArchive& common, PieceReader& pieces,
                                     std::vector<torch::optim::OptimizerParamGroup>& groups);
  /// The same pieces under a wrapper's own names (`name_of` a block) and without the common
  /// part: the wrapper keeps each param group's step count and lr sum, which the load takes
  /// (`steps`, `lr_sums`, and the eval mode when given); the groups' options stay.
  using BlockPieceName = std::function<std::string(const BlockId&)>;
  void save_block_pieces(PieceWriter& pieces, const BlockPieceName& name_of) const;
  std::function<void()> prepare_block_load(PieceReader& pieces, const BlockPieceName& name_of,
                                           std::vector<int64_t> steps, std::vector<double> lr_sums,
                                           std::optional<bool> eval_mode,
                                           std::vector<torch::optim::OptimizerParamGroup>& groups);
  /// Whole-run checkpoints by parameter name (parallel/optimizers/portable_checkpoint.h): the
  /// saved options of each param group (serialized), checked against the structural options
  /// here; returns what installs their float fields. Whether this rank writes its blocks (ranks
  /// outside the first trainer group hold copies).
  std::function<void()> prepare_saved_options(
      const std::vector<std::shared_ptr<torch::serialize::InputArchive>>& saved,
      std::vector<torch::optim::OptimizerParamGroup>& groups);
  bool writes_pieces() const;

 private:
  /// What a load installs, read and checked against the optimizer.
  struct PreparedLoad;
  /// Checks the model and groups of `archive` and reads the states of the blocks this rank owns
  /// with `read_block(block index)`; changes nothing.
  std::shared_ptr<PreparedLoad> prepare(
      torch::serialize::InputArchive& archive, const std::function<BlockState(int64_t)>& read_block,
      const std::vector<torch::optim::OptimizerParamGroup>& groups);
  /// Reads the states of the blocks this rank owns into `prepared`'s new virtual groups.
  void read_block_states(PreparedLoad& prepared,
                         const std::function<BlockState(int64_t)>& read_block,
                         const std::vector<torch::optim::OptimizerParamGroup>& groups);
  /// Installs a prepared load into `engine` (does not throw).
  static void install(ShampooEngine& engine, PreparedLoad& prepared,
                      std::vector<torch::optim::OptimizerParamGroup>& groups);

  ShampooEngine* engine_;
};

}  // namespace shampoo::detail
