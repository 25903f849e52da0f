#include "amp/grad_scaler.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/serialize.h>

#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>

#include "parallel/communication/collectives.h"
#include "parallel/optimizers/capabilities.h"

namespace shampoo {
namespace {

constexpr int64_t kFormat = 1;
const char* const kFormatKey = "grad_scaler_format";

c10::IValue read_entry(torch::serialize::InputArchive& archive, const std::string& key) {
  c10::IValue value;
  TORCH_CHECK(archive.try_read(key, value), "GradScaler::load: entry '", key,
              "' is missing (a damaged GradScaler state)");
  return value;
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options)
    : options_(std::move(options)), pending_scale_(options_.init_scale()) {
  TORCH_CHECK(std::isfinite(options_.init_scale()) && options_.init_scale() > 0.0,
              "GradScalerOptions.init_scale: got ", options_.init_scale(),
              ", expected a finite value > 0");
  TORCH_CHECK(options_.growth_factor() > 1.0 && std::isfinite(options_.growth_factor()),
              "GradScalerOptions.growth_factor: got ", options_.growth_factor(),
              ", expected a finite value > 1");
  TORCH_CHECK(options_.backoff_factor() > 0.0 && options_.backoff_factor() < 1.0,
              "GradScalerOptions.backoff_factor: got ", options_.backoff_factor(),
              ", expected a value in (0, 1)");
  TORCH_CHECK(options_.growth_interval() >= 1 &&
                  options_.growth_interval() <= std::numeric_limits<int32_t>::max(),
              "GradScalerOptions.growth_interval: got ", options_.growth_interval(),
              ", expected >= 1");
}

void GradScaler::check_started(const char* function) const {
  TORCH_CHECK(scale_.defined(), "GradScaler::", function,
              ": no scale yet; call scaler.scale(loss).backward() first in the iteration");
}

at::Tensor GradScaler::scale(const at::Tensor& loss) {
  if (!options_.enabled()) return loss;
  TORCH_CHECK(loss.defined(), "GradScaler::scale: the loss is an undefined tensor");
  if (!scale_.defined()) {
    const auto options = at::TensorOptions().device(loss.device());
    scale_ = at::full({}, pending_scale_, options.dtype(at::kFloat));
    growth_tracker_ = at::full({}, pending_tracker_, options.dtype(at::kInt));
  }
  TORCH_CHECK(loss.device() == scale_.device(), "GradScaler::scale: the loss is on ", loss.device(),
              ", the scale on ", scale_.device(),
              " (where the first loss was); a GradScaler serves one device");
  return loss * scale_;
}

void GradScaler::unscale_grads(const std::vector<at::Tensor>& grads, at::Tensor& found_inf,
                               const at::Tensor& inv_scale, const char* function) const {
  std::map<int, std::vector<at::Tensor>> by_dtype;
  for (const auto& g : grads) {
    TORCH_CHECK(g.device() == scale_.device(), "GradScaler::", function, ": a gradient is on ",
                g.device(), ", the scale on ", scale_.device(),
                "; a GradScaler serves gradients of one device (the loss's): gradients of mixed "
                "devices need one scaler per device");
    TORCH_CHECK(g.scalar_type() != at::kHalf, "GradScaler::", function,
                ": attempting to unscale fp16 gradients (of fp16 parameters); loss scaling is "
                "for float32 parameters whose forward runs in fp16 under autocast (as in "
                "PyTorch's GradScaler). Keep the parameters in float32, or train fp16 "
                "parameters without a scaler");
    TORCH_CHECK(g.layout() == at::kStrided, "GradScaler::", function,
                ": sparse gradients are not supported");
    by_dtype[static_cast<int>(g.scalar_type())].push_back(g);
  }
  for (auto& [dtype, list] : by_dtype) {
    if (static_cast<at::ScalarType>(dtype) == at::kBFloat16 && scale_.is_cuda()) {
      // ATen's CUDA kernel has no bf16 (torch 2.11): the same result by a check and a multiply.
      for (auto& g : list) {
        const auto bad = at::logical_not(at::isfinite(g)).any().to(at::kFloat);
        found_inf.copy_(at::maximum(found_inf, bad));
        g.mul_(inv_scale);
      }
    } else {
      at::_amp_foreach_non_finite_check_and_unscale_(list, found_inf, inv_scale);
    }
  }
}

void GradScaler::combine(at::Tensor& found_inf) const {
  const auto& group = options_.process_group();
  if (!group || group->getSize() == 1) return;
  std::vector<at::Tensor> tensors{found_inf};
  detail::start_all_reduce(*group, tensors)->wait();
}

void GradScaler::unscale_for(const void* key, const std::vector<at::Tensor>& grads) {
  check_started("unscale_");
  auto& state = states_[key];
  TORCH_CHECK(state.stage != Stage::kUnscaled,
              "GradScaler::unscale_: unscale_() has already been called on this optimizer since "
              "the last update(); the gradients are unscaled once per iteration");
  TORCH_CHECK(state.stage != Stage::kStepped,
              "GradScaler::unscale_: called after step() for this optimizer in the same "
              "iteration; call update() first");
  at::NoGradGuard no_grad;
  const auto inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
  auto found_inf = at::zeros({}, scale_.options());
  unscale_grads(grads, found_inf, inv_scale, "unscale_");
  combine(found_inf);
  state.found_inf = found_inf;
  state.stage = Stage::kUnscaled;
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled()) return;
  if (auto* wrapper = detail::capabilities_of(optimizer).scaled) {
    unscale_wrapper(wrapper->scaling_target());
    return;
  }
  std::vector<at::Tensor> grads;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (p.grad().defined()) grads.push_back(p.mutable_grad());
    }
  }
  unscale_for(&optimizer, grads);
}


