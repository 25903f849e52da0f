#include "parallel/sharded_optimizer.h"

#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <unordered_set>

#include "parallel/block_assignment.h"
#include "parallel/libtorch_optimizers.h"
#include "parallel/process_group.h"

namespace shampoo {
namespace {

/// Options of the wrapper's own (single) param group; hyperparameters live in the local
/// optimizer.
struct WrapperOptions : torch::optim::OptimizerCloneableOptions<WrapperOptions> {};

/// The local optimizer's type name; an error when its per-parameter state type is unknown.
std::string local_type(const torch::optim::Optimizer& local) {
  auto name = detail::libtorch_optimizer_name(local);
  TORCH_CHECK(!name.empty(),
              "ShardedOptimizer: world-size-independent checkpoints need the factory to make one "
              "of LibTorch's SGD, Adam, AdamW, Adagrad or RMSprop (this one made another type, "
              "whose per-parameter state cannot be saved on its own); torch::save works at one "
              "world size");
  return name;
}

int64_t read_int(torch::serialize::InputArchive& archive, const std::string& key) {
  return detail::read_int_entry(archive, key, "ShardedOptimizer checkpoint");
}

}  // namespace

ShardedOptimizer::ShardedOptimizer(std::vector<torch::Tensor> params,
                                   const OptimizerFactory& factory,
                                   c10::intrusive_ptr<c10d::ProcessGroup> group)
    : torch::optim::Optimizer(
          std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(params)},
          std::make_unique<WrapperOptions>()),
      params_(std::move(params)),
      group_(std::move(group)) {
  TORCH_CHECK(group_, "ShardedOptimizer: process group is null");
  TORCH_CHECK(factory, "ShardedOptimizer: the optimizer factory is empty");
  TORCH_CHECK(!params_.empty(),
              "ShardedOptimizer: got an empty parameter list (nothing would be trained; pass the "
              "model's parameters)");
  const auto dtype = params_.front().scalar_type();
  const auto device = params_.front().device();
  for (size_t i = 0; i < params_.size(); ++i) {
    TORCH_CHECK(params_[i].scalar_type() == dtype && params_[i].device() == device,
                "ShardedOptimizer: parameter ", i, " is ", params_[i].scalar_type(), " on ",
                params_[i].device(), ", parameter 0 is ", dtype, " on ", device,
                "; all parameters must share one dtype and device (one AllGather buffer)");
    TORCH_CHECK(params_[i].layout() == at::kStrided && params_[i].is_floating_point(),
                "ShardedOptimizer: parameter ", i, " must be a dense floating-point tensor, got ",
                params_[i].scalar_type(), " ", params_[i].layout());
    index_of_[params_[i].unsafeGetTensorImpl()] = i;
  }
  const int world = group_->getSize();
  const int rank = group_->getRank();
  // Whole parameters, balanced by size (greedy longest-processing-time, the same on every rank).
  std::vector<int64_t> costs;
  for (const auto& p : params_) {
    costs.push_back(detail::block_cost(p.numel(), static_cast<int64_t>(p.element_size())));
  }
  std::vector<int64_t> loads(world, 0);
  owners_ = detail::assign_owners(costs, world, loads);
  std::vector<int64_t> used(world, 0);
  offsets_.resize(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    offsets_[i] = used[owners_[i]];
    used[owners_[i]] += params_[i].numel();
  }
  segment_size_ = *std::max_element(used.begin(), used.end());
  const auto options = params_.front().options().requires_grad(false);
  send_ = at::empty({segment_size_}, options);
  receive_ = at::empty({world * segment_size_}, options);

  // Every rank must shard the same parameters: compare (count, elements) across ranks.
  std::vector<int64_t> mine{static_cast<int64_t>(params_.size()), 0};
  for (const auto& p : params_) mine[1] += p.numel();
  const auto all = detail::gather_int64(*group_, mine);
  for (int r = 0; r < world; ++r) {
    TORCH_CHECK(all[r] == mine, "ShardedOptimizer: rank ", r, " has ", all[r][0],
                " parameters with ", all[r][1], " elements, rank ", rank, " has ", mine[0],
                " with ", mine[1], "; every rank must pass the same parameters");
  }

  std::vector<torch::Tensor> own;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (owners_[i] == rank) own.push_back(params_[i]);
  }
  local_ = factory(own);
  TORCH_CHECK(local_ != nullptr, "ShardedOptimizer: the factory returned null");
}

