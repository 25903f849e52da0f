// DistributedShampoo in checkpoints: DistributedShampoo::Checkpoint, the object its
// checkpoint_delegate() and portable_delegate() return (world-size-independent checkpoint
// directories: one piece per block; whole-run checkpoints by parameter name), over the engine's
// checkpoint (shampoo/checkpoint.cpp).
#include "shampoo/distributed_shampoo_checkpoint.h"

#include "shampoo/engine_checkpoint.h"
#include "shampoo/shampoo_engine.h"

namespace shampoo {

std::vector<const torch::optim::OptimizerParamGroup*>
DistributedShampoo::Checkpoint::portable_groups() const {
  auto& o = *owner_;
  o.sync_groups_and_state();
  return detail::groups_of(o);
}

int64_t DistributedShampoo::Checkpoint::portable_param_step(const at::Tensor& param) const {
  auto& o = *owner_;
  const auto index = o.engine_->groups().param_index(param);
  if (index < 0) return -1;
  const auto& front = o.engine_->groups();
  return front.group_steps.at(
      static_cast<size_t>(front.registry.params.at(static_cast<size_t>(index)).group));
}

void DistributedShampoo::Checkpoint::save_portable_pieces(PieceWriter& pieces,
                                                          const PortableSave& save) const {
  auto& o = *owner_;
  if (!detail::EngineCheckpoint(*o.engine_).writes_pieces()) return;
  // Every rank knows the groups' step counts: rank 0 writes them, each owner its blocks.
  std::vector<at::Tensor> heads;
  if (o.engine_->rank() == 0) {
    for (const auto& group : o.param_groups_) {
      heads.insert(heads.end(), group.params().begin(), group.params().end());
    }
  }
  detail::save_param_states(o, heads, pieces, save.names, "DistributedShampoo: ");
}

std::function<void()> DistributedShampoo::Checkpoint::prepare_portable_load(
    const PortableLoad& load) {
  auto& o = *owner_;
  o.sync_groups_and_state();
  auto install_options = detail::EngineCheckpoint(*o.engine_)
                             .prepare_saved_options(load.group_options, o.param_groups_);
  auto install_states =
      detail::prepare_param_states(o, *load.pieces, load.names, "DistributedShampoo: ");
  return [self = owner_, install_options, install_states] {
    install_states();
    install_options();
    self->engine_->groups().write_state_entries(self->state_);
  };
}

c10::intrusive_ptr<c10d::ProcessGroup> DistributedShampoo::Checkpoint::checkpoint_group() const {
  return owner_->engine_->distributed_options().process_group();
}

void DistributedShampoo::Checkpoint::sync_for_checkpoint() const {
  owner_->sync_groups_and_state();
}

void DistributedShampoo::Checkpoint::save_common(torch::serialize::OutputArchive& common) const {
  auto& o = *owner_;
  detail::EngineCheckpoint(*o.engine_).save_common(common, o.param_groups_);
}

void DistributedShampoo::Checkpoint::save_pieces(PieceWriter& pieces) const {
  detail::EngineCheckpoint(*owner_->engine_).save_pieces(pieces);
}

std::function<void()> DistributedShampoo::Checkpoint::prepare_load(
    torch::serialize::InputArchive& common, PieceReader& pieces) {
  auto& o = *owner_;
  auto install = detail::EngineCheckpoint(*o.engine_).prepare_load(common, pieces, o.param_groups_);
  return [self = owner_, install = std::move(install)] {
    install();
    self->engine_->groups().write_state_entries(self->state_);
  };
}

void DistributedShampoo::Checkpoint::save_block_pieces(PieceWriter& pieces,
                                                       const BlockPieceName& name_of) const {
  auto& engine = *owner_->engine_;
  const auto& params = engine.groups().registry.params;
  detail::EngineCheckpoint(engine).save_block_pieces(pieces, [&](const BlockId& id) {
    return name_of(params.at(static_cast<size_t>(id.param)).param, id.block);
  });
}

std::function<void()> DistributedShampoo::Checkpoint::prepare_block_load(
    PieceReader& pieces, const BlockPieceName& name_of, std::vector<int64_t> group_steps,
    std::vector<double> group_lr_sums, std::optional<bool> eval_mode) {
  auto& o = *owner_;
  o.sync_groups_and_state();
  const auto& params = o.engine_->groups().registry.params;
  auto install =
      detail::EngineCheckpoint(*o.engine_)
          .prepare_block_load(
              pieces,
              [&](const BlockId& id) {
                return name_of(params.at(static_cast<size_t>(id.param)).param, id.block);
              },
              std::move(group_steps), std::move(group_lr_sums), eval_mode, o.param_groups_);
  return [self = owner_, install] {
    install();
    self->engine_->groups().write_state_entries(self->state_);
  };
}

DistributedCheckpointable& DistributedShampoo::checkpoint_delegate() const { return *checkpoint_; }

PortableCheckpointable& DistributedShampoo::portable_delegate() const { return *checkpoint_; }

}  // namespace shampoo
