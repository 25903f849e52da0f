#pragma once
/// Dynamic loss scaling for fp16 mixed precision, with the semantics of PyTorch's
/// torch.amp.GradScaler (LibTorch has none), for any torch::optim optimizer, sharded ones
/// included.
///
///   shampoo::GradScaler scaler(shampoo::GradScalerOptions().process_group(group));
///   for (...) {
///     optimizer.zero_grad();
///     at::Tensor loss;
///     {
///       shampoo::AutocastGuard autocast(at::kCUDA, at::kHalf);
///       loss = loss_fn(model->forward(x), y);
///     }
///     scaler.scale(loss).backward();
///     sync.synchronize();
///     scaler.unscale_(optimizer);       // optional: clip the true gradients next
///     sync.clip_grad_norm_(1.0);
///     scaler.step(optimizer);           // skipped when a gradient is inf or NaN
///     scaler.update();                  // backs off after a skip, grows after clean steps
///   }
///
/// The scale starts at init_scale (2^16), is multiplied by backoff_factor (0.5) after every
/// iteration with an inf or NaN gradient and by growth_factor (2.0) after growth_interval (2000)
/// clean iterations in a row. The ATen kernels of torch.amp do the work
/// (_amp_foreach_non_finite_check_and_unscale_, _amp_update_scale_).
///
/// Sharded: with a process group, the found-inf flag is summed over the ranks (one all-reduce of
/// one scalar per unscale_), so every rank skips together even when only one rank holds the
/// overflowing gradient (gradient sharding, ZeRO-2; or different gradients per rank).
///
/// bf16: bfloat16 has float32's exponent range, so bf16 training needs no loss scaling; use
/// enabled(false) (the trainer does for --amp bf16), which makes every method a pass-through.
/// An enabled scaler given bf16 gradients unscales and checks them like float32 ones (on CUDA,
/// where ATen's kernel has no bf16 in torch 2.11, by a multiply and a finiteness check). fp16
/// gradients (fp16 parameters) are refused, as in PyTorch: scaling is for float32 parameters
/// whose forward runs in fp16 under autocast.

#include <ATen/ATen.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "parallel/checkpoints/distributed_checkpoint.h"
#include "parallel/optimizers/loss_scaling.h"

namespace shampoo {

struct GradScalerOptions {
  /// The first scale (PyTorch's default 2^16).
  TORCH_ARG(double, init_scale) = 65536.0;
  /// Factor after growth_interval clean iterations in a row; > 1.
  TORCH_ARG(double, growth_factor) = 2.0;
  /// Factor after an iteration with an inf or NaN gradient; in (0, 1).
  TORCH_ARG(double, backoff_factor) = 0.5;
  /// Clean iterations in a row before the scale grows; >= 1.
  TORCH_ARG(int64_t, growth_interval) = 2000;
  /// false: scale() returns the loss, step() steps, update() and unscale_() do nothing.
  TORCH_ARG(bool, enabled) = true;
  /// Ranks whose found-inf flags are combined (null: this process alone).
  TORCH_ARG(c10::intrusive_ptr<c10d::ProcessGroup>, process_group) = {};

 public:
  /// Every field equal (the process group by identity).
  bool operator==(const GradScalerOptions&) const = default;
};

class GradScaler : public BackwardUnscaler {
  /// A ScaledStepping wrapper that is not a torch::optim::Optimizer (those take the optimizer
  /// overloads, which find the wrapper themselves).
  template <class T>
  static constexpr bool is_plain_wrapper =
      std::is_base_of_v<ScaledStepping, T> && !std::is_base_of_v<torch::optim::Optimizer, T>;

 public:
  explicit GradScaler(GradScalerOptions options = {});

  /// loss × scale (the scale is created on the loss's device at the first call).
  at::Tensor scale(const at::Tensor& loss);

  /// Divides the gradients of `optimizer`'s parameters by the scale and records whether any is
  /// inf or NaN (summed over the process group). At most once per optimizer between update()s;
  /// not after step(). Errors: a second call, gradients on another device than the scale,
  /// fp16 gradients, no scale() yet.
  void unscale_(torch::optim::Optimizer& optimizer);

  /// Unscales (unless unscale_ ran) and steps `optimizer` unless a gradient was inf or NaN on
  /// any rank; returns the optimizer's result (undefined when skipped). Once per optimizer
  /// between update()s.
  at::Tensor step(torch::optim::Optimizer& optimizer,
                  torch::optim::Optimizer::LossClosure closure = nullptr);

