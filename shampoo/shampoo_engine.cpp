#include "shampoo/shampoo_engine.h"

#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/generated/variable_factories.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "shampoo/option_fields.h"
#include "shampoo/param_updates.h"
#include "shampoo/rank_agreement.h"
#include "shampoo/step_scalars.h"

namespace shampoo::detail {

namespace {

/// `distributed`, validated after `defaults` (the order in which their errors are reported).
DistributedOptions validated(const ShampooOptions& defaults, DistributedOptions distributed) {
  defaults.validate();
  distributed.validate();
  return distributed;
}

std::unique_ptr<Distributor> make_distributor(const DistributedOptions& distributed) {
  check_distributed_options_agree(distributed);  // before the Distributor's own collectives
  DistributorConfig config;
  config.process_group = distributed.process_group();
  config.communication_dtype = distributed.communication_dtype();
  config.num_trainers_per_group = distributed.num_trainers_per_group();
  config.communicate_params = distributed.communicate_params();
  config.shard_by_parameter = distributed.shard_by_parameter();
  return std::make_unique<Distributor>(std::move(config));
}

/// The error of the ranks whose step did not fail: which failed, and why nothing changed.
std::string failed_ranks_message(const std::vector<int>& failed, const char* why_unchanged) {
  return fmt::format(
      "DistributedShampoo: the step failed on rank(s) {} of the trainer group (the error is "
      "reported there); {}, so parameters, state and step counts are as before it",
      fmt::join(failed, ", "), why_unchanged);
}

/// max |entry| of each tensor, in double; NaN when a tensor holds a NaN. On CUDA one
/// _foreach_norm(inf); on the CPU one aminmax pass per tensor (max(−min, max), exact like the
/// norm): the CPU inf-norm reduction took ~20× as long for 4.2M entries on one thread (11.5 ms
/// against 0.55, issue 28's profile), as long as a whole torch::optim::Adam step.
std::vector<double> max_abs_entries(const std::vector<at::Tensor>& tensors) {
  const bool on_cpu = std::all_of(tensors.begin(), tensors.end(),
                                  [](const at::Tensor& t) { return t.device().is_cpu(); });
  if (!on_cpu) {
    const auto norms = at::stack(at::_foreach_norm(tensors, INFINITY)).to(at::kCPU, at::kDouble);
    const auto* data = norms.data_ptr<double>();
    return {data, data + norms.numel()};
  }
  std::vector<double> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) {
    const auto [lowest, highest] = at::aminmax(t);
    const double lo = lowest.item<double>();
    const double hi = highest.item<double>();
    out.push_back(std::isnan(lo) || std::isnan(hi) ? std::numeric_limits<double>::quiet_NaN()
                                                   : std::max(-lo, hi));
  }
  return out;
}

}  // namespace

ShampooEngine::ShampooEngine(const ShampooOptions& defaults, DistributedOptions distributed)
    : distributed_(validated(defaults, std::move(distributed))),
      distributor_(make_distributor(distributed_)),
      front_(defaults, distributed_, *distributor_) {}

void ShampooEngine::collect_gradients(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                                      const std::vector<int64_t>& params,
                                      std::vector<std::vector<at::Tensor>>& grad_blocks,
                                      std::vector<double>& grad_abs_max) const {
  std::vector<at::Tensor> grads;
  std::vector<int64_t> grad_owner;
  for (const int64_t p : params) {
    const auto& param = front_.registry.params[p].param;
    const auto& grad = param.grad();
    if (!grad.defined() || param.numel() == 0) continue;
    TORCH_CHECK(grad.sizes() == param.sizes() && grad.scalar_type() == param.scalar_type() &&
                    grad.device() == param.device() && grad.layout() == at::kStrided,
                "parameter ", p, " (group ", front_.registry.params[p].group, "): its gradient (",
                grad.sizes(), ", ", grad.scalar_type(), ", ", grad.device(), ", ", grad.layout(),
                ") does not match the parameter (", param.sizes(), ", ", param.scalar_type(), ", ",
                param.device(), ", dense)");
    // bf16/fp16 and non-contiguous (channels_last) gradients are read as a contiguous copy in
    // the compute dtype, the layout the blocks are views of.
    grads.push_back(needs_work_copy(grad) ? work_tensor(grad) : grad);
    grad_owner.push_back(p);
  }
  if (grads.empty()) return;
  // A non-finite gradient is an error before anything changes (never NaN parameters). The
  // max |entry| is NaN or inf exactly when some entry is; it also bounds the factor update.
  const auto max_abs = max_abs_entries(grads);
  for (size_t i = 0; i < grads.size(); ++i) {
    const auto p = grad_owner[i];
    TORCH_CHECK(
        std::isfinite(max_abs[i]), "DistributedShampoo: the gradient of parameter ", p, " (group ",
        front_.registry.params[p].group, ", shape ", front_.registry.params[p].param.sizes(),
        ") has non-finite values (NaN or inf) at step ",
        front_.group_steps[front_.registry.params[p].group] + 1, "; the step was not applied");
    const auto& entry = front_.registry.params[p];
    int64_t block_numel = 0;
    for (const auto& block : entry.plan.blocks) block_numel = std::max(block_numel, block.numel);
    const auto overflow = statistics_overflow(options_of(groups[entry.group], entry.group),
                                              grads[i].scalar_type(), block_numel, max_abs[i]);
    TORCH_CHECK(overflow.empty(), "DistributedShampoo: the gradient of parameter ", p, " (group ",
                entry.group, ", shape ", entry.param.sizes(), ") at step ",
                front_.group_steps[entry.group] + 1, ": ", overflow,
                "; the step was not applied (lower the lr or loss scale, or clip the gradients)");
  }
  for (size_t i = 0; i < grads.size(); ++i) {
    const auto p = grad_owner[i];
    grad_blocks[p] = block_views(grads[i], front_.registry.params[p].plan);
    grad_abs_max[p] = max_abs[i];
  }
}