std::optional<int> ShardedOptimizer::owner_of(const at::Tensor& param) const {
  const auto it = index_of_.find(param.unsafeGetTensorImpl());
  if (it == index_of_.end()) return std::nullopt;
  return owners_[it->second];
}

torch::Tensor ShardedOptimizer::step(LossClosure closure) {
  TORCH_CHECK(!in_backward_,
              "ShardedOptimizer::step(): this optimizer runs in backward "
              "(apply_optimizer_in_backward); its steps happen during loss.backward()");
  torch::Tensor loss;
  if (closure) {
    c10::AutoGradMode enable_grad(true);
    loss = closure();
  }
  local_->step();
  all_gather();
  return loss;
}

void ShardedOptimizer::all_gather() {
  if (group_->getSize() == 1) return;  // every parameter is local
  c10::NoGradGuard no_grad;
  const int rank = group_->getRank();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (owners_[i] != rank) continue;
    send_.narrow(0, offsets_[i], params_[i].numel()).copy_(params_[i].detach().reshape(-1));
  }
  group_->getBackend(send_.device().type())->_allgather_base(receive_, send_)->wait();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (owners_[i] == rank) continue;
    const auto segment =
        receive_.narrow(0, owners_[i] * segment_size_ + offsets_[i], params_[i].numel());
    params_[i].detach().copy_(segment.view(params_[i].sizes()));
  }
}

void ShardedOptimizer::set_in_backward(bool in_backward) {
  TORCH_CHECK(!in_backward || !detail::libtorch_optimizer_name(*local_).empty(),
              "ShardedOptimizer in backward (apply_optimizer_in_backward): the factory must make "
              "one of LibTorch's SGD, Adam, AdamW, Adagrad or RMSprop, whose per-parameter state "
              "can be copied so that an aborted backward pass is undone");
  in_backward_ = in_backward;
}

void ShardedOptimizer::begin_backward_step() {
  TORCH_CHECK(!open_, "ShardedOptimizer: a backward step is already open");
  open_ = true;
  journal_.clear();
}

void ShardedOptimizer::step_parameters(const std::vector<at::Tensor>& params) {
  TORCH_INTERNAL_ASSERT(open_);
  c10::NoGradGuard no_grad;
  const int rank = group_->getRank();
  std::vector<at::Tensor> ready;  // this rank's, with a gradient
  for (const auto& p : params) {
    const auto it = index_of_.find(p.unsafeGetTensorImpl());
    TORCH_CHECK(it != index_of_.end(),
                "ShardedOptimizer: a parameter given to step_parameters is not one of its own");
    if (owners_[it->second] == rank && p.grad().defined()) ready.push_back(params_[it->second]);
  }
  if (ready.empty()) return;
  // Copies of what this call changes, once per pass and parameter.
  std::unordered_set<void*> saved;
  for (const auto& s : journal_) saved.insert(s.param.unsafeGetTensorImpl());
  for (const auto& p : ready) {
    void* key = p.unsafeGetTensorImpl();
    if (!saved.insert(key).second) continue;
    Saved s;
    s.param = p;
    s.value = p.detach().clone();
    const auto state = local_->state().find(key);
    if (state != local_->state().end()) {
      s.state = detail::copy_param_state(*local_, *state->second);
    }
    journal_.push_back(std::move(s));
  }
  detail::step_only(*local_, ready);
}

void ShardedOptimizer::finish_backward_step() {
  TORCH_INTERNAL_ASSERT(open_);
  open_ = false;
  journal_.clear();
  all_gather();
}

void ShardedOptimizer::abort_backward_step() {
  if (!open_) return;
  c10::NoGradGuard no_grad;
  for (auto& s : journal_) {
    s.param.detach().copy_(s.value);
    void* key = s.param.unsafeGetTensorImpl();
    local_->state().erase(key);
    if (s.state) local_->state()[key] = std::move(s.state);
  }
  journal_.clear();
  open_ = false;
}

void ShardedOptimizer::save(torch::serialize::OutputArchive& archive) const {
  archive.write("world_size", c10::IValue(static_cast<int64_t>(group_->getSize())));
  archive.write("rank", c10::IValue(static_cast<int64_t>(group_->getRank())));
  archive.write("num_params", c10::IValue(static_cast<int64_t>(params_.size())));
  torch::serialize::OutputArchive inner;
  local_->save(inner);
  archive.write("local", inner);
}

