#include "examples/training_checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>

#include <mutex>
#include <optional>
#include <regex>
#include <set>
#include <system_error>
#include <utility>
#include <vector>

#include "shampoo/checkpoint.h"

namespace shampoo::examples {

namespace {

struct CheckpointName {
  int rank;
  int world_size;
  int64_t epoch;
};

std::optional<CheckpointName> parse_name(const std::string& name) {
  static const std::regex pattern(R"(rank(\d+)-of-(\d+)-epoch(\d+)\.pt)");
  std::smatch match;
  if (!std::regex_match(name, match, pattern)) return std::nullopt;
  return CheckpointName{std::stoi(match[1]), std::stoi(match[2]), std::stoll(match[3])};
}

}  // namespace

CheckpointDir::CheckpointDir(std::filesystem::path dir,
                             c10::intrusive_ptr<c10d::ProcessGroup> group, std::string signature,
                             c10::Device device)
    : dir_(std::move(dir)),
      group_(std::move(group)),
      signature_(std::move(signature)),
      device_(device) {
  if (group_) {
    rank_ = group_->getRank();
    world_size_ = group_->getSize();
  }
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  TORCH_CHECK(!ec, "--checkpoint-dir: cannot create ", dir_.string(), " (", ec.message(), ")");
}

std::filesystem::path CheckpointDir::file(int64_t epoch) const {
  return dir_ / ("rank" + std::to_string(rank_) + "-of-" + std::to_string(world_size_) + "-epoch" +
                 std::to_string(epoch) + ".pt");
}

int64_t CheckpointDir::all_reduce_sum(int64_t value) const {
  if (!group_ || world_size_ == 1) return value;
  std::vector<at::Tensor> buffer{at::tensor({value}, at::kLong)};
  group_->allreduce(buffer)->wait();
  return buffer[0].item<int64_t>();
}

int64_t CheckpointDir::all_reduce_min(int64_t value) const {
  if (!group_ || world_size_ == 1) return value;
  std::vector<at::Tensor> buffer{at::tensor({value}, at::kLong)};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MIN;
  group_->allreduce(buffer, options)->wait();
  return buffer[0].item<int64_t>();
}

int64_t CheckpointDir::find_resume_epoch() const {
  std::set<int64_t> mine;
  std::set<int> other_world_sizes;
  for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
    const auto name = parse_name(entry.path().filename().string());
    if (!name) continue;
    if (name->world_size != world_size_) {
      other_world_sizes.insert(name->world_size);
    } else if (name->rank == rank_) {
      mine.insert(name->epoch);
    }
  }
  const int64_t latest = mine.empty() ? 0 : *mine.rbegin();
  // Every rank learns whether any rank saw foreign checkpoints, so all of them fail together.
  const bool foreign = mine.empty() && !other_world_sizes.empty();
  TORCH_CHECK(all_reduce_sum(foreign ? 1 : 0) == 0, "--checkpoint-dir ", dir_.string(),
              " holds checkpoints of a run with ",
              other_world_sizes.empty() ? std::string("another number of")
                                        : std::to_string(*other_world_sizes.begin()),
              " ranks, this run has ", world_size_,
              " (changing the world size on resume is not supported; use another folder)");
  const int64_t resume = all_reduce_min(latest);
  if (resume == 0) return 0;
  const bool have = mine.count(resume) == 1;
  TORCH_CHECK(all_reduce_min(have ? 1 : 0) == 1, "--checkpoint-dir ", dir_.string(),
              ": some rank has no checkpoint of epoch ", resume,
              ", the latest epoch every rank has (files removed by hand?)");
  return resume;
}

torch::serialize::InputArchive CheckpointDir::read(int64_t epoch) const {
  const std::string path = file(epoch).string();
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(path, device_);
  } catch (const std::exception&) {
    // A missing, truncated or damaged file: read_checkpoint's error names it (LibTorch's
    // reader does not). Anything else (a device the tensors cannot be mapped to) as it is.
    shampoo::read_checkpoint(path);
    throw;
  }
  return archive;
}

void CheckpointDir::load_model(int64_t epoch, torch::nn::Module& model) const {
  auto archive = read(epoch);
  c10::IValue signature;
  archive.read("signature", signature);
  TORCH_CHECK(signature.toStringRef() == signature_, file(epoch).string(),
              ": written by a different run:\n  checkpoint: ", signature.toStringRef(),
              "\n  this run:   ", signature_, "\nuse another --checkpoint-dir");
  torch::serialize::InputArchive model_archive;
  archive.read("model", model_archive);
  model.load(model_archive);
}

TrainingProgress CheckpointDir::load_training_state(int64_t epoch,
                                                    torch::optim::Optimizer& optimizer,
                                                    LossMetrics& metrics) const {
  auto archive = read(epoch);
  torch::serialize::InputArchive optimizer_archive;
  archive.read("optimizer", optimizer_archive);
  try {
    optimizer.load(optimizer_archive);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, file(epoch).string(), ": ", e.msg());
  }
  torch::serialize::InputArchive metrics_archive;
  archive.read("metrics", metrics_archive);
  metrics.load(metrics_archive);
  at::Tensor progress;
  archive.read("progress", progress);
  at::Tensor generator_state;
  archive.read("cpu_generator_state", generator_state);
  {
    // The default generator is shared by the process; its mutex guards set_state.
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(generator_state.cpu());  // mapped to device_ like every tensor
  }
  TrainingProgress result;
  result.epoch = progress[0].item<int64_t>();
  result.iteration = progress[1].item<int64_t>();
  TORCH_CHECK(result.epoch == epoch, file(epoch).string(), ": holds epoch ", result.epoch,
              ", expected ", epoch);
  TORCH_CHECK(metrics.iteration() == result.iteration, file(epoch).string(),
              ": metrics at iteration ", metrics.iteration(), ", expected ", result.iteration);
  return result;
}

void CheckpointDir::save(const TrainingProgress& progress, const torch::nn::Module& model,
                         const torch::optim::Optimizer& optimizer,
                         const LossMetrics& metrics) const {
  torch::serialize::OutputArchive archive;
  archive.write("signature", c10::IValue(signature_));
  torch::serialize::OutputArchive model_archive(archive.compilation_unit());
  model.save(model_archive);
  archive.write("model", model_archive);
  torch::serialize::OutputArchive optimizer_archive(archive.compilation_unit());
  optimizer.save(optimizer_archive);
  archive.write("optimizer", optimizer_archive);
  torch::serialize::OutputArchive metrics_archive(archive.compilation_unit());
  metrics.save(metrics_archive);
  archive.write("metrics", metrics_archive);
  archive.write("progress", at::tensor({progress.epoch, progress.iteration}, at::kLong));
  archive.write("cpu_generator_state", at::detail::getDefaultCPUGenerator().get_state());

  const auto path = file(progress.epoch);
  auto temporary = path;
  temporary += ".tmp";
  archive.save_to(temporary.string());
  std::error_code ec;
  std::filesystem::rename(temporary, path, ec);
  TORCH_CHECK(!ec, "--checkpoint-dir: cannot rename ", temporary.string(), " to ", path.string(),
              " (", ec.message(), ")");

  // Every rank has its file of this epoch: the earlier ones are no longer needed.
  all_reduce_sum(1);
  for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
    const auto name = parse_name(entry.path().filename().string());
    if (name && name->rank == rank_ && name->world_size == world_size_ &&
        name->epoch < progress.epoch) {
      std::filesystem::remove(entry.path(), ec);
    }
  }
}

}  // namespace shampoo::examples
