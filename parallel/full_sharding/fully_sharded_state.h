#pragma once
/// The inside of full sharding (FullyShardedDataParallel::State), shared by the files of its
/// concepts: construction (fully_sharded_setup.cpp), a unit's rows and their gathering
/// (fully_sharded_rows.cpp), forward, backward and gradient reduction
/// (fully_sharded_backward.cpp), the step and its undo (fully_sharded_step.cpp), the param groups
/// of optimizer() (fully_sharded_groups.cpp) and checkpoints (fully_sharded_checkpoint.cpp).
/// Internal: not installed.

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "parallel/data_parallel/backward_pass.h"
#include "parallel/full_sharding/fully_sharded.h"
#include "parallel/full_sharding/step_worker.h"
#include "parallel/optimizers/local_optimizer.h"
#include "parallel/optimizers/undo_record.h"

namespace shampoo::detail {

inline constexpr const char* kFsdpWho = "FullyShardedDataParallel: ";
/// Checkpoint format 2: one optimizer per rank, its state saved per parameter.
inline constexpr int64_t kFsdpCheckpointFormat = 2;

/// A parameter's full storage is released while its unit is sharded: no bytes and shape [0], so
/// that autograd's saved tensors (which hold the parameter itself) see the values again once the
/// unit is gathered. Neither call bumps the version counter.
/// `dtype`: the parameter's own (the shards'), which it shows while released.
void release_full(const at::Tensor& param, at::ScalarType dtype);
/// Full storage of `sizes` in `dtype` (a mixed-precision policy's compute dtype while gathered).
void allocate_full(const at::Tensor& param, at::IntArrayRef sizes, at::ScalarType dtype);
/// Waits for full sharding's collectives; `what` names them in the error.
void wait_all_of(std::vector<c10::intrusive_ptr<c10d::Work>>& works, const std::string& what,
                 int rank);
void wait_one(c10::intrusive_ptr<c10d::Work> work, const std::string& what, int rank);
std::string shape_text(at::IntArrayRef sizes);

/// One parameter of a unit: its full shape, its row chunks and what this rank keeps of it.
struct ParamSlot {
  at::Tensor param;  // the module's tensor: full while the unit is gathered, else shape [0]
  std::vector<int64_t> sizes;
  int64_t rows = 1;        // dim 0 (1 for a 0-dim parameter)
  int64_t row_numel = 1;   // elements per row
  int64_t chunk_rows = 1;  // rows per rank, ceil(rows / world)
  int64_t offset = 0;      // of this parameter's chunk in the unit's shard buffer
  int owner = -1;          // lossless: the rank that steps it
  int replica_owner = -1;  // split across replicas: the replica that steps it (-1: every one)
  at::Tensor shard;        // this rank's valid rows, [valid, ...]
  at::Tensor reduced;      // averaged gradient kept for the step (full, or this rank's rows)
  bool arrived = false;    // gradient accumulated in this backward pass
  int64_t hook = -1;

  int64_t numel() const { return rows * row_numel; }
  int64_t chunk_numel() const { return chunk_rows * row_numel; }
  int64_t valid_rows(int rank) const {
    return std::clamp<int64_t>(rows - rank * chunk_rows, 0, chunk_rows);
  }
  /// The first row of `rank`'s chunk, or `rows` for a rank past the last row (a parameter with
  /// fewer rows than ranks: its chunk is empty, and narrow() wants a start within the rows).
  int64_t first_row(int rank) const { return std::min(rows, rank * chunk_rows); }
  std::vector<int64_t> shard_sizes(int rank) const {
    auto out = sizes.empty() ? std::vector<int64_t>{1} : sizes;
    out[0] = valid_rows(rank);
    return out;
  }
};

struct FsdpUnit {
  std::string name;
  std::vector<ParamSlot> params;
  int64_t shard_numel = 0;                    // padded chunks of every parameter
  at::TensorOptions options;                  // of the parameters and their shards
  at::ScalarType dtype = at::kFloat;          // the parameters' own
  at::ScalarType compute_dtype = at::kFloat;  // of the gathered parameters (param_dtype)
  at::ScalarType reduce_dtype = at::kFloat;   // of the gradient reduction
  std::atomic<bool> gathered{true};
  int64_t arrived = 0;
  bool in_pass = false;     // ran forward with gradients in the current pass
  bool to_step = false;     // reduced gradients waiting for step()
  bool owned_kept = false;  // the owner's parameters kept from the backward gather for the step
  std::unique_ptr<LocalOptimizer> optimizer;  // local shards: over this rank's rows
  std::shared_future<void> pending;           // its step on the worker
};

}  // namespace shampoo::detail

namespace shampoo {

struct FullyShardedDataParallel::State : std::enable_shared_from_this<State> {
  using ParamSlot = detail::ParamSlot;
  using Unit = detail::FsdpUnit;
  using UndoRecord = detail::UndoRecord;
  using StepWorker = detail::StepWorker;
  static constexpr const char* kWho = detail::kFsdpWho;