void ShardedOptimizer::load(torch::serialize::InputArchive& archive) {
  c10::IValue value;
  TORCH_CHECK(archive.try_read("world_size", value) && value.isInt(),
              "ShardedOptimizer::load: not a ShardedOptimizer checkpoint");
  TORCH_CHECK(value.toInt() == group_->getSize(), "ShardedOptimizer::load: written at world size ",
              value.toInt(), ", this run has ", group_->getSize(),
              "; loading at a different world size is not supported");
  archive.read("rank", value);
  TORCH_CHECK(value.toInt() == group_->getRank(), "ShardedOptimizer::load: written by rank ",
              value.toInt(), ", loaded by rank ", group_->getRank());
  archive.read("num_params", value);
  TORCH_CHECK(value.toInt() == static_cast<int64_t>(params_.size()),
              "ShardedOptimizer::load: written for ", value.toInt(), " parameters, this one has ",
              params_.size());
  torch::serialize::InputArchive inner;
  archive.read("local", inner);
  local_->load(inner);
}

void ShardedOptimizer::save_common(torch::serialize::OutputArchive& common) const {
  common.write("local_type", c10::IValue(local_type(*local_)));
  detail::write_param_shapes(common, params_);
  const auto& groups = local_->param_groups();
  common.write("num_local_groups", c10::IValue(static_cast<int64_t>(groups.size())));
  for (size_t g = 0; g < groups.size(); ++g) {
    torch::serialize::OutputArchive options;
    groups[g].options().serialize(options);
    common.write("local_group_" + std::to_string(g), options);
  }
}

void ShardedOptimizer::save_pieces(PieceWriter& pieces) const {
  local_type(*local_);
  const int rank = group_->getRank();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (owners_[i] != rank) continue;
    torch::serialize::OutputArchive piece;
    const auto it = local_->state().find(params_[i].unsafeGetTensorImpl());
    piece.write("has_state", c10::IValue(it != local_->state().end()));
    if (it != local_->state().end()) it->second->serialize(piece);
    pieces.add("param/" + std::to_string(i), std::move(piece));
  }
}

std::function<void()> ShardedOptimizer::prepare_load(torch::serialize::InputArchive& common,
                                                     PieceReader& pieces) {
  const auto type = local_type(*local_);
  c10::IValue saved_type;
  TORCH_CHECK(common.try_read("local_type", saved_type) && saved_type.isString(),
              "ShardedOptimizer checkpoint: entry 'local_type' is missing");
  TORCH_CHECK(saved_type.toStringRef() == type, "ShardedOptimizer checkpoint: written for a ",
              saved_type.toStringRef(), " on every shard, this one shards a ", type);
  detail::check_param_shapes(common, params_, "ShardedOptimizer checkpoint");
  const auto& groups = local_->param_groups();
  TORCH_CHECK(read_int(common, "num_local_groups") == static_cast<int64_t>(groups.size()),
              "ShardedOptimizer checkpoint: the local optimizer had ",
              read_int(common, "num_local_groups"), " param groups, this one has ", groups.size());
  // Shared by the installer (std::function needs a copyable callable).
  auto options = std::make_shared<std::vector<std::unique_ptr<torch::optim::OptimizerOptions>>>();
  for (size_t g = 0; g < groups.size(); ++g) {
    torch::serialize::InputArchive archive;
    TORCH_CHECK(common.try_read("local_group_" + std::to_string(g), archive),
                "ShardedOptimizer checkpoint: no options for local param group ", g);
    options->push_back(groups[g].options().clone());
    options->back()->serialize(archive);
  }
  auto states = std::make_shared<
      std::vector<std::pair<void*, std::unique_ptr<torch::optim::OptimizerParamState>>>>();
  const int rank = group_->getRank();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (owners_[i] != rank) continue;
    auto piece = pieces.read("param/" + std::to_string(i));
    c10::IValue has_state;
    TORCH_CHECK(piece.try_read("has_state", has_state) && has_state.isBool(),
                "ShardedOptimizer checkpoint: piece param/", i, " is damaged");
    std::unique_ptr<torch::optim::OptimizerParamState> state;
    if (has_state.toBool()) {
      state = detail::make_param_state(*local_);
      state->serialize(piece);
    }
    states->emplace_back(params_[i].unsafeGetTensorImpl(), std::move(state));
  }
  return [this, options, states] {
    auto& local_groups = local_->param_groups();
    for (size_t g = 0; g < local_groups.size(); ++g) {
      local_groups[g].set_options(std::move((*options)[g]));
    }
    for (auto& [key, state] : *states) {
      local_->state().erase(key);
      if (state) local_->state()[key] = std::move(state);
    }
  };
}

}  // namespace shampoo
