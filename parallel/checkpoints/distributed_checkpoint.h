#pragma once
/// World-size-independent checkpoints: a directory that every rank of a job writes together and
/// that a job of any other size can load.
///
///   shampoo::save_distributed_checkpoint(optimizer, "ckpt");   // every rank, collectively
///   ...                                                          // restart at another size
///   shampoo::load_distributed_checkpoint(optimizer, "ckpt");
///
/// State is stored as pieces keyed by what does not change with the world (a parameter's block,
/// a parameter), each written by the rank that owns it, beside one copy of what every rank holds
/// (options, step counts, the model's shapes). Layout of `dir`:
///
///   MANIFEST                        the commit point: format, kind, generation, world size at
///                                   the save, and the size and FNV-1a checksum of every file
///   gen-<G>/common.pt               written by rank 0
///   gen-<G>/rank-<R>-of-<W>.pt      the pieces rank R wrote (ranks with none write no file)
///   gen-<G>/rank-<R>-of-<W>.keys    their keys, one per line, in piece order
///
/// Saves are atomic: each file is written under a temporary name, flushed to disk and renamed;
/// the MANIFEST is replaced last, by rank 0, once every rank reported its files written. A save
/// that fails or is killed part-way leaves the previous generation, which the MANIFEST still
/// names, complete and loadable; generations the MANIFEST does not name are removed after the
/// next successful save. Loading checks every file it reads against the MANIFEST and refuses a
/// missing, truncated or damaged one by name. `dir` must be on a filesystem every rank sees.

#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

namespace shampoo {

/// Collects the pieces this rank saves. nested("x/") is a view that prefixes every key.
class PieceWriter {
 public:
  PieceWriter();
  /// A writer that hands every piece to `sink` (its full key and the piece) instead of keeping
  /// it in archive(): the Python package's state_dict keeps each piece as a tensor of its own.
  using Sink = std::function<void(const std::string& key, torch::serialize::OutputArchive piece)>;
  explicit PieceWriter(Sink sink);
  /// Adds piece `key` (unique in the checkpoint, no newline).
  void add(const std::string& key, torch::serialize::OutputArchive piece);
  PieceWriter nested(const std::string& prefix) const;

  /// The keys added (prefixes included) and the archive holding piece i as "piece_<i>".
  const std::vector<std::string>& keys() const;
  torch::serialize::OutputArchive& archive() const;

 private:
  struct Shared;
  std::shared_ptr<Shared> shared_;
  std::string prefix_;
};

/// Gives the pieces of a checkpoint, whichever rank wrote them. nested("x/") prefixes keys.
class PieceReader {
 public:
  /// Where each key is: file (relative to the checkpoint directory) and piece index.
  struct Location {
    std::string file;
    int64_t index = 0;
  };
  /// `open` loads a file of the checkpoint (checked against the manifest).
  PieceReader(std::string checkpoint, std::map<std::string, Location> locations,
              std::function<torch::serialize::InputArchive(const std::string& file)> open);

  bool contains(const std::string& key) const;
  /// The piece `key`; an error naming the key and the checkpoint when no rank saved it.
  torch::serialize::InputArchive read(const std::string& key);
  PieceReader nested(const std::string& prefix) const;

 private:
  struct Shared;
  PieceReader(std::shared_ptr<Shared> shared, std::string prefix);
  std::shared_ptr<Shared> shared_;
  std::string prefix_;
};

/// An optimizer that saves and loads world-size-independent checkpoints (DistributedShampoo,
/// ShardedOptimizer, InBackwardOptimizer).
class DistributedCheckpointable {
 public:
  virtual ~DistributedCheckpointable() = default;
  /// Recorded in the manifest; loading into another kind is refused.
  virtual std::string checkpoint_kind() const = 0;
  /// The ranks that save and load together (null: one process).
  virtual c10::intrusive_ptr<c10d::ProcessGroup> checkpoint_group() const = 0;
  /// Called on every rank before a save or a load starts, where collectives may run: brings the
  /// optimizer's bookkeeping up to date (param groups added through LibTorch's base class are
  /// registered here, so that the checkpoint holds them). Changes no state a step uses.
  virtual void sync_for_checkpoint() const {}
  /// Hybrid sharding: how many groups of ranks hold this state alike (replicas), and which of
  /// them this rank's group is. Replica 0 writes the checkpoint (over checkpoint_group()); the
  /// ranks of the others only wait until it has committed (agree_across_replicas), and every
  /// replica loads it.
  virtual int checkpoint_replicas() const { return 1; }
  virtual int checkpoint_replica() const { return 0; }
  /// After a save, on every rank: whether every replica's part went well (`ok`: this rank's).
  /// Collective over the replicas; true without replicas.
  virtual bool agree_across_replicas(bool ok) const { return ok; }
  /// Whether each replica holds state of its own (hybrid sharding with the state split across
  /// the replicas): then every replica saves its pieces (a whole-run checkpoint over every rank),
  /// and a checkpoint that one replica writes alone is refused.
  virtual bool every_replica_writes() const { return false; }
  /// What every rank holds alike. Called on rank 0 only; no collectives.
  virtual void save_common(torch::serialize::OutputArchive& common) const = 0;
  /// This rank's pieces (none on a rank that only replicates another's). No collectives.
  virtual void save_pieces(PieceWriter& pieces) const = 0;
  /// Reads and checks everything this rank needs without changing anything; returns what
  /// installs it, which must not throw. No collectives.
  virtual std::function<void()> prepare_load(torch::serialize::InputArchive& common,
                                             PieceReader& pieces) = 0;
};

/// A DistributedCheckpointable that is another one's face: every call goes to
/// checkpoint_delegate() (e.g. FullyShardedDataParallel::optimizer(), which checkpoints the whole
/// wrapper).
class DelegatingCheckpointable : public DistributedCheckpointable {
 public:
  std::string checkpoint_kind() const override { return delegate().checkpoint_kind(); }
  c10::intrusive_ptr<c10d::ProcessGroup> checkpoint_group() const override {
    return delegate().checkpoint_group();
  }
  void sync_for_checkpoint() const override { delegate().sync_for_checkpoint(); }
  int checkpoint_replicas() const override { return delegate().checkpoint_replicas(); }
  int checkpoint_replica() const override { return delegate().checkpoint_replica(); }
  bool agree_across_replicas(bool ok) const override {
    return delegate().agree_across_replicas(ok);
  }
  bool every_replica_writes() const override { return delegate().every_replica_writes(); }
  void save_common(torch::serialize::OutputArchive& common) const override {
    delegate().save_common(common);
  }
  void save_pieces(PieceWriter& pieces) const override { delegate().save_pieces(pieces); }
  std::function<void()> prepare_load(torch::serialize::InputArchive& common,
                                     PieceReader& pieces) override {
    return checkpoint_delegate().prepare_load(common, pieces);
  }

