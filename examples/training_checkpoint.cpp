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

std::string metrics_key(int rank, int world_size) {
  return "metrics/rank-" + std::to_string(rank) + "-of-" + std::to_string(world_size);
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

}  // namespace

TrainingCheckpoint::TrainingCheckpoint(std::filesystem::path dir, Group group,
                                       RunSignature signature, State state, c10::Device device)
    : dir_(std::move(dir)),
      group_(std::move(group)),
      signature_(std::move(signature)),
      state_(state),
      run_(shampoo::TrainingState{state.model, state.optimizer, state.scaler, nullptr,
                                  /*random_state=*/true, /*gradients=*/false, device},
           group_) {
  TORCH_INTERNAL_ASSERT(state_.model && state_.optimizer && state_.metrics && state_.progress);
  if (group_) {
    rank_ = group_->getRank();
    world_size_ = group_->getSize();
  }
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
    run_.set_saved_buffers(mean_buffers(*state_.model, group_));
  }
  std::exception_ptr error;
  try {
    shampoo::save_distributed_state(*this, dir_, group_);
  } catch (...) {
    error = std::current_exception();
  }
  mean_metrics_.reset();
  run_.set_saved_buffers({});
  if (error) std::rethrow_exception(error);
}

void TrainingCheckpoint::save_common(torch::serialize::OutputArchive& common) const {
  const auto unit = common.compilation_unit();
  run_.save_common(common);
  common.write("signature", c10::IValue(render_signature(signature_)));
  common.write("progress",
               at::tensor({state_.progress->epoch, state_.progress->iteration}, at::kLong));
  torch::serialize::OutputArchive metrics(unit);
  (mean_metrics_ ? *mean_metrics_ : *state_.metrics).save(metrics);
  common.write("metrics", metrics);
}

void TrainingCheckpoint::save_pieces(shampoo::PieceWriter& pieces) const {
  run_.save_pieces(pieces);
  if (world_size_ > 1) {
    torch::serialize::OutputArchive metrics;
    state_.metrics->save(metrics);
    pieces.add(metrics_key(rank_, world_size_), std::move(metrics));
  }
}

void TrainingCheckpoint::check_signature(torch::serialize::InputArchive& common) const {
  c10::IValue text;
  common.read("signature", text);
  const RunSignature saved = parse_signature(text.toStringRef());
  RunSignature names = signature_;
  for (const auto& entry : saved) names.push_back(entry);
  for (const auto& [name, unused] : names) {
    // Checkpoints before 2026-12-02 named full sharding ("sharding" "full"), whose format only a
    // fully sharded run read; the library now names the layout of such a checkpoint itself, and
    // its checkpoints since resume under any --sharding.
    if (name == "sharding") continue;
    const auto there = field(saved, name);
    const auto here = field(signature_, name);
    TORCH_CHECK(there == here, "--checkpoint-dir ", dir_.string(),
                " holds a checkpoint of another run: ", name, " is ", there, " there and ", here,
                " in this run; resume with the same settings, or use another --checkpoint-dir");
  }
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
  // The scaler in the trainer's words (the library's check follows, naming TrainingState).
  torch::serialize::InputArchive scaler;
  const bool saved_scaler = common.try_read("grad_scaler", scaler);
  TORCH_CHECK(saved_scaler || state_.scaler == nullptr, "--checkpoint-dir ", dir_.string(),
              ": written by a run without a GradScaler (--amp off or bf16), and this run has one "
              "(--amp fp16); resume with the --amp of the run that wrote it");
  TORCH_CHECK(!saved_scaler || state_.scaler != nullptr, "--checkpoint-dir ", dir_.string(),
              ": written by a run with a GradScaler (--amp fp16), whose scale this run would "
              "lose; resume with --amp fp16");
  auto install_run = run_.prepare_load(common, pieces);
  return [this, progress, metrics, install_run] {
    install_run();
    *state_.metrics = metrics;
    *state_.progress = progress;
  };
}

NamedTensors read_checkpoint_model(const std::filesystem::path& dir) {
  return shampoo::read_training_checkpoint_model(dir);
}

}  // namespace shampoo::examples
