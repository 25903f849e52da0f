#include "examples/training_checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <regex>
#include <sstream>
#include <system_error>
#include <utility>

namespace shampoo::examples {

namespace {

using Group = c10::intrusive_ptr<c10d::ProcessGroup>;
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// "name=value" lines.
std::string render_signature(const RunSignature& signature) {
  std::string text;
  for (const auto& [name, value] : signature) text += name + "=" + value + "\n";
  return text;
}

RunSignature parse_signature(const std::string& text) {
  RunSignature signature;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    const auto equals = line.find('=');
    if (equals == std::string::npos) continue;
    signature.emplace_back(line.substr(0, equals), line.substr(equals + 1));
  }
  return signature;
}

/// The value of `name` in `signature`, or "(none)".
std::string field(const RunSignature& signature, const std::string& name) {
  for (const auto& [key, value] : signature) {
    if (key == name) return value;
  }
  return "(none)";
}

/// Every rank's `value` (collective); {value} without a group.
std::vector<int64_t> all_gather(const Group& group, int64_t value) {
  if (!group || group->getSize() == 1) return {value};
  std::vector<at::Tensor> input{at::tensor({value}, at::kLong)};
  std::vector<std::vector<at::Tensor>> output(1);
  for (int r = 0; r < group->getSize(); ++r) output[0].push_back(at::empty({1}, at::kLong));
  group->allgather(output, input)->wait();
  std::vector<int64_t> values;
  for (const auto& tensor : output[0]) values.push_back(tensor.item<int64_t>());
  return values;
}

/// "0, 2" for the ranks whose value is `wanted`.
std::string ranks_with(const std::vector<int64_t>& values, int64_t wanted) {
  std::string ranks;
  for (size_t r = 0; r < values.size(); ++r) {
    if (values[r] != wanted) continue;
    ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  }
  return ranks;
}

/// A file of the trainer's earlier per-rank checkpoints in `dir`, or "".
std::string earlier_format_file(const std::filesystem::path& dir) {
  static const std::regex pattern(R"(rank\d+-of-\d+-epoch\d+\.pt)");
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const auto name = entry.path().filename().string();
    if (std::regex_match(name, pattern)) return name;
  }
  return "";
}

at::Tensor to_bytes(const std::string& text) {
  auto bytes = at::empty({static_cast<int64_t>(text.size())}, at::kByte);
  if (!text.empty()) std::memcpy(bytes.data_ptr<uint8_t>(), text.data(), text.size());
  return bytes;
}

std::string from_bytes(const at::Tensor& bytes) {
  const auto cpu = bytes.to(at::kCPU).contiguous();
  return std::string(reinterpret_cast<const char*>(cpu.data_ptr<uint8_t>()),
                     static_cast<size_t>(cpu.numel()));
}

std::string metrics_key(int rank, int world_size) {
  return "metrics/rank-" + std::to_string(rank) + "-of-" + std::to_string(world_size);
}

/// The parameters (unless `with_parameters` is false: a fully sharded model saves them itself),
/// then the buffers, by name (the module's own tensors).
NamedTensors named_state(const torch::nn::Module& model, bool with_parameters = true) {
  NamedTensors named;
  if (with_parameters) {
    for (const auto& item : model.named_parameters()) named.emplace_back(item.key(), item.value());
  }
  for (const auto& item : model.named_buffers()) named.emplace_back(item.key(), item.value());
  return named;
}

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
  archive.read("names", names);
  NamedTensors named;
  std::istringstream lines(names.toStringRef());
  std::string name;
  while (std::getline(lines, name)) {
    at::Tensor tensor;
    archive.read("tensor_" + std::to_string(named.size()), tensor);
    named.emplace_back(name, tensor);
  }
  return named;
}

/// Every floating-point buffer's mean over the ranks (collective); others as they are.
std::vector<at::Tensor> mean_buffers(const torch::nn::Module& model, const Group& group) {
  std::vector<at::Tensor> means;
  for (const auto& buffer : model.buffers()) {
    auto mean = buffer.detach().clone();
    if (mean.is_floating_point()) {
      std::vector<at::Tensor> tensors{mean};
      group->allreduce(tensors)->wait();
      mean.div_(group->getSize());
    }
    means.push_back(mean);
  }
  return means;
}

