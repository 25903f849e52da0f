#include "parallel/checkpoints/distributed_checkpoint.h"

#include <c10/util/Exception.h>

#include <iostream>
#include <set>
#include <tuple>

#include "parallel/checkpoints/checkpoint_files.h"
#include "parallel/communication/collectives.h"

namespace shampoo {
namespace fs = std::filesystem;

namespace {

using detail::checkpoint_files::generation_dir;
using detail::checkpoint_files::kManifestName;
using detail::checkpoint_files::load_archive;
using detail::checkpoint_files::manifest_file;
using detail::checkpoint_files::next_generation;
using detail::checkpoint_files::parse_generation;
using detail::checkpoint_files::rank_file;
using detail::checkpoint_files::read_locations;
using detail::checkpoint_files::remove_tree;
using detail::checkpoint_files::render_manifest;
using detail::checkpoint_files::write_atomically;
using detail::checkpoint_files::write_text;

/// Rank and size in `group` (0 and 1 without one).
std::pair<int, int> rank_and_size(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  if (!group) return {0, 1};
  return {group->getRank(), group->getSize()};
}

/// AllGather of a few int64 values over `group` (collectives.h); without a group, this rank's.
std::vector<std::vector<int64_t>> gather_values(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                                                const std::vector<int64_t>& values) {
  if (!group) return {values};
  return detail::gather_int64(*group, values);
}

/// After a gather whose first value is each rank's "ok": this rank's own error first, else an
/// error naming the first rank that failed.
void check_all_ok(const std::exception_ptr& own_error,
                  const std::vector<std::vector<int64_t>>& gathered, const std::string& what,
                  const std::string& consequence) {
  if (own_error) std::rethrow_exception(own_error);
  for (size_t r = 0; r < gathered.size(); ++r) {
    TORCH_CHECK(gathered[r][0] == 1, what, ": rank ", r, " failed (its own error says why); ",
                consequence);
  }
}

c10::intrusive_ptr<c10d::ProcessGroup> choose_group(
    const DistributedCheckpointable& optimizer, c10::intrusive_ptr<c10d::ProcessGroup> explicit_) {
  return explicit_ ? std::move(explicit_) : optimizer.checkpoint_group();
}

}  // namespace

// ---- PieceWriter ----

struct PieceWriter::Shared {
  torch::serialize::OutputArchive archive;
  std::vector<std::string> keys;
  std::set<std::string> seen;
  PieceWriter::Sink sink;
};

PieceWriter::PieceWriter() : shared_(std::make_shared<Shared>()) {}

PieceWriter::PieceWriter(Sink sink) : PieceWriter() { shared_->sink = std::move(sink); }

void PieceWriter::add(const std::string& key, torch::serialize::OutputArchive piece) {
  const auto full = prefix_ + key;
  TORCH_CHECK(!full.empty() && full.find('\n') == std::string::npos, "checkpoint: piece key '",
              full, "' is empty or has a newline");
  TORCH_CHECK(shared_->seen.insert(full).second, "checkpoint: piece '", full, "' was added twice");
  if (shared_->sink) {
    shared_->keys.push_back(full);
    shared_->sink(full, std::move(piece));
    return;
  }
  shared_->archive.write("piece_" + std::to_string(shared_->keys.size()), piece);
  shared_->keys.push_back(full);
}

PieceWriter PieceWriter::nested(const std::string& prefix) const {
  PieceWriter view(*this);
  view.prefix_ += prefix;
  return view;
}

const std::vector<std::string>& PieceWriter::keys() const { return shared_->keys; }
torch::serialize::OutputArchive& PieceWriter::archive() const { return shared_->archive; }

// ---- PieceReader ----

struct PieceReader::Shared {
  std::string checkpoint;
  std::map<std::string, Location> locations;
  std::function<torch::serialize::InputArchive(const std::string&)> open;
  std::map<std::string, torch::serialize::InputArchive> files;
};

PieceReader::PieceReader(std::string checkpoint, std::map<std::string, Location> locations,
                         std::function<torch::serialize::InputArchive(const std::string&)> open)
    : shared_(std::make_shared<Shared>()) {
  shared_->checkpoint = std::move(checkpoint);
  shared_->locations = std::move(locations);
  shared_->open = std::move(open);
}

PieceReader::PieceReader(std::shared_ptr<Shared> shared, std::string prefix)
    : shared_(std::move(shared)), prefix_(std::move(prefix)) {}

bool PieceReader::contains(const std::string& key) const {
  return shared_->locations.count(prefix_ + key) > 0;
}

torch::serialize::InputArchive PieceReader::read(const std::string& key) {
  const auto full = prefix_ + key;
  const auto it = shared_->locations.find(full);
  TORCH_CHECK(it != shared_->locations.end(), "checkpoint ", shared_->checkpoint,
              ": no rank saved piece '", full,
              "' (the checkpoint was written for another model or optimizer)");
  auto file = shared_->files.find(it->second.file);
  if (file == shared_->files.end()) {
    file = shared_->files.emplace(it->second.file, shared_->open(it->second.file)).first;
  }
  torch::serialize::InputArchive piece;
  TORCH_CHECK(file->second.try_read("piece_" + std::to_string(it->second.index), piece),
              "checkpoint ", shared_->checkpoint, ": file ", it->second.file, " lacks piece '",
              full, "'; the checkpoint is damaged");
  return piece;
}

PieceReader PieceReader::nested(const std::string& prefix) const {
  return PieceReader(shared_, prefix_ + prefix);
}

// ---- save and load ----

void save_distributed_checkpoint(const torch::optim::Optimizer& optimizer, const fs::path& dir,
                                 c10::intrusive_ptr<c10d::ProcessGroup> group) {
  save_distributed_state(detail::checkpointable(optimizer, "save_distributed_checkpoint"), dir,
                         std::move(group));
}

void load_distributed_checkpoint(torch::optim::Optimizer& optimizer, const fs::path& dir,
                                 c10::intrusive_ptr<c10d::ProcessGroup> group) {
  load_distributed_state(detail::checkpointable(optimizer, "load_distributed_checkpoint"), dir,
                         std::move(group));
}

namespace {

/// One save, step by step. Every step that can fail on a rank ends with an AllGather that every
/// rank joins, so a failure anywhere throws everywhere (nothing committed) instead of a hang.
class SaveProtocol {
 public:
  SaveProtocol(const DistributedCheckpointable& source, fs::path dir,
               c10::intrusive_ptr<c10d::ProcessGroup> group)
      : source_(source), dir_(std::move(dir)), group_(std::move(group)) {
    std::tie(rank_, world_) = rank_and_size(group_);
    where_ = "save_distributed_checkpoint(" + dir_.string() + ")";
  }