void ShampooEngine::begin_step(std::vector<torch::optim::OptimizerParamGroup>& groups,
                               bool incremental) {
  TORCH_CHECK(broken_.empty(), broken_);
  front_.register_added(groups);
  // Options replaced from outside (a wrapper's push of its copy) may carry peak_lr −1 again.
  for (size_t g = 0; g < groups.size() && g < front_.group_peak_lrs.size(); ++g) {
    auto& options = options_of(groups[g], g);
    if (options.peak_lr() == -1.0) options.peak_lr(front_.group_peak_lrs[g]);
  }
  TORCH_CHECK(!front_.registry.params.empty(),
              "DistributedShampoo::step(): the optimizer has no parameters (it was built with an "
              "empty parameter list and none were added since); add them with add_param_group "
              "before the first step");
  // A later phase can throw after blocks changed: a later compute call in backward, or in a
  // distributed step that does not agree first, the AllGather (another rank's failure). Then
  // every compute call saves what it changes first. An agreeing step learns every rank's
  // readiness before it changes anything and saves only where some rank may raise later.
  const bool distributed = distributor_->distributed();
  const bool agree = distributed && !incremental && distributed_.agree_before_update();
  // In backward, the journal unless DistributedOptions::undo_in_backward(false).
  const bool journal = incremental ? distributed_.undo_in_backward() : distributed && !agree;
  transaction_.open(front_.virtual_groups.size(), front_.registry.blocks.size(),
                    journal || (fault_ && fault_journals_), agree);
  distributor_->begin_step();
  try {
    front_.check(groups);
    TORCH_CHECK(!eval_mode_ || !front_.any_averaging(),
                "DistributedShampoo: step() in eval mode; with iterate averaging the parameters "
                "hold the evaluation sequence after eval(): call train() before step()");
  } catch (...) {
    abort_step();
    throw;
  }
  if (agree) {
    step_prints_ = float_option_prints(groups);
    step_lrs_.clear();
    for (size_t g = 0; g < groups.size(); ++g) step_lrs_.push_back(options_of(groups[g], g).lr());
  }
  // Read once per step: in backward, compute calls come later, and close_step commits these.
  step_lr_sums_ = front_.group_lr_sums;
  for (size_t g = 0; g < groups.size(); ++g) {
    step_lr_sums_[g] += lr_power_term(options_of(groups[g], g));
  }
}

void ShampooEngine::set_eval_mode(bool eval,
                                  std::vector<torch::optim::OptimizerParamGroup>& groups) {
  TORCH_CHECK(!transaction_.is_open(), "DistributedShampoo: ", eval ? "eval()" : "train()",
              " while a step is open (in backward); switch between steps");
  if (eval == eval_mode_) return;
  front_.register_added(groups);
  front_.check(groups);
  if (!front_.any_averaging()) {
    eval_mode_ = eval;
    return;
  }
  distributor_->begin_step();
  try {
    for (const auto& vg : front_.virtual_groups) {
      if (averaging_enabled(vg->structural_options())) {
        vg->switch_sequence(eval, front_.registry.params, front_.registry.blocks, *distributor_);
      }
    }
  } catch (...) {
    if (distributor_->distributed()) distributor_->exchange(/*failed=*/true);
    throw;
  }
  if (distributor_->distributed()) {
    collectives_last_step_ = distributor_->exchange();
    TORCH_CHECK(distributor_->failed_ranks().empty(),
                "DistributedShampoo: ", eval ? "eval()" : "train()", " failed on rank(s) ",
                fmt::format("{}", fmt::join(distributor_->failed_ranks(), ", ")),
                "; no parameter was changed");
    apply_received(*distributor_, front_.registry.params, front_.registry.blocks);
  }
  eval_mode_ = eval;
}

