// A training checkpoint's model, read whole from any layout's checkpoint in one process, and
// written as the model file torch::load reads.
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

#include "shampoo/training_checkpoint.h"
#include "shampoo/training_checkpoint_internal.h"

namespace shampoo {
namespace {

constexpr const char* kWho = detail::kTrainingCheckpointWho;
using detail::NamedTensors;

/// Reads the model entry of a training checkpoint of any kind and format (it loads nothing
/// else): every parameter and buffer whole, and which are parameters.
class ModelReader final : public DistributedCheckpointable {
 public:
  explicit ModelReader(std::string kind) : kind_(std::move(kind)) {}
  std::string checkpoint_kind() const override { return kind_; }
  c10::intrusive_ptr<c10d::ProcessGroup> checkpoint_group() const override { return {}; }
  void save_common(torch::serialize::OutputArchive&) const override {
    TORCH_INTERNAL_ASSERT(false, "ModelReader only loads");
  }
  void save_pieces(PieceWriter&) const override {
    TORCH_INTERNAL_ASSERT(false, "ModelReader only loads");
  }
  std::function<void()> prepare_load(torch::serialize::InputArchive& common,
                                     PieceReader& pieces) override {
    c10::IValue format;
    if (common.try_read("format", format)) {
      const auto saved = detail::read_model_entry(common, pieces);
      for (size_t i = 0; i < saved.names.size(); ++i) {
        model.emplace_back(saved.names[i], saved.model->whole(saved.names[i]));
        parameter.push_back(i < saved.num_parameters);
      }
      torch::serialize::InputArchive archive;
      c10::IValue names;
      if (common.try_read("model", archive) && archive.try_read("modules", names) &&
          names.isString()) {
        modules = detail::split_lines(names.toStringRef());
      }
    } else {
      torch::serialize::InputArchive archive;
      TORCH_CHECK(common.try_read("model", archive), kWho, ": no model in the checkpoint");
      model = detail::read_named_tensors(archive);
      parameter.assign(model.size(), true);  // format 1 does not say; written as parameters
    }
    return [] {};
  }
  NamedTensors model;
  std::vector<bool> parameter;
  std::vector<std::string> modules;  // every submodule's name (format 2)

 private:
  std::string kind_;
};

ModelReader read_model(const std::filesystem::path& dir) {
  ModelReader reader(read_checkpoint_manifest(dir).kind);
  load_distributed_state(reader, dir);
  return reader;
}

/// A module as torch::nn::Module::save writes it: its tensors by name, and an archive per child.
struct ModuleArchive {
  NamedTensors tensors;
  std::vector<bool> parameter;
  std::map<std::string, ModuleArchive> children;

  /// The node of the submodule at dotted `path` ("" this one), made when missing.
  ModuleArchive& at_path(const std::string& path) {
    if (path.empty()) return *this;
    const auto dot = path.find('.');
    auto& child = children[path.substr(0, dot)];
    return dot == std::string::npos ? child : child.at_path(path.substr(dot + 1));
  }

  void write(torch::serialize::OutputArchive& archive) const {
    for (size_t i = 0; i < tensors.size(); ++i) {
      archive.write(tensors[i].first, tensors[i].second, /*is_buffer=*/!parameter[i]);
    }
    for (const auto& [name, child] : children) {
      torch::serialize::OutputArchive nested(archive.compilation_unit());
      child.write(nested);
      archive.write(name, nested);
    }
  }
};

}  // namespace

std::vector<std::pair<std::string, at::Tensor>> read_training_checkpoint_model(
    const std::filesystem::path& dir) {
  return read_model(dir).model;
}

void save_training_checkpoint_model(const std::filesystem::path& dir,
                                    const std::filesystem::path& path) {
  const auto reader = read_model(dir);
  ModuleArchive root;
  for (const auto& module : reader.modules) root.at_path(module);
  for (size_t i = 0; i < reader.model.size(); ++i) {
    const auto& name = reader.model[i].first;
    const auto dot = name.rfind('.');
    auto& owner = root.at_path(dot == std::string::npos ? "" : name.substr(0, dot));
    owner.tensors.emplace_back(dot == std::string::npos ? name : name.substr(dot + 1),
                               reader.model[i].second);
    owner.parameter.push_back(reader.parameter[i]);
  }
  torch::serialize::OutputArchive archive;
  root.write(archive);
  auto temporary = path;
  temporary += ".tmp-" + std::to_string(::getpid());
  archive.save_to(temporary.string());
  std::filesystem::rename(temporary, path);
}

}  // namespace shampoo