  void run() {
    pick_generation();
    write_files();
    commit();
    if (rank_ == 0) remove_old_generations();
  }

 private:
  /// Runs `body` (on this rank), then learns every rank's outcome and `values`.
  std::vector<std::vector<int64_t>> agree(const std::function<std::vector<int64_t>()>& body,
                                          size_t count) {
    std::exception_ptr error;
    std::vector<int64_t> values(count, 0);
    try {
      values = body();
    } catch (...) {
      error = std::current_exception();
    }
    values.insert(values.begin(), error ? 0 : 1);
    auto gathered = gather_values(group_, values);
    check_all_ok(error, gathered, where_,
                 "nothing was committed; the previous checkpoint, if any, is still the current "
                 "one");
    for (auto& row : gathered) row.erase(row.begin());
    return gathered;
  }

  /// Rank 0 picks the new generation; everyone learns it.
  void pick_generation() {
    const auto gathered = agree(
        [&]() -> std::vector<int64_t> {
          if (rank_ != 0) return {0};
          fs::create_directories(dir_);
          return {next_generation(dir_)};
        },
        1);
    generation_ = gathered[0][0];
    gen_name_ = generation_dir(generation_);
  }

  /// The name (relative to dir_) of slot `slot` of rank r: 0 common, 1 pieces, 2 their keys.
  std::string file_name(int r, size_t slot) const {
    if (slot == 0) return gen_name_ + "/common.pt";
    return gen_name_ + "/" + rank_file(r, world_, slot == 1 ? ".pt" : ".keys");
  }

