#include "parallel/rank_optimizer.h"

#include <c10/util/Exception.h>
#include <c10/util/TypeIndex.h>

#include <algorithm>
#include <utility>

#include "parallel/libtorch_optimizers.h"
#include "parallel/partial_step.h"
#include "parallel/phased_backward_step.h"
#include "parallel/step_undo.h"

namespace shampoo::detail {
namespace {

constexpr const char* kShampooKind = "DistributedShampoo";

std::string block_name(const std::string& param_name, int64_t block) {
  return param_name + "/block_" + std::to_string(block);
}

}  // namespace

RankOptimizer::RankOptimizer(OptimizerFactory factory, std::string who)
    : factory_(std::move(factory)), who_(std::move(who)) {}

void RankOptimizer::add(size_t group, const std::vector<at::Tensor>& params,
                        const GroupOptions& options_of) {
  if (!optimizer_) {
    if (params.empty()) return;
    optimizer_ = factory_(group == 0 ? params : std::vector<at::Tensor>{});
    TORCH_CHECK(optimizer_ != nullptr, who_, "the optimizer factory returned null");
    TORCH_CHECK(optimizer_->param_groups().size() == 1, who_,
                "the optimizer factory must return an optimizer with one param group (the one "
                "over the parameters it is given); it returned one with ",
                optimizer_->param_groups().size());
    set_options(0, options_of(0));
    if (group == 0) return;
  }
  auto& groups = optimizer_->param_groups();
  if (group < groups.size()) {
    auto& list = groups[group].params();
    list.insert(list.end(), params.begin(), params.end());
  }
  while (groups.size() <= group) {
    const size_t k = groups.size();
    // The base class's add_param_group: DistributedShampoo registers it below.
    optimizer_->torch::optim::Optimizer::add_param_group(torch::optim::OptimizerParamGroup(
        k == group ? params : std::vector<at::Tensor>{}, options_of(k).clone()));
  }
  if (auto* partial = dynamic_cast<PartialStep*>(optimizer_.get())) partial->register_appended();
}

void set_group_options(torch::optim::OptimizerParamGroup& target,
                       const torch::optim::OptimizerOptions& options, size_t group,
                       const std::string& who) {
  TORCH_CHECK(typeid(options) == typeid(target.options()), who, "param group ", group,
              ": its options are a ", c10::demangle(typeid(options).name()),
              ", but the factory's optimizer takes ",
              c10::demangle(typeid(target.options()).name()),
              " (give the group options of that type, or none for the factory's)");
  target.set_options(options.clone());
}

void RankOptimizer::set_options(size_t group, const torch::optim::OptimizerOptions& options) {
  if (!optimizer_ || group >= optimizer_->param_groups().size()) return;
  set_group_options(optimizer_->param_groups()[group], options, group, who_);
}

void RankOptimizer::step(const std::vector<at::Tensor>& params, bool in_pass, UnitUndo* undo) {
  if (params.empty()) return;
  TORCH_INTERNAL_ASSERT(optimizer_ != nullptr);
  if (auto* partial = dynamic_cast<PartialStep*>(optimizer_.get())) {
    auto* phased = dynamic_cast<PhasedBackwardStep*>(optimizer_.get());
    if (!in_pass || phased == nullptr) {
      partial->step_only(params);
      return;
    }
    if (!phased->backward_step_open()) phased->begin_backward_step();
    phased->step_parameters(params);
    return;
  }
  if (undo != nullptr) {
    if (libtorch_optimizer_name(*optimizer_).empty()) {
      undo->complete = false;  // an optimizer of another type: its step cannot be undone
    } else {
      for (const auto& p : params) {
        void* key = p.unsafeGetTensorImpl();
        const auto it = optimizer_->state().find(key);
        undo->states.push_back({optimizer_.get(), key,
                                it == optimizer_->state().end()
                                    ? nullptr
                                    : copy_param_state(*optimizer_, *it->second)});
      }
    }
  }
  // `params` only: another unit's parameters may be getting their gradients meanwhile (the
  // step runs on the worker during backward).
  step_only(*optimizer_, params);
}

void RankOptimizer::finish() {
  auto* phased = dynamic_cast<PhasedBackwardStep*>(optimizer_.get());
  if (phased != nullptr && phased->backward_step_open()) phased->finish_backward_step();
}

void RankOptimizer::abort() {
  auto* phased = dynamic_cast<PhasedBackwardStep*>(optimizer_.get());
  if (phased != nullptr && phased->backward_step_open()) phased->abort_backward_step();
}

std::string RankOptimizer::kind() const {
  if (dynamic_cast<const PartialStep*>(optimizer_.get()) != nullptr) return kShampooKind;
  auto name = libtorch_optimizer_name(*optimizer_);
  TORCH_CHECK(!name.empty(), who_,
              "checkpoints need DistributedShampoo or one of LibTorch's SGD, Adam, AdamW, "
              "Adagrad, RMSprop as the factory's optimizer (their state is saved per parameter, "
              "so that any world size loads it); this one is a ",
              c10::demangle(typeid(*optimizer_).name()));
  return name;
}

void RankOptimizer::save_pieces(PieceWriter& pieces, const ParamName& name_of) const {
  if (!optimizer_) return;
  const auto type = kind();
  const auto* partial = dynamic_cast<const PartialStep*>(optimizer_.get());
  const auto& groups = optimizer_->param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const auto& p : groups[g].params()) {
      torch::serialize::OutputArchive head = partial != nullptr ? torch::serialize::OutputArchive()
                                                                : param_state_piece(*optimizer_, p);
      head.write("kind", c10::IValue(type));
      if (partial != nullptr) {
        head.write("step", c10::IValue(partial->group_step(g)));
        head.write("lr_sum", c10::IValue(partial->group_lr_sum(g)));
      }
      pieces.add(name_of(p) + "/optimizer", std::move(head));
    }
  }
  if (partial != nullptr) {
    partial->save_block_pieces(
        pieces, [&](const at::Tensor& p, int64_t block) { return block_name(name_of(p), block); });
  }
}