void set_generator_state(at::Generator generator, const at::Tensor& state) {
  // A default generator is shared by the process; its mutex guards set_state.
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state.cpu());
}

}  // namespace

TrainingCheckpoint::TrainingCheckpoint(std::filesystem::path dir, Group group,
                                       RunSignature signature, State state, c10::Device device)
    : dir_(std::move(dir)),
      group_(std::move(group)),
      signature_(std::move(signature)),
      state_(state),
      device_(device) {
  TORCH_INTERNAL_ASSERT(state_.model && (state_.optimizer || state_.sharded) && state_.metrics &&
                        state_.progress);
  if (group_) {
    rank_ = group_->getRank();
    world_size_ = group_->getSize();
  }
}

shampoo::DistributedCheckpointable* TrainingCheckpoint::checkpointable() const {
  if (state_.sharded != nullptr) return state_.sharded;
  return dynamic_cast<DistributedCheckpointable*>(state_.optimizer);
}

bool TrainingCheckpoint::exists() const {
  const bool committed = shampoo::distributed_checkpoint_exists(dir_);
  const std::string earlier = committed ? "" : earlier_format_file(dir_);
  const auto seen = all_gather(group_, (committed ? 1 : 0) + (earlier.empty() ? 0 : 2));
  TORCH_CHECK(ranks_with(seen, 2).empty(), "--checkpoint-dir ", dir_.string(),
              " holds checkpoints of the trainer's earlier per-rank format (",
              earlier.empty() ? std::string("rank<r>-of-<w>-epoch<e>.pt") : earlier,
              "), which this trainer does not read; use another folder");
  const auto with = ranks_with(seen, 1);
  const auto without = ranks_with(seen, 0);
  TORCH_CHECK(with.empty() || without.empty(), "--checkpoint-dir ", dir_.string(), ": rank(s) ",
              with, " see a committed checkpoint there, rank(s) ", without,
              " do not; every rank must see the same folder (on several machines, put it on a "
              "filesystem that every node mounts)");
  return committed;
}

int64_t TrainingCheckpoint::load() {
  shampoo::load_distributed_state(*this, dir_, group_);
  return shampoo::read_checkpoint_manifest(dir_).world_size;
}

void TrainingCheckpoint::save(bool average_buffers) {
  mean_metrics_ = state_.metrics->mean_over_ranks(group_);
  if (average_buffers && group_ && world_size_ > 1) {
    saved_buffers_ = mean_buffers(*state_.model, group_);
  }
  std::exception_ptr error;
  try {
    shampoo::save_distributed_state(*this, dir_, group_);
  } catch (...) {
    error = std::current_exception();
  }
  mean_metrics_.reset();
  saved_buffers_.clear();
  if (error) std::rethrow_exception(error);
}

void TrainingCheckpoint::save_common(torch::serialize::OutputArchive& common) const {
  const auto unit = common.compilation_unit();
  common.write("signature", c10::IValue(render_signature(signature_)));
  common.write("progress",
               at::tensor({state_.progress->epoch, state_.progress->iteration}, at::kLong));
  torch::serialize::OutputArchive metrics(unit);
  (mean_metrics_ ? *mean_metrics_ : *state_.metrics).save(metrics);
  common.write("metrics", metrics);

  auto named = named_state(*state_.model, state_.sharded == nullptr);
  const size_t first_buffer = named.size() - saved_buffers_.size();
  for (size_t i = 0; i < saved_buffers_.size(); ++i)
    named[first_buffer + i].second = saved_buffers_[i];
  torch::serialize::OutputArchive model(unit);
  write_named_tensors(model, named);
  common.write("model", model);

  torch::serialize::OutputArchive rng(unit);
  rng.write("cpu", at::detail::getDefaultCPUGenerator().get_state());
  if (device_.is_cuda())
    rng.write("cuda", at::globalContext().defaultGenerator(device_).get_state());
  common.write("rng", rng);

  torch::serialize::OutputArchive optimizer(unit);
  if (const auto* distributed = checkpointable()) {
    optimizer.write("kind", c10::IValue(distributed->checkpoint_kind()));
    torch::serialize::OutputArchive own(unit);
    distributed->save_common(own);
    optimizer.write("common", own);
  } else {
    // A torch::optim optimizer is replicated: every rank holds the same state. Kept as the bytes
    // of its own archive, so that loading maps its tensors to the run's device.
    torch::serialize::OutputArchive whole;
    state_.optimizer->save(whole);
    std::ostringstream bytes;
    whole.save_to(bytes);
    optimizer.write("kind", c10::IValue(std::string("replicated")));
    optimizer.write("state", to_bytes(bytes.str()));
  }
  common.write("optimizer", optimizer);
  if (state_.scaler != nullptr) {
    torch::serialize::OutputArchive scaler(unit);
    state_.scaler->save(scaler);
    common.write("grad_scaler", scaler);
  }
}

