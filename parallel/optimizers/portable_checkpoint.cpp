// Optimizer state by parameter name (whole-run checkpoints that any layout loads): the values of
// the model's parameters, whole or in row chunks, and the per-parameter state of DistributedShampoo
// and LibTorch's optimizers.
#include "parallel/optimizers/portable_checkpoint.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

#include "parallel/optimizers/block_states.h"
#include "parallel/optimizers/capabilities.h"
#include "parallel/optimizers/libtorch_optimizers.h"

namespace shampoo {
namespace {

constexpr const char* kShampooKind = "DistributedShampoo";

std::string head_key(const std::string& name) { return name + "/optimizer"; }
std::string block_key(const std::string& name, int64_t block) {
  return name + "/block_" + std::to_string(block);
}

/// "DistributedShampoo", or LibTorch's optimizer's name; an error starting with `who` otherwise.
std::string kind_of(const torch::optim::Optimizer& optimizer, const std::string& who) {
  if (detail::capabilities_of(optimizer).blocks != nullptr) return kShampooKind;
  auto name = detail::libtorch_optimizer_name(optimizer);
  TORCH_CHECK(!name.empty(), who,
              "checkpoints need DistributedShampoo or one of LibTorch's SGD, Adam, AdamW, "
              "Adagrad, RMSprop (their state is saved per parameter, so that any layout and "
              "world size loads it); this optimizer is a ",
              c10::demangle(typeid(optimizer).name()));
  return name;
}

}  // namespace

// ---- SavedModel ----

SavedModel::SavedModel(std::map<std::string, Entry> entries, int64_t row_pieces, PieceReader pieces)
    : entries_(std::move(entries)), row_pieces_(row_pieces), pieces_(std::move(pieces)) {}

bool SavedModel::contains(const std::string& name) const { return entries_.count(name) != 0; }

const SavedModel::Entry& SavedModel::entry(const std::string& name) const {
  const auto it = entries_.find(name);
  TORCH_CHECK(it != entries_.end(), "checkpoint: the model has no parameter or buffer '", name,
              "' there");
  return it->second;
}

std::string SavedModel::rows_key(const std::string& name, int64_t r) {
  return "model/" + name + "/rows_" + std::to_string(r);
}

torch::serialize::OutputArchive SavedModel::rows_piece(const at::Tensor& rows) {
  torch::serialize::OutputArchive piece;
  piece.write("rows", rows.detach().cpu(), /*is_buffer=*/true);
  return piece;
}

at::Tensor SavedModel::rows(const std::string& name, int64_t first, int64_t count) const {
  const auto& saved = entry(name);
  const int64_t total = saved.sizes.empty() ? 1 : saved.sizes[0];
  int64_t numel = 1;
  for (const auto size : saved.sizes) numel *= size;
  const int64_t row_numel = total == 0 ? 0 : numel / total;
  TORCH_INTERNAL_ASSERT(first >= 0 && count >= 0 && first + count <= total);
  if (saved.whole.defined()) {
    return saved.whole.reshape({total, row_numel}).narrow(0, first, count);
  }
  auto out = at::empty({count, row_numel}, at::TensorOptions().dtype(saved.dtype));
  const int64_t chunk = (total + row_pieces_ - 1) / row_pieces_;
  for (int64_t r = 0; r < row_pieces_ && count > 0; ++r) {
    const int64_t begin = r * chunk;
    const int64_t end = std::min(total, begin + chunk);
    const int64_t low = std::max(begin, first);
    const int64_t high = std::min(end, first + count);
    if (low >= high) continue;
    const auto key = rows_key(name, r);
    auto piece = pieces_.read(key);
    at::Tensor held;
    TORCH_CHECK(piece.try_read("rows", held, /*is_buffer=*/true) &&
                    held.numel() == (end - begin) * row_numel,
                "checkpoint: piece ", key, " is damaged");
    out.narrow(0, low - first, high - low)
        .copy_(held.reshape({end - begin, row_numel}).narrow(0, low - begin, high - low));
  }
  return out;
}

at::Tensor SavedModel::whole(const std::string& name) const {
  const auto& saved = entry(name);
  if (saved.whole.defined()) return saved.whole;
  const int64_t total = saved.sizes.empty() ? 1 : saved.sizes[0];
  return rows(name, 0, total).reshape(saved.sizes);
}

namespace detail {

void save_param_states(const torch::optim::Optimizer& optimizer,
                       const std::vector<at::Tensor>& heads, PieceWriter& pieces,
                       const ParamNames& names, const std::string& who) {
  const auto kind = kind_of(optimizer, who);
  const BlockStates* blocks = capabilities_of(optimizer).blocks;
  // A parameter's group (DistributedShampoo counts steps per group).
  std::map<const c10::TensorImpl*, size_t> group_of;
  const auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const auto& p : groups[g].params()) group_of[p.unsafeGetTensorImpl()] = g;
  }
  for (const auto& p : heads) {
    torch::serialize::OutputArchive head =
        blocks != nullptr ? torch::serialize::OutputArchive() : param_state_piece(optimizer, p);
    head.write("kind", c10::IValue(kind));
    if (blocks != nullptr) {
      const size_t g = group_of.at(p.unsafeGetTensorImpl());
      head.write("step", c10::IValue(blocks->group_step(g)));
      head.write("lr_sum", c10::IValue(blocks->group_lr_sum(g)));
      head.write("eval_mode", c10::IValue(blocks->in_eval_mode()));
    }
    pieces.add(head_key(names(p)), std::move(head));
  }
  if (blocks != nullptr) {
    blocks->save_block_pieces(
        pieces, [&](const at::Tensor& p, int64_t block) { return block_key(names(p), block); });
  }
}

