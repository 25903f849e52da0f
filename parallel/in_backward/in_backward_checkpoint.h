#pragma once
/// Optimizer-in-backward in checkpoints (InBackwardOptimizer::Checkpoint, its
/// checkpoint_delegate() and portable_delegate()): world-size-independent checkpoint directories
/// and whole-run checkpoints by parameter name, over the sets' optimizers. Internal: not installed.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "parallel/in_backward/in_backward_state.h"

namespace shampoo {

class InBackwardOptimizer::Checkpoint final : public DistributedCheckpointable,
                                              public PortableCheckpointable {
 public:
  explicit Checkpoint(std::shared_ptr<State> state) : state_(std::move(state)) {}

  std::string checkpoint_kind() const override { return "InBackwardOptimizer"; }
  c10::intrusive_ptr<c10d::ProcessGroup> checkpoint_group() const override;
  void sync_for_checkpoint() const override;
  void save_common(torch::serialize::OutputArchive& common) const override;
  void save_pieces(PieceWriter& pieces) const override;
  std::function<void()> prepare_load(torch::serialize::InputArchive& common,
                                     PieceReader& pieces) override;

  std::vector<const torch::optim::OptimizerParamGroup*> portable_groups() const override;
  int64_t portable_param_step(const at::Tensor& param) const override;
  bool portable_supported() const override;
  void save_portable_pieces(PieceWriter& pieces, const PortableSave& save) const override;
  void save_portable_layout(torch::serialize::OutputArchive& layout) const override;
  std::function<void()> prepare_portable_load(const PortableLoad& load) override;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace shampoo