void RankOptimizer::check_kind(torch::serialize::InputArchive& head, const std::string& key,
                               const std::string& param, const std::string& here) const {
  c10::IValue saved;
  TORCH_CHECK(head.try_read("kind", saved) && saved.isString(), who_, "checkpoint: piece ", key,
              " is damaged");
  TORCH_CHECK(saved.toStringRef() == here, who_, "checkpoint: ", param, " was stepped by ",
              saved.toStringRef(), " there and by ", here, " here");
}

std::function<void()> RankOptimizer::prepare_load(PieceReader& pieces, const ParamName& name_of) {
  if (!optimizer_) return [] {};
  if (dynamic_cast<PartialStep*>(optimizer_.get()) != nullptr) {
    return prepare_partial_load(pieces, name_of);
  }
  const auto type = kind();
  auto states = std::make_shared<
      std::vector<std::pair<void*, std::unique_ptr<torch::optim::OptimizerParamState>>>>();
  for (const auto& group : optimizer_->param_groups()) {
    for (const auto& p : group.params()) {
      const auto key = name_of(p) + "/optimizer";
      auto head = pieces.read(key);
      check_kind(head, key, name_of(p), type);
      states->emplace_back(
          p.unsafeGetTensorImpl(),
          read_param_state_piece(*optimizer_, head, who_ + "checkpoint: piece " + key));
    }
  }
  auto* optimizer = optimizer_.get();
  return [optimizer, states] {
    for (auto& [key, state] : *states) {
      optimizer->state().erase(key);
      if (state) optimizer->state()[key] = std::move(state);
    }
  };
}

std::function<void()> RankOptimizer::prepare_partial_load(PieceReader& pieces,
                                                          const ParamName& name_of) {
  auto* partial = dynamic_cast<PartialStep*>(optimizer_.get());
  const auto& groups = optimizer_->param_groups();
  std::vector<int64_t> steps(groups.size(), 0);
  std::vector<double> lr_sums(groups.size(), 0.0);
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const auto& p : groups[g].params()) {
      const auto key = name_of(p) + "/optimizer";
      auto head = pieces.read(key);
      check_kind(head, key, name_of(p), kShampooKind);
      c10::IValue step;
      c10::IValue lr_sum;
      TORCH_CHECK(head.try_read("step", step) && step.isInt() && head.try_read("lr_sum", lr_sum) &&
                      lr_sum.isDouble(),
                  who_, "checkpoint: piece ", key, " is damaged");
      // The parameters of a group were stepped by the ranks that owned them then; a group's
      // count is the count of the most advanced of them (they differ only for parameters of
      // units left out of some iterations).
      if (step.toInt() >= steps[g]) {
        steps[g] = step.toInt();
        lr_sums[g] = lr_sum.toDouble();
      }
    }
  }
  return partial->prepare_block_load(
      pieces, [&](const at::Tensor& p, int64_t block) { return block_name(name_of(p), block); },
      std::move(steps), std::move(lr_sums));
}

}  // namespace shampoo::detail