namespace {

/// The head piece of parameter `p`, checked to be of `kind`.
torch::serialize::InputArchive read_head(PieceReader& pieces, const std::string& name,
                                         const std::string& kind, const std::string& who) {
  const auto key = head_key(name);
  auto head = pieces.read(key);
  c10::IValue saved;
  TORCH_CHECK(head.try_read("kind", saved) && saved.isString(), who, "checkpoint: piece ", key,
              " is damaged");
  TORCH_CHECK(saved.toStringRef() == kind, who, "checkpoint: ", name, " was stepped by ",
              saved.toStringRef(), " there and by ", kind,
              " here (the optimizer of a parameter cannot change across a resume)");
  return head;
}

std::function<void()> prepare_shampoo_states(torch::optim::Optimizer& optimizer,
                                             PieceReader& pieces, const ParamNames& names,
                                             const std::string& who) {
  auto* blocks = capabilities_of(optimizer).blocks;
  const auto& groups = optimizer.param_groups();
  std::vector<int64_t> steps(groups.size(), 0);
  std::vector<double> lr_sums(groups.size(), 0.0);
  std::optional<bool> eval_mode;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const auto& p : groups[g].params()) {
      const auto name = names(p);
      auto head = read_head(pieces, name, kShampooKind, who);
      c10::IValue step;
      c10::IValue lr_sum;
      TORCH_CHECK(head.try_read("step", step) && step.isInt() && head.try_read("lr_sum", lr_sum) &&
                      lr_sum.isDouble(),
                  who, "checkpoint: piece ", head_key(name), " is damaged");
      // The parameters of a group were stepped by the ranks that held them then; a group's
      // count is the count of the most advanced of them (they differ only for parameters left
      // out of some steps).
      if (step.toInt() >= steps[g]) {
        steps[g] = step.toInt();
        lr_sums[g] = lr_sum.toDouble();
      }
      c10::IValue eval;
      if (head.try_read("eval_mode", eval) && eval.isBool()) eval_mode = eval.toBool();
    }
  }
  return blocks->prepare_block_load(
      pieces, [&](const at::Tensor& p, int64_t block) { return block_key(names(p), block); },
      std::move(steps), std::move(lr_sums), eval_mode);
}

}  // namespace

std::function<void()> prepare_param_states(torch::optim::Optimizer& optimizer, PieceReader& pieces,
                                           const ParamNames& names, const std::string& who) {
  const auto kind = kind_of(optimizer, who);
  if (kind == kShampooKind) return prepare_shampoo_states(optimizer, pieces, names, who);
  auto states = std::make_shared<
      std::vector<std::pair<void*, std::unique_ptr<torch::optim::OptimizerParamState>>>>();
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      const auto name = names(p);
      auto head = read_head(pieces, name, kind, who);
      states->emplace_back(
          p.unsafeGetTensorImpl(),
          read_param_state_piece(optimizer, head, who + "checkpoint: piece " + head_key(name)));
    }
  }
  auto* target = &optimizer;
  return [target, states] {
    for (auto& [key, state] : *states) {
      target->state().erase(key);
      if (state) target->state()[key] = std::move(state);
    }
  };
}

std::unique_ptr<torch::optim::OptimizerOptions> read_options(
    const torch::optim::OptimizerParamGroup& group, torch::serialize::InputArchive& saved) {
  auto options = group.options().clone();
  options->serialize(saved);
  return options;
}

std::vector<const torch::optim::OptimizerParamGroup*> groups_of(
    const torch::optim::Optimizer& optimizer) {
  std::vector<const torch::optim::OptimizerParamGroup*> out;
  for (const auto& group : optimizer.param_groups()) out.push_back(&group);
  return out;
}

// ---- ReplicatedPortable ----

std::vector<const torch::optim::OptimizerParamGroup*> ReplicatedPortable::portable_groups() const {
  return groups_of(optimizer_);
}

void ReplicatedPortable::save_portable_pieces(PieceWriter& pieces, const PortableSave& save) const {
  kind_of(optimizer_, "");     // an error for an optimizer whose state is not known, on every rank
  if (save.rank != 0) return;  // every rank holds the same state
  std::vector<at::Tensor> all;
  for (const auto& group : optimizer_.param_groups()) {
    all.insert(all.end(), group.params().begin(), group.params().end());
  }
  save_param_states(optimizer_, all, pieces, save.names, "");
}

bool has_param_states(const torch::optim::Optimizer& optimizer) {
  return capabilities_of(optimizer).blocks != nullptr ||
         !libtorch_optimizer_name(optimizer).empty();
}

std::function<void()> ReplicatedPortable::prepare_portable_load(const PortableLoad& load) {
  auto install_states = prepare_param_states(optimizer_, *load.pieces, load.names, "");
  auto options = std::make_shared<std::vector<std::unique_ptr<torch::optim::OptimizerOptions>>>();
  const auto& groups = optimizer_.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    options->push_back(read_options(groups[g], *load.group_options.at(g)));
  }
  auto* optimizer = &optimizer_;
  return [optimizer, options, install_states] {
    install_states();
    auto& groups = optimizer->param_groups();
    for (size_t g = 0; g < groups.size(); ++g) groups[g].set_options(std::move((*options)[g]));
  };
}

}  // namespace detail
}  // namespace shampoo
