// Whole-run checkpoints of format 1: the optimizer in its layout's own form (a
// DistributedCheckpointable's common part and pieces, or a LibTorch optimizer's whole archive
// written by rank 0), which only the same layout loads (at any number of ranks). Every
// checkpoint before 2026-12-02 has this format; it is still written for optimizers whose
// per-parameter state is not known (LBFGS, the user's own).
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstring>
#include <memory>
#include <sstream>

#include "parallel/full_sharding/fully_sharded.h"
#include "shampoo/training_checkpoint.h"
#include "shampoo/training_checkpoint_internal.h"

namespace shampoo {
namespace detail {

void write_named_tensors(torch::serialize::OutputArchive& archive, const NamedTensors& named) {
  std::string names;
  for (size_t i = 0; i < named.size(); ++i) {
    names += named[i].first + "\n";
    archive.write("tensor_" + std::to_string(i), named[i].second.detach().cpu());
  }
  archive.write("names", c10::IValue(names));
}

NamedTensors read_named_tensors(torch::serialize::InputArchive& archive) {
  c10::IValue names;
  TORCH_CHECK(archive.try_read("names", names) && names.isString(), kTrainingCheckpointWho,
              ": the model's entry is damaged");
  NamedTensors named;
  std::istringstream lines(names.toStringRef());
  std::string name;
  while (std::getline(lines, name)) {
    at::Tensor tensor;
    TORCH_CHECK(archive.try_read("tensor_" + std::to_string(named.size()), tensor),
                kTrainingCheckpointWho, ": the model's tensor ", name, " is missing");
    named.emplace_back(name, tensor);
  }
  return named;
}

}  // namespace detail

namespace {

constexpr const char* kWho = detail::kTrainingCheckpointWho;

/// The bytes of a LibTorch optimizer's own archive, as a uint8 tensor (loading then maps its
/// tensors to the run's device).
at::Tensor archive_bytes(const torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive whole;
  optimizer.save(whole);
  std::ostringstream out;
  whole.save_to(out);
  const auto text = out.str();
  auto bytes = at::empty({static_cast<int64_t>(text.size())}, at::kByte);
  std::memcpy(bytes.data_ptr(), text.data(), text.size());
  return bytes;
}

std::string describe_kind(const std::string& kind) {
  return kind == "replicated" ? "LibTorch optimizer" : kind;
}

/// Under full sharding the parameters are the wrapper's pieces: format 1's model entry holds the
/// buffers only.
bool fully_sharded(const torch::optim::Optimizer* optimizer) {
  return dynamic_cast<const FullyShardedOptimizer*>(optimizer) != nullptr;
}

}  // namespace

void TrainingCheckpoint::save_common_by_layout(torch::serialize::OutputArchive& common) const {
  const auto unit = common.compilation_unit();
  auto named = named_state(!fully_sharded(state_.optimizer));
  if (!saved_buffers_.empty()) {
    TORCH_CHECK(saved_buffers_.size() <= named.size(), kWho, ": more saved buffers than tensors");
    const size_t first_buffer = named.size() - saved_buffers_.size();
    for (size_t i = 0; i < saved_buffers_.size(); ++i) {
      named[first_buffer + i].second = saved_buffers_[i];
    }
  }
  torch::serialize::OutputArchive model(unit);
  detail::write_named_tensors(model, named);
  common.write("model", model);

  torch::serialize::OutputArchive optimizer(unit);
  if (const auto* distributed = checkpointable()) {
    optimizer.write("kind", c10::IValue(distributed->checkpoint_kind()));
    torch::serialize::OutputArchive own(unit);
    distributed->save_common(own);
    optimizer.write("common", own);
  } else {
    optimizer.write("kind", c10::IValue(std::string("replicated")));
    optimizer.write("state", archive_bytes(*state_.optimizer));
  }
  common.write("optimizer", optimizer);
}

void TrainingCheckpoint::save_pieces_by_layout(PieceWriter& pieces) const {
  const auto* distributed = checkpointable();
  // Hybrid sharding: the replicas hold the same shards, so replica 0 writes them (every rank
  // still writes its own generators); any rank reads them back, whatever its replica.
  if (distributed != nullptr &&
      (distributed->checkpoint_replica() == 0 || distributed->every_replica_writes())) {
    auto nested = pieces.nested("optimizer/");
    distributed->save_pieces(nested);
  }
}

std::function<void()> TrainingCheckpoint::prepare_model_by_layout(
    torch::serialize::InputArchive& common) const {
  torch::serialize::InputArchive archive;
  TORCH_CHECK(common.try_read("model", archive), kWho, ": no model in the checkpoint");
  const auto saved = detail::read_named_tensors(archive);
  const auto live = named_state(!fully_sharded(state_.optimizer));
  TORCH_CHECK(saved.size() == live.size(), kWho, ": the model has ", saved.size(),
              " parameters and buffers there, ", live.size(),
              " here (a checkpoint of another model?)");
  for (size_t i = 0; i < live.size(); ++i) {
    const auto& [name, tensor] = live[i];
    TORCH_CHECK(saved[i].first == name && saved[i].second.sizes() == tensor.sizes() &&
                    saved[i].second.dtype() == tensor.dtype(),
                kWho, ": the model's tensor ", i, " is ", saved[i].first, " ",
                saved[i].second.sizes(), " (", saved[i].second.dtype(), ") there and ", name, " ",
                tensor.sizes(), " (", tensor.dtype(), ") here (a checkpoint of another model?)");
  }
  return [saved, live] {
    at::NoGradGuard no_grad;
    // In place: the optimizer and a gradient synchronizer hold these tensors.
    for (size_t i = 0; i < live.size(); ++i) live[i].second.copy_(saved[i].second);
  };
}

std::function<void()> TrainingCheckpoint::prepare_optimizer_by_layout(
    torch::serialize::InputArchive& common, PieceReader& pieces) const {
  torch::serialize::InputArchive archive;
  c10::IValue kind;
  TORCH_CHECK(
      common.try_read("optimizer", archive) && archive.try_read("kind", kind) && kind.isString(),
      kWho, ": no optimizer in the checkpoint");
  auto* distributed = checkpointable();
  const std::string expected = detail::optimizer_kind(checkpointable());
  TORCH_CHECK(kind.toStringRef() == expected, kWho,
              ": written in format 1 (before 2026-12-02, or by an optimizer whose state is not "
              "saved per parameter), which keeps the optimizer in the form of the layout that "
              "wrote it: a ",
              describe_kind(kind.toStringRef()), " there, a ", describe_kind(expected),
              " here. Resume it with a ", describe_kind(kind.toStringRef()),
              " (at any number of ranks) and save it again: checkpoints of this version load "
              "into any layout");
  if (distributed != nullptr) {
    torch::serialize::InputArchive own;
    TORCH_CHECK(archive.try_read("common", own), kWho, ": the optimizer's entry is damaged");
    auto nested = pieces.nested("optimizer/");
    return distributed->prepare_load(own, nested);
  }
  at::Tensor bytes;
  TORCH_CHECK(archive.try_read("state", bytes), kWho, ": the optimizer's entry is damaged");
  const auto contiguous = bytes.contiguous();
  std::istringstream stream(std::string(static_cast<const char*>(contiguous.data_ptr()),
                                        static_cast<size_t>(contiguous.numel())));
  auto whole = std::make_shared<torch::serialize::InputArchive>();
  whole->load_from(stream, state_.device);
  auto* optimizer = state_.optimizer;
  return [optimizer, whole] { optimizer->load(*whole); };
}

}  // namespace shampoo