 protected:
  /// The object that saves and loads.
  virtual DistributedCheckpointable& checkpoint_delegate() const = 0;

 private:
  const DistributedCheckpointable& delegate() const { return checkpoint_delegate(); }
};

/// Saves `optimizer` (a DistributedCheckpointable) into the checkpoint directory `dir`. Every rank
/// of its process group calls this; it returns once the new generation is committed, and throws
/// on every rank when any rank failed (the previous checkpoint then stays the current one).
/// `group` overrides the optimizer's process group, for an optimizer that has none but is
/// replicated on several ranks (e.g. an InBackwardOptimizer of LibTorch optimizers under data
/// parallelism): rank 0 of `group` writes it.
void save_distributed_checkpoint(const torch::optim::Optimizer& optimizer,
                                 const std::filesystem::path& dir,
                                 c10::intrusive_ptr<c10d::ProcessGroup> group = {});

/// Loads the checkpoint in `dir` into `optimizer`, whatever the world size that saved it. Every
/// rank calls this; the state changes on no rank unless every rank read and checked its part.
void load_distributed_checkpoint(torch::optim::Optimizer& optimizer,
                                 const std::filesystem::path& dir,
                                 c10::intrusive_ptr<c10d::ProcessGroup> group = {});

/// The same for any DistributedCheckpointable, e.g. a training run's state that wraps an
/// optimizer and adds the model and the position in the data to the common part.
void save_distributed_state(const DistributedCheckpointable& state,
                            const std::filesystem::path& dir,
                            c10::intrusive_ptr<c10d::ProcessGroup> group = {});
void load_distributed_state(DistributedCheckpointable& state, const std::filesystem::path& dir,
                            c10::intrusive_ptr<c10d::ProcessGroup> group = {});

/// Whether `dir` holds a committed checkpoint (a MANIFEST). Does not check the files.
bool distributed_checkpoint_exists(const std::filesystem::path& dir);

/// What the MANIFEST of `dir` says (for tools and tests).
struct CheckpointManifest {
  struct File {
    std::string name;  ///< relative to the checkpoint directory
    int64_t bytes = 0;
    uint64_t checksum = 0;
  };
  std::string kind;
  int64_t generation = 0;
  int64_t world_size = 0;
  std::vector<File> files;
};
/// Reads and checks the MANIFEST of `dir`; a clear error when it is missing or damaged.
CheckpointManifest read_checkpoint_manifest(const std::filesystem::path& dir);

namespace detail {
/// The checkpoint kind of an optimizer saved together with a GradScaler (amp/grad_scaler.h):
/// "<optimizer kind>+GradScaler". Loading names the mismatch when one side has the scaler.
inline constexpr const char* kWithGradScalerSuffix = "+GradScaler";

/// `optimizer` as a DistributedCheckpointable, or null when it is not one (the one cast to it).
DistributedCheckpointable* find_checkpointable(const torch::optim::Optimizer& optimizer);

/// `optimizer` as a DistributedCheckpointable; an error naming `function` when it is not one.
DistributedCheckpointable& checkpointable(const torch::optim::Optimizer& optimizer,
                                          const char* function);

/// The int entry `key` of `archive`; an error "<what>: entry '<key>' is missing" otherwise.
int64_t read_int_entry(torch::serialize::InputArchive& archive, const std::string& key,
                       const std::string& what);

/// Writes the parameters' count and shapes ("num_params", "shape_<i>") into `archive`.
void write_param_shapes(torch::serialize::OutputArchive& archive,
                        const std::vector<at::Tensor>& params);
/// Checks them against `params`; errors start with `what` ("ShardedOptimizer checkpoint").
void check_param_shapes(torch::serialize::InputArchive& archive,
                        const std::vector<at::Tensor>& params, const std::string& what);

/// Test seam: called with each file's final path before it is written (also the MANIFEST);
/// what it throws fails the save there, as a crash at that point would. Empty = off.
void set_checkpoint_write_hook_for_testing(std::function<void(const std::filesystem::path&)> fn);
}  // namespace detail

}  // namespace shampoo
