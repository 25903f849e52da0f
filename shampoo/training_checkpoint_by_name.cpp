// Whole-run checkpoints of format 2: the model by name (values whole, or full sharding's row
// pieces) and the optimizer by parameter name (parallel/optimizers/portable_checkpoint.h): the
// param groups with their options, matched to this run's by their parameters' names, and each
// layout's pieces.
#include <c10/util/Exception.h>
#include <c10/util/TypeIndex.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <map>
#include <memory>
#include <sstream>
#include <typeinfo>
#include <utility>

#include "shampoo/training_checkpoint.h"
#include "shampoo/training_checkpoint_internal.h"

namespace shampoo {
namespace detail {
namespace {
constexpr const char* kWho = kTrainingCheckpointWho;
}  // namespace

std::string joined_lines(const std::vector<std::string>& lines) {
  std::string out;
  for (const auto& line : lines) out += line + "\n";
  return out;
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) out.push_back(line);
  return out;
}

std::string read_string(torch::serialize::InputArchive& archive, const std::string& key,
                        const std::string& what) {
  c10::IValue value;
  TORCH_CHECK(archive.try_read(key, value) && value.isString(), kWho, ": ", what, " is damaged");
  return value.toStringRef();
}

std::vector<int64_t> longs_of(const at::Tensor& tensor) {
  const auto flat = tensor.to(at::kCPU, at::kLong).contiguous();
  return {flat.data_ptr<int64_t>(), flat.data_ptr<int64_t>() + flat.numel()};
}

std::string type_name(const torch::optim::OptimizerOptions& options) {
  return c10::demangle(typeid(options).name());
}

SavedTensors read_model_entry(torch::serialize::InputArchive& common, const PieceReader& pieces) {
  torch::serialize::InputArchive archive;
  TORCH_CHECK(common.try_read("model", archive), kWho, ": no model in the checkpoint");
  SavedTensors out;
  out.names = split_lines(read_string(archive, "names", "the model's entry"));
  out.num_parameters = static_cast<size_t>(
      read_int_entry(archive, "num_parameters", std::string(kWho) + ": the model"));
  const int64_t row_pieces =
      read_int_entry(archive, "row_pieces", std::string(kWho) + ": the model");
  std::map<std::string, SavedModel::Entry> entries;
  for (size_t i = 0; i < out.names.size(); ++i) {
    SavedModel::Entry entry;
    entry.parameter = i < out.num_parameters;
    at::Tensor shape;
    TORCH_CHECK(archive.try_read("shape_" + std::to_string(i), shape, /*is_buffer=*/true), kWho,
                ": the model's tensor ", out.names[i], " has no shape");
    entry.sizes = longs_of(shape);
    entry.dtype = static_cast<at::ScalarType>(detail::read_int_entry(
        archive, "dtype_" + std::to_string(i), std::string(kWho) + ": the model"));
    archive.try_read("tensor_" + std::to_string(i), entry.whole);
    TORCH_CHECK(entry.whole.defined() || (i < out.num_parameters && row_pieces > 0), kWho,
                ": the model's tensor ", out.names[i], " is missing");
    entries.emplace(out.names[i], std::move(entry));
  }
  out.model = std::make_shared<SavedModel>(std::move(entries), row_pieces, pieces);
  return out;
}

}  // namespace detail