  c10::intrusive_ptr<c10d::ProcessGroup> group;         // gathers; step() without overlap
  c10::intrusive_ptr<c10d::ProcessGroup> reduce_group;  // gradient reductions in backward
  c10::intrusive_ptr<c10d::ProcessGroup> step_group;    // the worker's all-to-alls of rows
  FullyShardedOptions options;
  GroupOptimizerFactory factory;
  // Lossless: the one optimizer of this rank, over the parameters it owns in optimizer()'s groups.
  std::unique_ptr<detail::LocalOptimizer> rank_optimizer;
  int rank = 0;
  int world = 1;     // ranks of the shard group (group)
  int replicas = 1;  // hybrid: ranks of options.replica_group()
  int replica = 0;   // hybrid: this rank's replica (its rank in the replica group)
  // The global rank of each rank of the shard group, when it was split from the world group
  // (make_hybrid_groups); empty otherwise. For messages.
  std::vector<int> global_ranks;
  // Split across replicas with overlap: the worker's broadcasts and agreements across replicas.
  c10::intrusive_ptr<c10d::ProcessGroup> replica_step_group;
  std::vector<std::unique_ptr<Unit>> units;
  std::map<std::string, size_t> unit_by_name;
  std::unordered_map<const c10::TensorImpl*, std::pair<size_t, size_t>> slot_of;
  std::vector<size_t> forward_order;  // units run with gradients in this pass, in order
  size_t next_to_gather = 0;          // in reverse forward order, for backward
  size_t next_to_reduce = 0;
  // The passes and the accumulation (options.accumulation_steps()): stepped() when a step ends
  // one, with overlap at the end of its last pass, without in step().
  detail::BackwardPass pass;
  int64_t steps = 0;
  bool holding = false;  // between gather_all() and release_all()
  std::recursive_mutex mutex;
  std::unique_ptr<StepWorker> worker;
  // optimizer(): the user's param groups over unit parameters. Per group: the parameters
  // registered, and the serialized options last copied into their optimizers; per parameter in
  // a group: its group and the step count when it joined.
  std::unique_ptr<FullyShardedOptimizer> facade;
  bool user_groups = false;  // built with param groups (else one group of every parameter)
  std::vector<size_t> group_sizes;
  std::vector<std::string> pushed;
  std::unordered_map<const c10::TensorImpl*, size_t> group_of;
  std::unordered_map<const c10::TensorImpl*, int64_t> joined_at;
  // The open pass (overlap): what undoes the units stepped so far, and the first unit's failure
  // (set on the worker, the same unit on every rank; read after the worker is waited on).
  std::vector<UndoRecord> pass_undo;
  std::string pass_failure;

  /// Units stepped during backward keep what undoes their step until the pass ends.
  bool journal() const { return options.overlap_step() && options.undo_failed_steps(); }
  bool lossless() const { return options.step_mode() == ShardedStepMode::kLossless; }
  bool split() const { return options.split_across_replicas() && replicas > 1; }
  /// Whether this rank steps the parameter: its owner in its shard group and, split across
  /// replicas, in its replica.
  bool steps_here(const ParamSlot& slot) const {
    return slot.owner == rank && (slot.replica_owner < 0 || slot.replica_owner == replica);
  }
  Unit& unit(size_t index) { return *units[index]; }
  static const c10::TensorImpl* impl_of(const at::Tensor& t) { return t.unsafeGetTensorImpl(); }
  /// Whether the parameter is in one of optimizer()'s groups (else it is frozen: not stepped).
  bool in_a_group(const ParamSlot& slot) const { return group_of.count(impl_of(slot.param)) != 0; }

  // construction (fully_sharded_setup.cpp)
  void add_units(std::vector<ShardedUnit> given);
  void check_param(const ShardedUnit& in, size_t u, size_t i);
  int64_t agree_on_units();
  void agree_across_replicas();
  static int64_t fingerprint(const Unit& unit);
  static std::string describe(const Unit& unit);
  void make_groups(int64_t tag);
  void make_replica_step_group();
  void broadcast_values();
  void assign_owners();
  void make_shards_and_optimizers();
  detail::LocalOptimizer::GroupOptions group_options();
  void add_hooks();
  std::pair<size_t, size_t> position_of(const at::Tensor& param) const;
  ParamSlot& slot_for(const at::Tensor& param);

  // a unit's rows, gathered and released (fully_sharded_rows.cpp)
  void gather(Unit& unit, c10d::ProcessGroup& via);
  void reshard(Unit& unit);
  static void write_chunks(const at::Tensor& by_rank, const ParamSlot& slot, const at::Tensor& full,
                           int64_t column);
  static void write_chunks(const at::Tensor& by_rank, const ParamSlot& slot,
                           const at::Tensor& full);
  static void read_chunks(const at::Tensor& by_rank, const ParamSlot& slot, int64_t column,
                          const at::Tensor& full);
  static void write_shard(const at::Tensor& chunk, const ParamSlot& slot);
  std::vector<int64_t> chunks_by_owner(const Unit& unit) const;
  static std::vector<int64_t> starts_of(const std::vector<int64_t>& split);
  void collect_rows(Unit& unit, c10d::ProcessGroup& via);
  void scatter_rows(Unit& unit, c10d::ProcessGroup& via);
  void broadcast_stepped(Unit& unit, const c10::intrusive_ptr<c10d::ProcessGroup>& replicas_via);
  void materialize(Unit& unit, ParamSlot& slot, const std::string& what);

