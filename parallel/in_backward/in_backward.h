#pragma once
/// Optimizer-in-backward: each parameter's optimizer steps as soon as its gradient has been
/// accumulated during loss.backward(), and the gradient is released right after, so gradients
/// never all live at once. Works for torch::optim's SGD, Adam, AdamW, Adagrad, RMSprop (any
/// optimizer that steps the parameters with a gradient) and for the optimizers that step in
/// phases (DistributedShampoo, ShardedOptimizer): DistributedShampoo's local block work then
/// happens during backward and its one AllGather runs at the end of backward.
///
///   auto opt = shampoo::apply_optimizer_in_backward(embedding_a, [](std::vector<torch::Tensor> p)
///   {
///     return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.02)); });
///   opt.add(dense, [](std::vector<torch::Tensor> p) {
///     return std::make_unique<torch::optim::Adagrad>(p, torch::optim::AdagradOptions(0.006)); });
///   loss.backward();   // steps happen here; no opt.step()

#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <functional>
#include <memory>
#include <vector>

#include "parallel/checkpoints/distributed_checkpoint.h"
#include "parallel/data_parallel/gradient_synchronizer.h"
#include "parallel/optimizers/loss_scaling.h"
#include "parallel/optimizers/optimizer_factory.h"
#include "parallel/optimizers/portable_checkpoint.h"

namespace shampoo {
class InBackwardOptimizer : public torch::optim::Optimizer,
                            public DelegatingCheckpointable,
                            public ScaledStepping,
                            public DelegatingPortable {
 public:
  InBackwardOptimizer();
  ~InBackwardOptimizer() override;
  InBackwardOptimizer(InBackwardOptimizer&&) noexcept;
  InBackwardOptimizer& operator=(InBackwardOptimizer&&) noexcept;

  /// Registers `params` with the optimizer factory(params) and returns it. Errors: a parameter
  /// already registered (here or twice in `params`), one that does not require grad or is not a
  /// leaf.
  torch::optim::Optimizer& add(std::vector<torch::Tensor> params, OptimizerFactory factory);

  /// Always an error: the steps run during backward.
  torch::Tensor step(LossClosure closure = nullptr) override;

  /// The optimizers, in the order the sets were added (change lr, attach schedulers here).
  size_t num_optimizers() const;
  torch::optim::Optimizer& optimizer(size_t index);

  /// Gradient accumulation: step on every k-th backward pass (k micro-batches), equal to an
  /// ordinary step on the accumulated gradients.
  void set_accumulation_steps(int64_t k);
  /// While alive, backward passes only accumulate gradients (no step, gradients kept).
  class NoStep {
   public:
    explicit NoStep(InBackwardOptimizer& owner);
    ~NoStep();

   private:
    InBackwardOptimizer& owner_;
  };

  /// Data-parallel training: gradients are averaged by `sync` and each bucket's parameters step
  /// as soon as that bucket's all-reduce has finished, overlapping the rest of backward; the
  /// remaining buckets finish at the end of backward. The synchronizer must outlive this.
  void attach(GradientSynchronizer& sync);

  /// Who steps what (gradient sharding, sync.shard_gradients(in_backward_optimizer), asks it): a
  /// parameter of a set whose optimizer owns a subset of its parameters (ShardedOptimizer,
  /// DistributedShampoo) has that optimizer's owner; the parameters of LibTorch optimizers are
  /// stepped on every rank (-1). The sets' process groups must be one and the same.
  c10::intrusive_ptr<c10d::ProcessGroup> owners_group() const;
  std::optional<int> owner_of(const at::Tensor& param) const;

  /// Mixed precision (GradScaler::attach(in_backward) calls this): every set of gradients is
  /// unscaled before it steps; after a gradient with inf or NaN (on any rank) the rest of the
  /// pass does not step and, at the end of backward, every rank undoes the steps the pass took,
  /// so parameters and state are as before it (the scaler then records a skipped step). Every
  /// optimizer must be able to undo a step: one that steps in phases (DistributedShampoo);
  /// LibTorch's optimizers step for good and are refused, naming the set. Null detaches.
  void set_unscaler(BackwardUnscaler* unscaler);

  /// ScaledStepping: GradScaler::attach calls set_unscaler; GradScaler::unscale_ and step are
  /// errors that say to attach the scaler (the steps run in backward).
  void set_backward_unscaler(BackwardUnscaler* unscaler) override { set_unscaler(unscaler); }
  std::vector<at::Tensor> gradients_to_unscale(const char* caller) override;

  /// state(): an entry per parameter (ShardedParamState: the steps taken since it was added,
  /// the rank that steps it, -1 when every rank does); the optimizers'
  /// own state stays in optimizer(i).
  /// Backward passes seen, and those that stepped.
  int64_t backward_passes() const;
  int64_t steps_taken() const;

  /// Saves / loads every optimizer (torch::save(opt, path) and torch::load(opt, path) work).
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // World-size-independent checkpoints (save_distributed_checkpoint; DistributedCheckpointable):
  // optimizers that support them (DistributedShampoo, ShardedOptimizer) save their pieces under
  // "optimizer_<i>/"; LibTorch's optimizers, which hold the same state on every rank, are saved
  // once, by rank 0. Their process groups must be one and the same (or null); with none, the
  // process group of the attached GradientSynchronizer (data parallelism), or one process.
  // Whole-run checkpoints that any layout loads (save_training_checkpoint;
  // PortableCheckpointable, parallel/optimizers/portable_checkpoint.h): the sets' param groups in
  // order, each set's optimizer saved by parameter name (LibTorch's by rank 0); supported when
  // every set's optimizer saves its state by parameter (DistributedShampoo, ShardedOptimizer,
  // LibTorch's SGD, Adam, AdamW, Adagrad, RMSprop). Both interfaces are answered by an internal
  // object (InBackwardOptimizer::Checkpoint, in_backward_checkpoint.h).

 protected:
  DistributedCheckpointable& checkpoint_delegate() const override;
  PortableCheckpointable& portable_delegate() const override;

 private:
  struct State;
  struct Interfaces;  // the adapters and the lookup it registers (capabilities.h)
  class Checkpoint;   // its checkpoints (in_backward_checkpoint.h)
  std::shared_ptr<State> state_;
  std::unique_ptr<Interfaces> interfaces_;
  std::unique_ptr<Checkpoint> checkpoint_;
};

/// An InBackwardOptimizer holding one set: `params` with the optimizer factory(params).
InBackwardOptimizer apply_optimizer_in_backward(std::vector<torch::Tensor> params,
                                                OptimizerFactory factory);

}  // namespace shampoo