namespace {

constexpr const char* kWho = detail::kTrainingCheckpointWho;
using detail::joined_lines;
using detail::longs_of;
using detail::read_int_entry;
using detail::read_string;
using detail::split_lines;
using detail::type_name;

// ---- the optimizer entry of format 2: param groups by parameter name ----

struct SavedGroup {
  std::string options_type;
  std::vector<std::string> names;
  std::vector<int64_t> steps;
  std::shared_ptr<torch::serialize::InputArchive> options;
};

std::vector<SavedGroup> read_groups(torch::serialize::InputArchive& optimizer) {
  const auto count =
      read_int_entry(optimizer, "num_groups", std::string(kWho) + ": the optimizer");
  std::vector<SavedGroup> groups;
  for (int64_t g = 0; g < count; ++g) {
    torch::serialize::InputArchive archive;
    const auto what = "param group " + std::to_string(g) + " of the optimizer";
    TORCH_CHECK(optimizer.try_read("group_" + std::to_string(g), archive), kWho, ": ", what,
                " is missing");
    SavedGroup group;
    group.options_type = read_string(archive, "options_type", what);
    group.names = split_lines(read_string(archive, "names", what));
    at::Tensor steps;
    TORCH_CHECK(archive.try_read("steps", steps, /*is_buffer=*/true), kWho, ": ", what,
                " is damaged");
    group.steps = longs_of(steps);
    TORCH_CHECK(group.steps.size() == group.names.size(), kWho, ": ", what, " is damaged");
    group.options = std::make_shared<torch::serialize::InputArchive>();
    TORCH_CHECK(archive.try_read("options", *group.options), kWho, ": ", what, " is damaged");
    groups.push_back(std::move(group));
  }
  return groups;
}

/// For each param group here, the saved group with the same parameters (by name); errors name
/// the first difference.
std::vector<size_t> match_groups(const std::vector<SavedGroup>& saved,
                                 const std::vector<const torch::optim::OptimizerParamGroup*>& live,
                                 const std::function<std::string(const at::Tensor&)>& name_of) {
  std::map<std::string, size_t> saved_group_of;
  for (size_t s = 0; s < saved.size(); ++s) {
    for (const auto& name : saved[s].names) saved_group_of[name] = s;
  }
  const std::string rebuild = " (build the param groups as the saving run did: the same parameters in each)";
  std::vector<bool> used(saved.size(), false);
  std::vector<size_t> match;
  for (size_t g = 0; g < live.size(); ++g) {
    const auto& params = live[g]->params();
    size_t s = saved.size();
    if (params.empty()) {
      for (size_t k = 0; k < saved.size() && s == saved.size(); ++k) {
        if (!used[k] && saved[k].names.empty()) s = k;
      }
      TORCH_CHECK(s < saved.size(), kWho, ": param group ", g,
                  " is empty here and the saving run had no other empty group", rebuild);
    } else {
      for (const auto& p : params) {
        const auto name = name_of(p);
        const auto it = saved_group_of.find(name);
        TORCH_CHECK(it != saved_group_of.end(), kWho, ": parameter ", name, " is in param group ",
                    g, " here and in no param group there (the saving run did not step it)",
                    rebuild);
        TORCH_CHECK(s == saved.size() || s == it->second, kWho, ": param group ", g, " here holds ",
                    name, ", which was in param group ", it->second, " there, and ",
                    name_of(params.front()), ", which was in param group ", s, rebuild);
        s = it->second;
      }
      TORCH_CHECK(saved[s].names.size() == params.size() && !used[s], kWho, ": param group ", g,
                  " here has ", params.size(), " parameters, its group there (", s, ") had ",
                  saved[s].names.size(), rebuild);
    }
    TORCH_CHECK(saved[s].options_type == type_name(live[g]->options()), kWho, ": param group ", g,
                " has options of type ", type_name(live[g]->options()), " here and ",
                saved[s].options_type,
                " there (another optimizer; the optimizer of a parameter cannot change across a "
                "resume)");
    used[s] = true;
    match.push_back(s);
  }
  for (size_t s = 0; s < saved.size(); ++s) {
    TORCH_CHECK(used[s], kWho, ": param group ", s, " there",
                saved[s].names.empty() ? " (empty)" : " holds " + saved[s].names.front() + ", which is",
                " in no param group here", rebuild);
  }
  return match;
}


}  // namespace

void TrainingCheckpoint::save_model(torch::serialize::OutputArchive& common) const {
  const auto* optimizer = portable();
  const int64_t row_pieces = optimizer->portable_row_pieces();
  auto named = named_state(/*with_parameters=*/true);
  const size_t num_parameters = state_.model->named_parameters().size();
  if (!saved_buffers_.empty()) {
    TORCH_CHECK(saved_buffers_.size() <= named.size() - num_parameters, kWho,
                ": more saved buffers than buffers");
    const size_t first_buffer = named.size() - saved_buffers_.size();
    for (size_t i = 0; i < saved_buffers_.size(); ++i) {
      named[first_buffer + i].second = saved_buffers_[i];
    }
  }
  torch::serialize::OutputArchive model(common.compilation_unit());
  std::vector<std::string> names;
  for (size_t i = 0; i < named.size(); ++i) {
    const auto& [name, tensor] = named[i];
    const bool parameter = i < num_parameters;
    names.push_back(name);
    const auto sizes = parameter ? optimizer->portable_full_sizes(tensor) : tensor.sizes().vec();
    model.write("shape_" + std::to_string(i), at::tensor(sizes, at::kLong), /*is_buffer=*/true);
    model.write("dtype_" + std::to_string(i),
                c10::IValue(static_cast<int64_t>(tensor.scalar_type())));
    // Full sharding's parameters are its row pieces.
    if (!parameter || row_pieces == 0) {
      model.write("tensor_" + std::to_string(i), tensor.detach().cpu());
    }
  }
  model.write("names", c10::IValue(joined_lines(names)));
  // Every submodule (those without tensors too), for a model file written without the model.
  model.write("modules",
              c10::IValue(joined_lines(state_.model->named_modules("", /*include_self=*/false).keys())));
  model.write("num_parameters", c10::IValue(static_cast<int64_t>(num_parameters)));
  model.write("row_pieces", c10::IValue(row_pieces));
  common.write("model", model);
}