void ShampooEngine::compute(std::vector<torch::optim::OptimizerParamGroup>& groups,
                            const std::vector<int64_t>& params) {
  TORCH_INTERNAL_ASSERT(transaction_.is_open());
  std::vector<std::vector<at::Tensor>> grad_blocks(front_.registry.params.size());
  std::vector<double> grad_abs_max(front_.registry.params.size(), 0.0);
  {
    RECORD_USER_SCOPE("shampoo::collect_gradients");
    collect_gradients(groups, params, grad_blocks, grad_abs_max);
  }
  RECORD_USER_SCOPE("shampoo::compute");  // plans, journals, writes back; chunks inside
  std::vector<std::vector<at::Tensor>> param_blocks(front_.registry.params.size());
  // The parameter, or (bf16, fp16, non-contiguous, with a gradient) a copy written back below.
  std::vector<at::Tensor> work(front_.registry.params.size());
  for (const int64_t p : params) {
    work[p] = grad_blocks[p].empty() ? front_.registry.params[p].param
                                     : work_tensor(front_.registry.params[p].param);
    param_blocks[p] = block_views(work[p], front_.registry.params[p].plan);
  }
  std::vector<const ShampooOptions*> group_options(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) group_options[g] = &options_of(groups[g], g);
  // The step being computed: one past each group's count (advanced when the step completes).
  std::vector<int64_t> next_steps(front_.group_steps);
  for (auto& t : next_steps) ++t;
  const StepInputs inputs{front_.registry.params, front_.registry.blocks,
                          group_options,          next_steps,
                          step_lr_sums_,          grad_blocks,
                          param_blocks,           grad_abs_max,
                          *distributor_,          fault_,
                          transaction_.computed()};

  bool protect = transaction_.protect_all();
  {
    RECORD_USER_SCOPE("shampoo::may_raise");
    for (const auto& vg : front_.virtual_groups) protect = vg->may_raise(inputs) || protect;
  }
  if (transaction_.agreement_pending()) protect = agree_before_update(protect);
  const bool any_gradient =
      std::any_of(params.begin(), params.end(), [&](int64_t p) { return !grad_blocks[p].empty(); });
  if (!protect && any_gradient) transaction_.note_unjournaled_change();
  if (protect) {
    // A single process updates its parameters in place while computing: keep them too.
    std::vector<int64_t> stepped;
    for (const int64_t p : params) {
      if (!grad_blocks[p].empty()) stepped.push_back(p);
    }
    transaction_.save(front_.virtual_groups, inputs, front_.registry.params, stepped,
                      /*keep_params=*/!distributor_->distributed());
  }
  for (auto& vg : front_.virtual_groups) vg->step(inputs);
  // A single process updated the work copies in place: round them into their parameters.
  if (!distributor_->distributed()) {
    for (const int64_t p : params) {
      if (!grad_blocks[p].empty()) write_back(front_.registry.params[p].param, work[p]);
    }
  }
  if (fault_) fault_(FaultPoint::kComputed);
}

void ShampooEngine::compute_params(std::vector<torch::optim::OptimizerParamGroup>& groups,
                                   const std::vector<int64_t>& params) {
  try {
    compute(groups, params);
  } catch (...) {
    abort_step();
    throw;
  }
}

void ShampooEngine::close_step(bool completed) {
  if (completed) {
    // A group advances when one of its blocks was updated (torch::optim: a parameter without a
    // gradient is not stepped). Distributed: the blocks the owners flagged, the same on every
    // rank, so the ranks' step counts stay equal.
    std::vector<bool> advance(front_.group_steps.size(), false);
    for (size_t b = 0; b < front_.registry.blocks.size(); ++b) {
      const bool updated = distributor_->distributed()
                               ? distributor_->received_updated(b)
                               : static_cast<bool>(transaction_.computed()[b]);
      if (updated) advance[front_.registry.params[front_.registry.blocks[b].param].group] = true;
    }
    for (size_t g = 0; g < front_.group_steps.size(); ++g) {
      front_.group_steps[g] += advance[g] ? 1 : 0;
      if (advance[g]) front_.group_lr_sums[g] = step_lr_sums_[g];
    }
  }
  transaction_.close();
}