  /// Every rank writes its files; everyone learns each file's size (-1: none) and checksum.
  void write_files() {
    reports_ = agree(
        [&] {
          std::vector<CheckpointManifest::File> files(3, {"", -1, 0});
          const auto write = [&](size_t slot, const std::function<void(const fs::path&)>& body) {
            const auto name = file_name(rank_, slot);
            files[slot] = write_atomically(dir_ / name, name, body);
          };
          fs::create_directories(dir_ / gen_name_);
          if (rank_ == 0) {
            torch::serialize::OutputArchive common;
            source_.save_common(common);
            write(0, [&](const fs::path& path) { common.save_to(path.string()); });
          }
          PieceWriter pieces;
          source_.save_pieces(pieces);
          if (!pieces.keys().empty()) {
            write(1, [&](const fs::path& path) { pieces.archive().save_to(path.string()); });
            std::string keys;
            for (const auto& key : pieces.keys()) keys += key + "\n";
            write(2, [&](const fs::path& path) { write_text(path, keys); });
          }
          std::vector<int64_t> report;
          for (const auto& file : files) {
            report.push_back(file.bytes);
            report.push_back(static_cast<int64_t>(file.checksum));
          }
          return report;
        },
        6);
  }

  /// Rank 0 writes the MANIFEST naming the new generation; everyone learns that it did.
  void commit() {
    agree(
        [&]() -> std::vector<int64_t> {
          if (rank_ != 0) return {};
          CheckpointManifest manifest{source_.checkpoint_kind(), generation_, world_, {}};
          for (int r = 0; r < world_; ++r) {
            for (size_t slot = 0; slot < 3; ++slot) {
              const int64_t bytes = reports_[r][2 * slot];
              if (bytes < 0) continue;
              manifest.files.push_back(
                  {file_name(r, slot), bytes, static_cast<uint64_t>(reports_[r][2 * slot + 1])});
            }
          }
          const auto text = render_manifest(manifest);
          write_atomically(dir_ / kManifestName, kManifestName,
                           [&](const fs::path& path) { write_text(path, text); });
          return {};
        },
        0);
  }

  /// The generations the MANIFEST no longer names and stale temporary MANIFESTs (best effort).
  void remove_old_generations() const {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(dir_, ec)) {
      const auto name = entry.path().filename().string();
      const bool stale_manifest = name.rfind(std::string(kManifestName) + ".tmp-", 0) == 0;
      if (!stale_manifest && (parse_generation(name) < 0 || name == gen_name_)) continue;
      std::error_code remove_error;
      remove_tree(entry.path(), remove_error);
      if (remove_error) {
        std::cerr << where_ << ": could not remove " << entry.path().string() << ": "
                  << remove_error.message() << "\n";
      }
    }
  }

  const DistributedCheckpointable& source_;
  fs::path dir_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int rank_ = 0;
  int world_ = 1;
  std::string where_;
  int64_t generation_ = 0;
  std::string gen_name_;
  std::vector<std::vector<int64_t>> reports_;
};

}  // namespace

void save_distributed_state(const DistributedCheckpointable& source, const fs::path& dir,
                            c10::intrusive_ptr<c10d::ProcessGroup> group) {
  source.sync_for_checkpoint();
  if (source.checkpoint_replicas() == 1) {
    SaveProtocol(source, dir, choose_group(source, std::move(group))).run();
    return;
  }
  TORCH_CHECK(!source.every_replica_writes(), "save_distributed_checkpoint(", dir.string(),
              "): hybrid sharding with the state split across the replicas "
              "(FullyShardedOptions::split_across_replicas): each replica holds part of the "
              "optimizer state, and this checkpoint is written by one replica; save a whole run "
              "with save_training_checkpoint(dir, state, group) over every rank instead");
  // Hybrid: replica 0 writes; the others wait for its outcome, which every rank then shares.
  std::exception_ptr error;
  if (source.checkpoint_replica() == 0) {
    try {
      SaveProtocol(source, dir, choose_group(source, std::move(group))).run();
    } catch (...) {
      error = std::current_exception();
    }
  }
  const bool all_ok = source.agree_across_replicas(error == nullptr);
  if (error) std::rethrow_exception(error);
  TORCH_CHECK(all_ok, "save_distributed_checkpoint(", dir.string(),
              "): the replica that writes the checkpoint failed (its ranks report why); the "
              "previous checkpoint stays the current one");
}

