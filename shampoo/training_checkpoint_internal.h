#pragma once
/// What the two formats of whole-run checkpoints share (training_checkpoint.cpp: format 2, by
/// parameter name; training_checkpoint_by_layout.cpp: format 1, the optimizer in its layout's own
/// form). Internal: not installed.

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "parallel/checkpoints/distributed_checkpoint.h"
#include "parallel/optimizers/portable_checkpoint.h"

namespace shampoo::detail {

inline constexpr const char* kTrainingCheckpointWho = "training checkpoint";
/// The format of the common part's "format" entry; format 1 has none.
inline constexpr int64_t kTrainingCheckpointFormat = 2;

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// Format 1's model entry: the tensors in order ("tensor_<i>", on the CPU) and their names.
void write_named_tensors(torch::serialize::OutputArchive& archive, const NamedTensors& named);
NamedTensors read_named_tensors(torch::serialize::InputArchive& archive);

/// Lines joined with a newline after each, and split again.
std::string joined_lines(const std::vector<std::string>& lines);
std::vector<std::string> split_lines(const std::string& text);
/// The string entry `key`; an error naming `what` as damaged otherwise.
std::string read_string(torch::serialize::InputArchive& archive, const std::string& key,
                        const std::string& what);
std::vector<int64_t> longs_of(const at::Tensor& tensor);
/// The kind a checkpoint records for its optimizer: `distributed`'s checkpoint_kind(), or
/// "replicated" for an optimizer without one (a LibTorch optimizer, the same on every rank).
std::string optimizer_kind(const DistributedCheckpointable* distributed);
/// The demangled type of options (a checkpoint records it with each param group).
std::string type_name(const torch::optim::OptimizerOptions& options);

/// The model as a checkpoint of format 2 holds it: every parameter, then every buffer, by name.
struct SavedTensors {
  std::vector<std::string> names;
  size_t num_parameters = 0;
  std::shared_ptr<SavedModel> model;
};
SavedTensors read_model_entry(torch::serialize::InputArchive& common, const PieceReader& pieces);

}  // namespace shampoo::detail