void GradScaler::unscale_wrapper(ScaledStepping& wrapper) {
  if (!options_.enabled()) return;
  unscale_for(&wrapper, wrapper.gradients_to_unscale("GradScaler::unscale_"));
}

bool GradScaler::step_unless_inf(const void* key, const std::function<void()>& unscale,
                                 const std::function<void()>& step,
                                 const std::function<void()>& skip) {
  check_started("step");
  TORCH_CHECK(states_[key].stage != Stage::kStepped,
              "GradScaler::step: step() has already been called for this optimizer since the "
              "last update()");
  if (states_[key].stage == Stage::kReady) unscale();
  auto& unscaled = states_[key];
  const bool finite = unscaled.found_inf.item<float>() == 0.0f;
  if (finite) {
    step();
  } else {
    ++skipped_;
    skip();
  }
  unscaled.stage = Stage::kStepped;
  return finite;
}

at::Tensor GradScaler::step(torch::optim::Optimizer& optimizer,
                            torch::optim::Optimizer::LossClosure closure) {
  if (!options_.enabled()) return optimizer.step(std::move(closure));
  if (auto* wrapper = detail::capabilities_of(optimizer).scaled) {
    TORCH_CHECK(!closure, "GradScaler::step: a closure is not supported while the scaler is "
                "enabled (as in PyTorch): run forward and backward before step()");
    step_wrapper(wrapper->scaling_target());
    return {};
  }
  TORCH_CHECK(!closure,
              "GradScaler::step: a closure is not supported while the scaler is "
              "enabled (as in PyTorch): run forward and backward before step()");
  at::Tensor result;
  step_unless_inf(
      &optimizer, [&] { unscale_(optimizer); }, [&] { result = optimizer.step(); }, [] {});
  return result;
}

void GradScaler::step_wrapper(ScaledStepping& wrapper) {
  if (!options_.enabled()) {  // a no-op scaler: the step as without it
    wrapper.unscaled_step();
    return;
  }
  // Asked first, so that a wrapper that cannot be scaled says so before anything else.
  std::vector<at::Tensor> grads;
  const auto it = states_.find(&wrapper);
  if (it == states_.end() || it->second.stage == Stage::kReady) {
    grads = wrapper.gradients_to_unscale("GradScaler::step");
  }
  step_unless_inf(
      &wrapper, [&] { unscale_for(&wrapper, grads); }, [&] { wrapper.scaled_step(); },
      [&] { wrapper.skip_scaled_step(); });
}