void TrainingCheckpoint::save_pieces(shampoo::PieceWriter& pieces) const {
  if (world_size_ > 1) {
    torch::serialize::OutputArchive metrics;
    state_.metrics->save(metrics);
    pieces.add(metrics_key(rank_, world_size_), std::move(metrics));
  }
  if (const auto* distributed = checkpointable()) {
    auto nested = pieces.nested("optimizer/");
    distributed->save_pieces(nested);
  }
}

void TrainingCheckpoint::check_signature(torch::serialize::InputArchive& common) const {
  c10::IValue text;
  common.read("signature", text);
  const RunSignature saved = parse_signature(text.toStringRef());
  RunSignature names = signature_;
  for (const auto& entry : saved) names.push_back(entry);
  for (const auto& [name, unused] : names) {
    const auto there = field(saved, name);
    const auto here = field(signature_, name);
    TORCH_CHECK(there == here, "--checkpoint-dir ", dir_.string(),
                " holds a checkpoint of another run: ", name, " is ", there, " there and ", here,
                " in this run; resume with the same settings, or use another --checkpoint-dir");
  }
}

std::function<void()> TrainingCheckpoint::prepare_model(
    torch::serialize::InputArchive& common) const {
  torch::serialize::InputArchive archive;
  common.read("model", archive);
  const auto saved = read_named_tensors(archive);
  const auto live = named_state(*state_.model, state_.sharded == nullptr);
  TORCH_CHECK(saved.size() == live.size(), "--checkpoint-dir ", dir_.string(), ": the model has ",
              saved.size(), " parameters and buffers there, ", live.size(), " in this run");
  for (size_t i = 0; i < live.size(); ++i) {
    const auto& [name, tensor] = live[i];
    TORCH_CHECK(saved[i].first == name && saved[i].second.sizes() == tensor.sizes() &&
                    saved[i].second.dtype() == tensor.dtype(),
                "--checkpoint-dir ", dir_.string(), ": the model's tensor ", i, " is ",
                saved[i].first, " ", saved[i].second.sizes(), " there and ", name, " ",
                tensor.sizes(), " in this run");
  }
  return [saved, live] {
    torch::NoGradGuard no_grad;
    // In place: the optimizer and the gradient synchronizer hold these tensors.
    for (size_t i = 0; i < live.size(); ++i) live[i].second.copy_(saved[i].second);
  };
}

std::function<void()> TrainingCheckpoint::prepare_optimizer(torch::serialize::InputArchive& common,
                                                            shampoo::PieceReader& pieces) {
  torch::serialize::InputArchive archive;
  common.read("optimizer", archive);
  c10::IValue kind;
  archive.read("kind", kind);
  auto* distributed = checkpointable();
  const std::string expected = distributed ? distributed->checkpoint_kind() : "replicated";
  TORCH_CHECK(kind.toStringRef() == expected, "--checkpoint-dir ", dir_.string(),
              ": the optimizer state there is of a ", kind.toStringRef(),
              " optimizer, this run's is of a ", expected, " one");
  if (distributed) {
    torch::serialize::InputArchive own;
    archive.read("common", own);
    auto nested = pieces.nested("optimizer/");
    return distributed->prepare_load(own, nested);
  }
  at::Tensor bytes;
  archive.read("state", bytes);
  std::istringstream stream(from_bytes(bytes));
  auto whole = std::make_shared<torch::serialize::InputArchive>();
  whole->load_from(stream, device_);
  auto* optimizer = state_.optimizer;
  return [optimizer, whole] { optimizer->load(*whole); };
}