  /// The same for a wrapper that is no optimizer (ScaledStepping): for a fully sharded model
  /// stepped after backward (FullyShardedOptions().overlap_step(false)) its reduced gradients are
  /// unscaled, and step() runs fsdp.step(), or fsdp.skip_step() when any rank found inf or NaN.
  /// With overlap_step an error (the steps run in backward, before every gradient is known to be
  /// finite). An optimizer that is such a wrapper (fsdp.optimizer()) goes the same way.
  template <class Wrapper, std::enable_if_t<is_plain_wrapper<Wrapper>, int> = 0>
  void unscale_(Wrapper& wrapper) {
    unscale_wrapper(wrapper.scaling_target());
  }
  template <class Wrapper, std::enable_if_t<is_plain_wrapper<Wrapper>, int> = 0>
  void step(Wrapper& wrapper) {
    step_wrapper(wrapper.scaling_target());
  }

  /// Ends the iteration: backs off when a step was skipped, grows after growth_interval clean
  /// iterations (or sets `new_scale`). An error when no optimizer was stepped or unscaled since
  /// the last update() (and no in-backward pass stepped).
  void update(std::optional<double> new_scale = std::nullopt);

  /// Optimizer-in-backward: every set of gradients is unscaled as it becomes ready, and a pass
  /// in which any rank finds inf or NaN is undone on every rank and counts as a skipped step
  /// (then call update() as usual). Refused for optimizers that cannot undo a step (LibTorch's;
  /// DistributedShampoo can). The scaler must outlive the attachment (or detach()).
  void attach(ScaledStepping& optimizer);
  void detach(ScaledStepping& optimizer);

  bool is_enabled() const { return options_.enabled(); }
  /// The current scale (init_scale before the first scale()); 1 when disabled.
  double get_scale() const;
  /// Clean iterations in a row since the last growth or backoff.
  int64_t growth_tracker() const;
  /// Steps skipped (iterations with inf or NaN) since construction or the last load.
  int64_t skipped_steps() const { return skipped_; }
  const GradScalerOptions& options() const { return options_; }

  /// The scale, growth tracker, factors and interval, and the skipped-step count. torch::save /
  /// torch::load work (operators below). Loading into a disabled scaler is a no-op, as in
  /// PyTorch; an archive without a scaler's state is an error.
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);
  /// Reads and checks `archive` as load() would, changing nothing; returns what loads it (which
  /// then does not throw). For checkpoints that install all their parts or none.
  std::function<void()> prepare_load(std::shared_ptr<torch::serialize::InputArchive> archive);

  /// BackwardUnscaler (through attach).
  bool unscale_ready(const std::vector<at::Tensor>& params) override;
  bool pass_overflowed(bool found_here) override;

 private:
  enum class Stage { kReady, kUnscaled, kStepped };
  struct OptimizerState {
    Stage stage = Stage::kReady;
    at::Tensor found_inf;  // float32 scalar on the scale's device, summed over the ranks
  };
  void check_started(const char* function) const;
  void unscale_wrapper(ScaledStepping& wrapper);
  void step_wrapper(ScaledStepping& wrapper);
  /// unscale_'s work for the optimizer or model `key` and its gradients.
  void unscale_for(const void* key, const std::vector<at::Tensor>& grads);
  /// step's checks for `key`; unscales (unscale()) unless done; steps (step()) unless a gradient
  /// was inf or NaN, else skip(); returns whether it stepped.
  bool step_unless_inf(const void* key, const std::function<void()>& unscale,
                       const std::function<void()>& step, const std::function<void()>& skip);
  /// found_inf += (any of `grads` is inf or NaN); grads *= inv_scale.
  void unscale_grads(const std::vector<at::Tensor>& grads, at::Tensor& found_inf,
                     const at::Tensor& inv_scale, const char* function) const;
  /// Sums `found_inf` over the process group.
  void combine(at::Tensor& found_inf) const;

  GradScalerOptions options_;
  at::Tensor scale_;           // float32 scalar, created by the first scale()
  at::Tensor growth_tracker_;  // int32 scalar
  double pending_scale_;       // the scale before scale_ exists (init, or loaded)
  int64_t pending_tracker_ = 0;
  int64_t skipped_ = 0;
  std::unordered_map<const void*, OptimizerState> states_;  // per optimizer, this iteration
  at::Tensor pass_found_inf_;  // in-backward: this pass's flag (this rank)
};

torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const GradScaler& scaler);
torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                           GradScaler& scaler);

/// World-size-independent checkpoints of an optimizer together with its scaler (the scaler's
/// state, equal on every rank, goes into the common part). A checkpoint written with a scaler
/// must be loaded with one, and one written without a scaler without; the other way round is an
/// error that says so.
void save_distributed_checkpoint(const torch::optim::Optimizer& optimizer, const GradScaler& scaler,
                                 const std::filesystem::path& dir,
                                 c10::intrusive_ptr<c10d::ProcessGroup> group = {});
void load_distributed_checkpoint(torch::optim::Optimizer& optimizer, GradScaler& scaler,
                                 const std::filesystem::path& dir,
                                 c10::intrusive_ptr<c10d::ProcessGroup> group = {});

}  // namespace shampoo