void TrainingCheckpoint::save_optimizer(torch::serialize::OutputArchive& common) const {
  const auto* optimizer = portable();
  const auto unit = common.compilation_unit();
  torch::serialize::OutputArchive archive(unit);
  archive.write("kind", c10::IValue(detail::optimizer_kind(checkpointable())));
  archive.write("between_steps", c10::IValue(optimizer->portable_between_steps()));
  const auto groups = optimizer->portable_groups();
  archive.write("num_groups", c10::IValue(static_cast<int64_t>(groups.size())));
  int64_t steps_taken = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    torch::serialize::OutputArchive group(unit);
    torch::serialize::OutputArchive options(unit);
    groups[g]->options().serialize(options);
    group.write("options", options);
    group.write("options_type", c10::IValue(type_name(groups[g]->options())));
    std::vector<std::string> names;
    std::vector<int64_t> steps;
    for (const auto& p : groups[g]->params()) {
      names.push_back(name_of(p));
      steps.push_back(optimizer->portable_param_step(p));
      steps_taken = std::max(steps_taken, steps.back());
    }
    group.write("names", c10::IValue(joined_lines(names)));
    group.write("steps", at::tensor(steps, at::kLong), /*is_buffer=*/true);
    archive.write("group_" + std::to_string(g), group);
  }
  archive.write("steps_taken", c10::IValue(steps_taken));
  torch::serialize::OutputArchive layout(unit);
  optimizer->save_portable_layout(layout);
  archive.write("layout", layout);
  common.write("optimizer", archive);
}


std::function<void()> TrainingCheckpoint::prepare_model(const SavedModel& saved) const {
  const auto* optimizer = portable();
  // Full sharding installs its rows of the parameters itself.
  const bool optimizer_installs = optimizer->portable_row_pieces() > 0;
  const auto live = named_state(/*with_parameters=*/true);
  const size_t num_parameters = state_.model->named_parameters().size();
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (the model's tensor, its value)
  for (size_t i = 0; i < live.size(); ++i) {
    const auto& [name, tensor] = live[i];
    const bool parameter = i < num_parameters;
    TORCH_CHECK(saved.contains(name), kWho, ": the model's ", parameter ? "parameter " : "buffer ",
                name, " is not in the checkpoint (a checkpoint of another model?)");
    const auto& entry = saved.entry(name);
    TORCH_CHECK(entry.parameter == parameter, kWho, ": ", name, " is a ",
                entry.parameter ? "parameter" : "buffer", " there and a ",
                parameter ? "parameter" : "buffer", " here (a checkpoint of another model?)");
    const auto sizes = parameter ? optimizer->portable_full_sizes(tensor) : tensor.sizes().vec();
    TORCH_CHECK(entry.sizes == sizes && entry.dtype == tensor.scalar_type(), kWho, ": ", name,
                " is ", at::IntArrayRef(entry.sizes), " (", entry.dtype, ") there and ",
                at::IntArrayRef(sizes), " (", tensor.scalar_type(),
                ") here (a checkpoint of another model?)");
    if (!parameter || !optimizer_installs) copies.emplace_back(tensor, saved.whole(name));
  }
  TORCH_CHECK(saved.size() == live.size(), kWho, ": the checkpoint holds ", saved.size(),
              " parameters and buffers, the model ", live.size(),
              " (a checkpoint of another model?)");
  return [copies] {
    at::NoGradGuard no_grad;
    // In place: the optimizer and a gradient synchronizer hold these tensors.
    for (const auto& [tensor, value] : copies) tensor.copy_(value);
  };
}

std::function<void()> TrainingCheckpoint::prepare_optimizer(
    torch::serialize::InputArchive& common, PieceReader& pieces,
    const std::shared_ptr<SavedModel>& model) const {
  torch::serialize::InputArchive archive;
  TORCH_CHECK(common.try_read("optimizer", archive), kWho, ": no optimizer in the checkpoint");
  const auto kind = read_string(archive, "kind", "the optimizer's entry");
  const auto here = detail::optimizer_kind(checkpointable());
  c10::IValue between;
  TORCH_CHECK(archive.try_read("between_steps", between) && between.isBool(), kWho,
              ": the optimizer's entry is damaged");
  TORCH_CHECK(between.toBool() || kind == here, kWho,
              ": saved in the middle of a gradient accumulation by a ", kind,
              ", whose accumulated gradients only a ", kind,
              " takes (at any number of ranks); resume it with one, or save at a step boundary");
  const auto saved = read_groups(archive);
  auto* optimizer = portable();
  const auto live = optimizer->portable_groups();
  const auto names = [this](const at::Tensor& p) { return name_of(p); };
  const auto match = match_groups(saved, live, names);
  PortableLoad load;
  auto nested = pieces.nested("optimizer/");
  load.pieces = &nested;
  load.names = names;
  load.model = model.get();
  for (const auto s : match) load.group_options.push_back(saved[s].options);
  for (const auto& group : saved) {
    for (size_t i = 0; i < group.names.size(); ++i) load.param_steps[group.names[i]] = group.steps[i];
  }
  load.steps_taken =
      read_int_entry(archive, "steps_taken", std::string(kWho) + ": the optimizer");
  if (kind == here) {
    load.layout = std::make_shared<torch::serialize::InputArchive>();
    TORCH_CHECK(archive.try_read("layout", *load.layout), kWho,
                ": the optimizer's entry is damaged");
  }
  return optimizer->prepare_portable_load(load);
}


}  // namespace shampoo