void load_distributed_state(DistributedCheckpointable& target, const fs::path& dir,
                            c10::intrusive_ptr<c10d::ProcessGroup> group) {
  const char* function = "load_distributed_checkpoint";
  target.sync_for_checkpoint();
  group = choose_group(target, std::move(group));
  const std::string where = std::string(function) + "(" + dir.string() + ")";

  std::exception_ptr error;
  std::function<void()> install;
  try {
    const auto manifest = read_checkpoint_manifest(dir);
    const auto kind = target.checkpoint_kind();
    const std::string scaled = detail::kWithGradScalerSuffix;
    TORCH_CHECK(manifest.kind != kind + scaled, "checkpoint ", dir.string(), ": written by a ",
                kind, " together with a GradScaler (kind ", manifest.kind,
                "), loaded without one: load it with load_distributed_checkpoint(optimizer, "
                "scaler, dir) so that the scale and its growth tracker are restored too");
    TORCH_CHECK(manifest.kind + scaled != kind, "checkpoint ", dir.string(), ": written by a ",
                manifest.kind, " without a GradScaler, loaded with one (kind ", kind,
                "): load it with load_distributed_checkpoint(optimizer, dir); the scaler then "
                "keeps its own state");
    TORCH_CHECK(manifest.kind == kind, "checkpoint ", dir.string(), ": written by a ",
                manifest.kind, ", this optimizer is a ", kind);
    const auto common_name = generation_dir(manifest.generation) + "/common.pt";
    auto common = load_archive(dir, manifest_file(manifest, dir, common_name));
    PieceReader pieces(dir.string(), read_locations(dir, manifest),
                       [dir, manifest](const std::string& name) {
                         return load_archive(dir, manifest_file(manifest, dir, name));
                       });
    install = target.prepare_load(common, pieces);
  } catch (...) {
    error = std::current_exception();
  }
  const auto gathered = gather_values(group, {error ? 0 : 1});
  check_all_ok(error, gathered, where, "no rank loaded anything");
  install();
}

namespace detail {
DistributedCheckpointable* find_checkpointable(const torch::optim::Optimizer& optimizer) {
  return dynamic_cast<DistributedCheckpointable*>(const_cast<torch::optim::Optimizer*>(&optimizer));
}

DistributedCheckpointable& checkpointable(const torch::optim::Optimizer& optimizer,
                                          const char* function) {
  auto* object = find_checkpointable(optimizer);
  TORCH_CHECK(object != nullptr, function,
              ": this optimizer type does not support world-size-independent checkpoints "
              "(DistributedShampoo, ShardedOptimizer and InBackwardOptimizer do); use "
              "torch::save / torch::load for one process");
  return *object;
}

int64_t read_int_entry(torch::serialize::InputArchive& archive, const std::string& key,
                       const std::string& what) {
  c10::IValue value;
  TORCH_CHECK(archive.try_read(key, value) && value.isInt(), what, ": entry '", key,
              "' is missing");
  return value.toInt();
}

void write_param_shapes(torch::serialize::OutputArchive& archive,
                        const std::vector<at::Tensor>& params) {
  archive.write("num_params", c10::IValue(static_cast<int64_t>(params.size())));
  for (size_t i = 0; i < params.size(); ++i) {
    archive.write("shape_" + std::to_string(i),
                  at::tensor(params[i].sizes().vec(), at::TensorOptions().dtype(at::kLong)),
                  /*is_buffer=*/true);
  }
}

void check_param_shapes(torch::serialize::InputArchive& archive,
                        const std::vector<at::Tensor>& params, const std::string& what) {
  c10::IValue count;
  TORCH_CHECK(archive.try_read("num_params", count) && count.isInt(), what, ": no parameter count");
  TORCH_CHECK(count.toInt() == static_cast<int64_t>(params.size()), what, ": written for ",
              count.toInt(), " parameters, here there are ", params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor shape;
    TORCH_CHECK(archive.try_read("shape_" + std::to_string(i), shape, /*is_buffer=*/true), what,
                ": no shape for parameter ", i);
    // Read on the host: an archive loaded with a CUDA map location holds this on the GPU.
    shape = shape.to(at::kCPU, at::kLong).contiguous();
    const std::vector<int64_t> got(shape.data_ptr<int64_t>(),
                                   shape.data_ptr<int64_t>() + shape.numel());
    TORCH_CHECK(got == params[i].sizes().vec(), what, ": parameter ", i, " has shape ",
                at::IntArrayRef(got), " there and ", params[i].sizes(), " here");
  }
}

}  // namespace detail

}  // namespace shampoo