void GradScaler::update(std::optional<double> new_scale) {
  if (!options_.enabled()) return;
  check_started("update");
  if (new_scale.has_value()) {
    TORCH_CHECK(std::isfinite(*new_scale) && *new_scale > 0.0,
                "GradScaler::update: new_scale: got ", *new_scale, ", expected a finite value > 0");
    scale_.fill_(*new_scale);
  } else {
    at::Tensor combined;
    for (auto& [key, state] : states_) {
      if (!state.found_inf.defined()) continue;
      combined = combined.defined() ? combined + state.found_inf : state.found_inf.clone();
    }
    TORCH_CHECK(combined.defined(),
                "GradScaler::update: no optimizer was stepped (or unscaled) since the last "
                "update(): call scaler.step(optimizer) before scaler.update() in every iteration");
    at::_amp_update_scale_(scale_, growth_tracker_, combined, options_.growth_factor(),
                           options_.backoff_factor(), options_.growth_interval());
  }
  states_.clear();
}

double GradScaler::get_scale() const {
  if (!options_.enabled()) return 1.0;
  return scale_.defined() ? scale_.item<double>() : pending_scale_;
}

int64_t GradScaler::growth_tracker() const {
  if (!options_.enabled()) return 0;
  return growth_tracker_.defined() ? growth_tracker_.item<int64_t>() : pending_tracker_;
}

void GradScaler::attach(ScaledStepping& optimizer) { optimizer.set_backward_unscaler(this); }

void GradScaler::detach(ScaledStepping& optimizer) { optimizer.set_backward_unscaler(nullptr); }

bool GradScaler::unscale_ready(const std::vector<at::Tensor>& params) {
  if (!options_.enabled()) return true;
  check_started("unscale (in backward)");
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (const auto& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  if (grads.empty()) return true;
  const auto inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
  auto found_inf = at::zeros({}, scale_.options());
  unscale_grads(grads, found_inf, inv_scale, "unscale (in backward)");
  return found_inf.item<float>() == 0.0f;
}

bool GradScaler::pass_overflowed(bool found_here) {
  if (!options_.enabled()) return false;
  check_started("step (in backward)");
  // One entry for every in-backward pass: its key is the scaler's own flag.
  auto& state = states_[&pass_found_inf_];
  TORCH_CHECK(state.stage != Stage::kStepped,
              "GradScaler: a second backward pass stepped since the last update(); call "
              "scaler.update() after every backward that steps");
  pass_found_inf_ = at::full({}, found_here ? 1.0 : 0.0, scale_.options());
  combine(pass_found_inf_);
  state.found_inf = pass_found_inf_;
  state.stage = Stage::kStepped;
  const bool overflowed = pass_found_inf_.item<float>() != 0.0f;
  if (overflowed) ++skipped_;
  return overflowed;
}

void GradScaler::save(torch::serialize::OutputArchive& archive) const {
  archive.write(kFormatKey, c10::IValue(kFormat));
  archive.write("enabled", c10::IValue(options_.enabled()));
  archive.write("scale", c10::IValue(get_scale()));
  archive.write("growth_factor", c10::IValue(options_.growth_factor()));
  archive.write("backoff_factor", c10::IValue(options_.backoff_factor()));
  archive.write("growth_interval", c10::IValue(options_.growth_interval()));
  archive.write("growth_tracker", c10::IValue(growth_tracker()));
  archive.write("skipped_steps", c10::IValue(skipped_));
}

void GradScaler::load(torch::serialize::InputArchive& archive) {
  c10::IValue format;
  TORCH_CHECK(archive.try_read(kFormatKey, format) && format.isInt(),
              "GradScaler::load: this archive holds no GradScaler state (no '", kFormatKey,
              "' entry)");
  TORCH_CHECK(format.toInt() == kFormat, "GradScaler::load: format ", format.toInt(),
              " is not supported (expected ", kFormat, ")");
  if (!options_.enabled()) return;  // as PyTorch's load_state_dict
  TORCH_CHECK(read_entry(archive, "enabled").toBool(),
              "GradScaler::load: the state was saved by a disabled GradScaler, which has no scale; "
              "this one is enabled");
  const double scale = read_entry(archive, "scale").toDouble();
  const double growth = read_entry(archive, "growth_factor").toDouble();
  const double backoff = read_entry(archive, "backoff_factor").toDouble();
  const int64_t interval = read_entry(archive, "growth_interval").toInt();
  const int64_t tracker = read_entry(archive, "growth_tracker").toInt();
  const int64_t skipped = read_entry(archive, "skipped_steps").toInt();
  // Checked as the constructor checks its options (a damaged file fails here, changing nothing).
  const GradScaler validated(GradScalerOptions(options_)
                                 .init_scale(scale)
                                 .growth_factor(growth)
                                 .backoff_factor(backoff)
                                 .growth_interval(interval));
  (void)validated;
  options_.growth_factor(growth).backoff_factor(backoff).growth_interval(interval);
  pending_scale_ = scale;
  pending_tracker_ = tracker;
  if (scale_.defined()) {
    scale_.fill_(scale);
    growth_tracker_.fill_(tracker);
  }
  skipped_ = skipped;
  states_.clear();
}

std::function<void()> GradScaler::prepare_load(
    std::shared_ptr<torch::serialize::InputArchive> archive) {
  GradScaler check(options_);  // reads and checks, changing nothing here
  check.load(*archive);
  return [this, archive] { load(*archive); };
}

torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive,
                                            const GradScaler& scaler) {
  scaler.save(archive);
  return archive;
}

torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive,
                                           GradScaler& scaler) {
  scaler.load(archive);
  return archive;
}

namespace {

/// An optimizer and its scaler as one world-size-independent checkpoint: the optimizer's common
/// part and pieces, and the scaler's state (the same on every rank) in the common part.
class OptimizerWithScaler final : public DistributedCheckpointable {
 public:
  OptimizerWithScaler(DistributedCheckpointable& optimizer, GradScaler& scaler)
      : optimizer_(optimizer), scaler_(scaler) {}

  std::string checkpoint_kind() const override {
    return optimizer_.checkpoint_kind() + detail::kWithGradScalerSuffix;
  }
  c10::intrusive_ptr<c10d::ProcessGroup> checkpoint_group() const override {
    return optimizer_.checkpoint_group();
  }
  void sync_for_checkpoint() const override { optimizer_.sync_for_checkpoint(); }
  void save_common(torch::serialize::OutputArchive& common) const override {
    optimizer_.save_common(common);
    torch::serialize::OutputArchive scaler;
    scaler_.save(scaler);
    common.write("grad_scaler", scaler);
  }
  void save_pieces(PieceWriter& pieces) const override { optimizer_.save_pieces(pieces); }
  std::function<void()> prepare_load(torch::serialize::InputArchive& common,
                                     PieceReader& pieces) override {
    auto archive = std::make_shared<torch::serialize::InputArchive>();
    TORCH_CHECK(common.try_read("grad_scaler", *archive),
                "load_distributed_checkpoint: the checkpoint has no GradScaler state");
    auto install_scaler = scaler_.prepare_load(archive);
    auto install = optimizer_.prepare_load(common, pieces);
    return [install, install_scaler] {
      install();
      install_scaler();
    };
  }

 private:
  DistributedCheckpointable& optimizer_;
  GradScaler& scaler_;
};

}  // namespace

void save_distributed_checkpoint(const torch::optim::Optimizer& optimizer, const GradScaler& scaler,
                                 const std::filesystem::path& dir,
                                 c10::intrusive_ptr<c10d::ProcessGroup> group) {
  OptimizerWithScaler both(detail::checkpointable(optimizer, "save_distributed_checkpoint"),
                           const_cast<GradScaler&>(scaler));
  save_distributed_state(both, dir, std::move(group));
}

void load_distributed_checkpoint(torch::optim::Optimizer& optimizer, GradScaler& scaler,
                                 const std::filesystem::path& dir,
                                 c10::intrusive_ptr<c10d::ProcessGroup> group) {
  OptimizerWithScaler both(detail::checkpointable(optimizer, "load_distributed_checkpoint"),
                           scaler);
  load_distributed_state(both, dir, std::move(group));
}

}  // namespace shampoo