  // forward, backward and the gradient reduction (fully_sharded_backward.cpp)
  at::Tensor forward(size_t u, const std::function<at::Tensor()>& fn);
  void open_pass();
  void before_unit_backward(size_t u);
  void on_grad_ready(size_t u, size_t i);
  void close_pass();
  void reduce(Unit& unit);
  void reduce_to_owners(Unit& unit, std::vector<at::Tensor> grads);
  void reduce_to_rows(Unit& unit, std::vector<at::Tensor> grads);
  void reduce_across_replicas(const Unit& unit, const std::vector<at::Tensor>& sums);
  static void accumulate(ParamSlot& slot, at::Tensor averaged);

  // the step and its undo (fully_sharded_step.cpp)
  void step_unit(Unit& unit, c10d::ProcessGroup& via);
  std::string step_reduced(Unit& unit, UndoRecord& undo);
  void drop_unit_step(Unit& unit);
  bool undo_pass();
  void commit_pass();
  std::string non_finite_gradient(const Unit& unit) const;
  std::string failure_message(const Unit& unit, const std::vector<int>& failed,
                              const std::string& here) const;
  /// "rank(s) 0, 1", or under hybrid sharding "global rank(s) 2, 3 (rank(s) 0, 1 of shard
  /// group 1)": ranks of the shard group as a message names them.
  std::string ranks_text(const std::vector<int>& ranks) const;
  static std::string failure_outcome(bool undone);
  void check_step_after_backward(const char* function) const;
  void step_all(const char* function);
  void step_all_owned();
  std::vector<int64_t> or_across_replicas(std::vector<int64_t> flags,
                                          const c10::intrusive_ptr<c10d::ProcessGroup>& via);
  void check_finite_before_steps();
  void skip_all();
  std::vector<at::Tensor> reduced_gradients(const char* function);
  void finish_step();
  static void wait_for(Unit& unit);
  void wait_all();

  // optimizer()'s param groups (fully_sharded_groups.cpp)
  static std::string options_bytes(const torch::optim::OptimizerOptions& options);
  void push_group_options();
  std::vector<at::Tensor> register_group_params(size_t g, size_t first);
  void add_later_params(const std::vector<at::Tensor>& added, size_t g);
  void sync_groups();
  void write_state_entries();
  void make_facade(FullyShardedDataParallel& owner,
                   std::optional<std::vector<torch::optim::OptimizerParamGroup>> given);

  // checkpoints (fully_sharded_checkpoint.cpp)
  static std::string param_key(size_t u, size_t i);
  static std::vector<at::Tensor> shapes_of(const Unit& unit);
  void check_checkpointable() const;
  void save_common(torch::serialize::OutputArchive& common);
  void save_groups(torch::serialize::OutputArchive& common);
  std::function<void()> prepare_groups(torch::serialize::InputArchive& common);
  void save_pieces(PieceWriter& pieces);
  ParamNames param_name() const;
  static int64_t read_int(torch::serialize::InputArchive& archive, const std::string& key);
  static void check_format(torch::serialize::InputArchive& common);
  void check_units(torch::serialize::InputArchive& common);
  at::Tensor read_rows(size_t u, size_t i, int64_t saved_world, PieceReader& pieces);
  std::function<void()> prepare_load(torch::serialize::InputArchive& common, PieceReader& pieces);
  /// A load's counters and the reduced gradients of an accumulation in progress (both formats).
  void install_progress(int64_t saved_passes, int64_t saved_steps, int64_t saved_since,
                        const std::vector<std::pair<ParamSlot*, at::Tensor>>& accumulated);

  // whole-run checkpoints by parameter name (fully_sharded_portable.cpp)
  int64_t portable_param_step(const at::Tensor& param) const;
  void save_portable_pieces(PieceWriter& pieces, const PortableSave& save);
  void save_portable_layout(torch::serialize::OutputArchive& layout) const;
  std::function<void()> prepare_portable_load(const PortableLoad& load);
  /// This rank's rows of every parameter from the checkpoint's model, checked against the units.
  std::vector<std::pair<at::Tensor, at::Tensor>> portable_rows(const PortableLoad& load);
  /// The reduced gradients of an accumulation in progress that this rank steps on.
  std::vector<std::pair<ParamSlot*, at::Tensor>> portable_accumulated(const PortableLoad& load,
                                                                      int64_t passes_since);
};

}  // namespace shampoo