std::function<void()> TrainingCheckpoint::prepare_scaler(
    torch::serialize::InputArchive& common) const {
  auto archive = std::make_shared<torch::serialize::InputArchive>();
  const bool saved = common.try_read("grad_scaler", *archive);
  TORCH_CHECK(saved || state_.scaler == nullptr, "--checkpoint-dir ", dir_.string(),
              ": written by a run without a GradScaler (--amp off or bf16), and this run has one "
              "(--amp fp16); resume with the --amp of the run that wrote it");
  TORCH_CHECK(!saved || state_.scaler != nullptr, "--checkpoint-dir ", dir_.string(),
              ": written by a run with a GradScaler (--amp fp16), whose scale this run would "
              "lose; resume with --amp fp16");
  if (!saved) return [] {};
  return state_.scaler->prepare_load(archive);
}

std::function<void()> TrainingCheckpoint::prepare_load(torch::serialize::InputArchive& common,
                                                       shampoo::PieceReader& pieces) {
  check_signature(common);
  at::Tensor progress_tensor;
  common.read("progress", progress_tensor);
  const TrainingProgress progress{progress_tensor[0].item<int64_t>(),
                                  progress_tensor[1].item<int64_t>()};
  // Rank r's own metrics at the same number of ranks, else the ranks' mean.
  LossMetrics metrics = *state_.metrics;
  torch::serialize::InputArchive metrics_archive;
  if (pieces.contains(metrics_key(rank_, world_size_))) {
    metrics_archive = pieces.read(metrics_key(rank_, world_size_));
  } else {
    common.read("metrics", metrics_archive);
  }
  metrics.load(metrics_archive);
  TORCH_CHECK(metrics.iteration() == progress.iteration, "--checkpoint-dir ", dir_.string(),
              ": metrics at iteration ", metrics.iteration(), ", progress at ", progress.iteration,
              "; the checkpoint is inconsistent");
  torch::serialize::InputArchive rng;
  common.read("rng", rng);
  at::Tensor cpu_state, cuda_state;
  rng.read("cpu", cpu_state);
  rng.try_read("cuda", cuda_state);
  auto install_model = prepare_model(common);
  auto install_optimizer = prepare_optimizer(common, pieces);
  auto install_scaler = prepare_scaler(common);
  return [this, progress, metrics, cpu_state, cuda_state, install_model, install_optimizer,
          install_scaler] {
    install_model();
    install_optimizer();
    install_scaler();
    *state_.metrics = metrics;
    *state_.progress = progress;
    set_generator_state(at::detail::getDefaultCPUGenerator(), cpu_state);
    if (device_.is_cuda() && cuda_state.defined()) {
      set_generator_state(at::globalContext().defaultGenerator(device_), cuda_state);
    }
  };
}

namespace {

/// Reads only the model of a trainer checkpoint.
class ModelReader : public shampoo::DistributedCheckpointable {
 public:
  std::string checkpoint_kind() const override { return "cifar10_trainer"; }
  Group checkpoint_group() const override { return {}; }
  void save_common(torch::serialize::OutputArchive&) const override {
    TORCH_INTERNAL_ASSERT(false, "ModelReader only loads");
  }
  void save_pieces(shampoo::PieceWriter&) const override {
    TORCH_INTERNAL_ASSERT(false, "ModelReader only loads");
  }
  std::function<void()> prepare_load(torch::serialize::InputArchive& common,
                                     shampoo::PieceReader&) override {
    torch::serialize::InputArchive archive;
    common.read("model", archive);
    model = read_named_tensors(archive);
    return [] {};
  }
  NamedTensors model;
};

}  // namespace

NamedTensors read_checkpoint_model(const std::filesystem::path& dir) {
  ModelReader reader;
  shampoo::load_distributed_state(reader, dir);
  return reader.model;
}

}  // namespace shampoo::examples