bool ShampooEngine::agree_before_update(bool needs_journal) {
  using Readiness = Distributor::Readiness;
  transaction_.set_agreed();
  Distributor::Agreement all;
  try {
    all = distributor_->agree(needs_journal ? Readiness::kNeedsJournal : Readiness::kReady,
                              step_prints_);
  } catch (...) {
    transaction_.set_exchange_attempted();  // the peers are unreachable: no AllGather after it
    throw;
  }
  std::vector<int> failed;
  bool journal = false;
  for (size_t r = 0; r < all.readiness.size(); ++r) {
    if (all.readiness[r] == Readiness::kFailed) failed.push_back(static_cast<int>(r));
    journal = journal || all.readiness[r] == Readiness::kNeedsJournal;
  }
  if (!failed.empty()) {
    close_step(/*completed=*/false);
    TORCH_CHECK(false,
                failed_ranks_message(failed, "the ranks agreed on it before any state changed"));
  }
  const auto disagreement = float_options_disagreement(all.values, step_lrs_);
  if (!disagreement.empty()) {
    close_step(/*completed=*/false);
    TORCH_CHECK(false, disagreement);
  }
  return journal;
}

void ShampooEngine::abort_step() {
  if (!transaction_.is_open()) return;
  if (transaction_.agreement_pending()) {
    // This rank failed before the agreement: tell the others, which then change nothing either.
    transaction_.set_agreed();
    transaction_.set_exchange_attempted();
    try {
      // As many values as the others pass (this rank's are not compared: its step failed).
      distributor_->agree(Distributor::Readiness::kFailed,
                          std::vector<int64_t>(kFloatOptionPrints, 0));
    } catch (const std::exception&) {
      // The agreement failed as well; this rank's own error is the one rethrown.
    }
  }
  if (distributor_->distributed() && !transaction_.exchange_attempted()) {
    transaction_.set_exchange_attempted();
    try {
      collectives_last_step_ = distributor_->exchange(/*failed=*/true);
    } catch (const std::exception&) {
      // The AllGather failed as well; this rank's own error is the one rethrown.
    }
  }
  transaction_.restore(front_.virtual_groups);
  note_broken_if_unjournaled();
  close_step(/*completed=*/false);
}

void ShampooEngine::note_broken_if_unjournaled() {
  if (!transaction_.unjournaled_change()) return;
  broken_ =
      "DistributedShampoo: an earlier step failed after it had changed optimizer state that it "
      "kept no copy of (an error no check foresaw, such as running out of memory; see the error "
      "that step raised), so the state no longer matches the parameters: load a checkpoint "
      "(load / load_state_dict) before the next step";
}

void ShampooEngine::finish_step() {
  TORCH_INTERNAL_ASSERT(transaction_.is_open());
  try {
    if (transaction_.agreement_pending()) agree_before_update(transaction_.protect_all());
    if (fault_) fault_(FaultPoint::kExchange);
    transaction_.set_exchange_attempted();
    collectives_last_step_ = distributor_->exchange();
  } catch (...) {
    abort_step();
    throw;
  }
  const auto& failed = distributor_->failed_ranks();
  if (!failed.empty()) {
    transaction_.restore(front_.virtual_groups);
    note_broken_if_unjournaled();
    close_step(/*completed=*/false);
    TORCH_CHECK(false, failed_ranks_message(failed, "every rank undid this step"));
  }
  if (distributor_->distributed())
    apply_received(*distributor_, front_.registry.params, front_.registry.blocks);
  close_step(/*completed=*/true);
}

void ShampooEngine::step(std::vector<torch::optim::OptimizerParamGroup>& groups) {
  std::vector<int64_t> all(front_.registry.params.size());
  std::iota(all.begin(), all.end(), 0);
  step(groups, all);
}

void ShampooEngine::step(std::vector<torch::optim::OptimizerParamGroup>& groups,
                         const std::vector<int64_t>& params) {
  begin_step(groups);
  compute_params(groups, params);
  finish_step();
}

ShampooStats ShampooEngine::stats() const {
  ShampooStats s;
  s.virtual_groups = static_cast<int64_t>(front_.virtual_groups.size());
  s.collectives_last_step = collectives_last_step_;
  s.total_blocks = static_cast<int64_t>(front_.registry.blocks.size());
  const auto counters = front_.counters();
  s.amortized_computations = counters.computations;
  s.failed_amortized_computations = counters.failures;
  s.double_precision_retries = counters.retried_in_double;
  s.root_solver_fallbacks = counters.solver_fallbacks;
  s.amortized_batched_calls = counters.batched_calls;
  for (const auto& vg : front_.virtual_groups) {
    s.owned_blocks += vg->owned_blocks();
    s.state_bytes += vg->state_bytes();
  }
  s.rollback_bytes_last_step = transaction_.saved_bytes_last_step();
  s.bytes_sent_per_step = distributor_->bytes_sent_per_step();
  s.bytes_received_per_step = distributor_->bytes_received_per_step();
  return s;
}

MemorySummary ShampooEngine::memory_summary() const {
  MemorySummary out;
  for (const auto& vg : front_.virtual_groups) vg->add_memory(out);
  out.scratch_last_step = transaction_.saved_bytes_last_step();
  return out;
}

}  // namespace shampoo::detail
