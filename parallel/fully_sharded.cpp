#include "parallel/fully_sharded.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <future>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <utility>

#include "parallel/backward_pass.h"
#include "parallel/collectives.h"
#include "parallel/grad_norm_clipping.h"
#include "parallel/grad_ready_hooks.h"
#include "parallel/libtorch_optimizers.h"
#include "parallel/ownership_plan.h"
#include "parallel/phased_backward_step.h"
#include "parallel/process_group.h"
#include "parallel/rank_optimizer.h"
#include "parallel/step_undo.h"

namespace shampoo {
namespace {

constexpr const char* kWho = "FullyShardedDataParallel: ";
constexpr int64_t kCheckpointFormat = 2;

/// A parameter's full storage is released while its unit is sharded: no bytes and shape [0], so
/// that autograd's saved tensors (which hold the parameter itself) see the values again once the
/// unit is gathered. Neither call bumps the version counter.
/// `dtype`: the parameter's own (the shards'), which it shows while released.
void release_full(const at::Tensor& param, at::ScalarType dtype) {
  auto* impl = param.unsafeGetTensorImpl();
  auto* storage = impl->storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, param.device()));
  storage->set_nbytes(0);
  impl->set_storage_and_dtype(impl->storage(), c10::scalarTypeToTypeMeta(dtype));
  impl->set_sizes_contiguous({0});
}

/// Full storage of `sizes` in `dtype` (a mixed-precision policy's compute dtype while gathered).
void allocate_full(const at::Tensor& param, at::IntArrayRef sizes, at::ScalarType dtype) {
  auto* impl = param.unsafeGetTensorImpl();
  impl->set_storage_and_dtype(impl->storage(), c10::scalarTypeToTypeMeta(dtype));
  auto* storage = impl->storage().unsafeGetStorageImpl();
  const auto nbytes = static_cast<size_t>(c10::multiply_integers(sizes)) * c10::elementSize(dtype);
  c10::DeviceGuard guard(param.device());
  at::Allocator* allocator = storage->allocator() != nullptr
                                 ? storage->allocator()
                                 : c10::GetAllocator(param.device().type());
  storage->set_data_ptr_noswap(allocator->allocate(nbytes));
  storage->set_nbytes(nbytes);
  impl->set_sizes_contiguous(sizes);
}

void wait_all_of(std::vector<c10::intrusive_ptr<c10d::Work>>& works, const std::string& what,
                 int rank) {
  detail::wait_collectives(works, kWho, what, rank);
}

void wait_one(c10::intrusive_ptr<c10d::Work> work, const std::string& what, int rank) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works{std::move(work)};
  wait_all_of(works, what, rank);
}

std::string shape_text(at::IntArrayRef sizes) {
  std::ostringstream out;
  out << sizes;
  return out.str();
}

/// Runs steps one after another on a thread of their own.
class StepWorker {
 public:
  StepWorker() : thread_([this] { run(); }) {}
  ~StepWorker() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    ready_.notify_one();
    thread_.join();
  }
  StepWorker(const StepWorker&) = delete;
  StepWorker& operator=(const StepWorker&) = delete;

  std::shared_future<void> submit(std::function<void()> task) {
    std::packaged_task<void()> packaged(std::move(task));
    auto future = packaged.get_future().share();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      tasks_.push_back(std::move(packaged));
    }
    ready_.notify_one();
    return future;
  }

 private:
  void run() {
    for (;;) {
      std::packaged_task<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();  // an exception lands in the task's future
    }
  }

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::packaged_task<void()>> tasks_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members it uses
};

/// One parameter of a unit: its full shape, its row chunks and what this rank keeps of it.
struct ParamSlot {
  at::Tensor param;  // the module's tensor: full while the unit is gathered, else shape [0]
  std::vector<int64_t> sizes;
  int64_t rows = 1;        // dim 0 (1 for a 0-dim parameter)
  int64_t row_numel = 1;   // elements per row
  int64_t chunk_rows = 1;  // rows per rank, ceil(rows / world)
  int64_t offset = 0;      // of this parameter's chunk in the unit's shard buffer
  int owner = -1;          // lossless: the rank that steps it
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

struct Unit {
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
  std::unique_ptr<torch::optim::Optimizer> optimizer;  // local shards: over this rank's rows
  std::shared_future<void> pending;                    // its step on the worker
};

}  // namespace

using detail::all_finite;
using detail::UnitUndo;

struct FullyShardedDataParallel::State : std::enable_shared_from_this<State> {
  c10::intrusive_ptr<c10d::ProcessGroup> group;         // gathers; step() without overlap
  c10::intrusive_ptr<c10d::ProcessGroup> reduce_group;  // gradient reductions in backward
  c10::intrusive_ptr<c10d::ProcessGroup> step_group;    // the worker's all-to-alls of rows
  FullyShardedOptions options;
  OptimizerFactory factory;
  // Lossless: the one optimizer of this rank, over the parameters it owns in optimizer()'s groups.
  std::unique_ptr<detail::RankOptimizer> rank_optimizer;
  int rank = 0;
  int world = 1;     // ranks of the shard group (group)
  int replicas = 1;  // hybrid: ranks of options.replica_group()
  std::vector<std::unique_ptr<Unit>> units;
  std::map<std::string, size_t> unit_by_name;
  std::unordered_map<const c10::TensorImpl*, std::pair<size_t, size_t>> slot_of;
  std::vector<size_t> forward_order;  // units run with gradients in this pass, in order
  size_t next_to_gather = 0;          // in reverse forward order, for backward
  size_t next_to_reduce = 0;
  detail::BackwardPass pass;
  bool stepping = false;  // the current pass is the last of an accumulation
  int64_t passes = 0;
  int64_t steps = 0;
  int64_t passes_since_step = 0;
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
  std::vector<UnitUndo> pass_undo;
  std::string pass_failure;

  /// Units stepped during backward keep what undoes their step until the pass ends.
  bool journal() const { return options.overlap_step() && options.undo_failed_steps(); }

  bool lossless() const { return options.step_mode() == ShardedStepMode::kLossless; }
  Unit& unit(size_t index) { return *units[index]; }
  static const c10::TensorImpl* impl_of(const at::Tensor& t) { return t.unsafeGetTensorImpl(); }

  // ----- construction -----

  void add_units(std::vector<ShardedUnit> given) {
    for (size_t u = 0; u < given.size(); ++u) {
      auto& in = given[u];
      TORCH_CHECK(!in.params.empty(), kWho, "unit ", u, " ('", in.name, "') has no parameters");
      TORCH_CHECK(unit_by_name.emplace(in.name, u).second, kWho, "two units are named '", in.name,
                  "'; unit names must be unique");
      auto made = std::make_unique<Unit>();
      made->name = in.name;
      made->options = in.params[0].options();
      made->dtype = in.params[0].scalar_type();
      made->compute_dtype = options.param_dtype().value_or(made->dtype);
      made->reduce_dtype = options.reduce_dtype().value_or(made->compute_dtype);
      for (size_t i = 0; i < in.params.size(); ++i) {
        check_param(in, u, i);
        ParamSlot slot;
        slot.param = in.params[i];
        slot.sizes = in.params[i].sizes().vec();
        slot.rows = slot.sizes.empty() ? 1 : slot.sizes[0];
        slot.row_numel = slot.rows == 0 ? 0 : in.params[i].numel() / slot.rows;
        slot.chunk_rows = (slot.rows + world - 1) / world;
        slot.offset = made->shard_numel;
        made->shard_numel += slot.chunk_numel();
        made->params.push_back(std::move(slot));
      }
      units.push_back(std::move(made));
    }
  }

  void check_param(const ShardedUnit& in, size_t u, size_t i) {
    const auto& p = in.params[i];
    const auto where = [&] {
      return std::string("parameter ") + std::to_string(i) + " of unit " + std::to_string(u) +
             " ('" + in.name + "')";
    };
    TORCH_CHECK(p.defined() && p.is_leaf() && p.requires_grad(), kWho, where(),
                " must be a leaf tensor that requires grad");
    TORCH_CHECK(p.numel() > 0, kWho, where(), " is empty (shape ", shape_text(p.sizes()), ")");
    TORCH_CHECK(p.device() == in.params[0].device() && p.dtype() == in.params[0].dtype(), kWho,
                where(), " is on ", p.device(), " with dtype ", p.dtype(),
                ", but parameter 0 is on ", in.params[0].device(), " with dtype ",
                in.params[0].dtype(), ": the parameters of a unit share one device and dtype");
    TORCH_CHECK(p.is_contiguous() && p.storage_offset() == 0 && p.storage().nbytes() == p.nbytes(),
                kWho, where(),
                " must own its storage (contiguous, not a view of a larger tensor): its storage is "
                "released while the unit is sharded");
    const auto [it, fresh] = slot_of.emplace(p.unsafeGetTensorImpl(), std::make_pair(u, i));
    TORCH_CHECK(fresh, kWho, where(), " is also parameter ", it->second.second, " of unit ",
                it->second.first, "; a parameter belongs to one unit, once");
  }

  /// The ranks agree on the units (count, then each unit's shapes, dtype and device) before any
  /// other collective, and draw the tag of this object's subgroups.
  int64_t agree_on_units() {
    const int64_t ticket =
        rank == 0 && world > 1 ? group->getStore()->add("shampoo_fsdp_ticket", 1) : 0;
    const auto counts = detail::gather_int64(*group, {ticket, static_cast<int64_t>(units.size())});
    for (int r = 0; r < world; ++r) {
      TORCH_CHECK(counts[r][1] == counts[0][1], kWho, "the units differ across ranks: rank 0 has ",
                  counts[0][1], " units, rank ", r, " has ", counts[r][1]);
    }
    std::vector<int64_t> prints;
    for (const auto& unit : units) prints.push_back(fingerprint(*unit));
    const auto all = detail::gather_int64(*group, prints);
    for (int r = 0; r < world; ++r) {
      for (size_t u = 0; u < units.size(); ++u) {
        TORCH_CHECK(all[r][u] == all[0][u], kWho, "the units differ across ranks: unit ", u, " ('",
                    units[u]->name, "') has other parameter shapes, dtype or device on rank ", r,
                    " than on rank 0; here it holds ", describe(*units[u]));
      }
    }
    return counts[0][0];
  }

  /// Hybrid: the replicas agree on the units as the shard group's ranks do (one small AllGather
  /// over the replica group).
  void agree_across_replicas() {
    if (replicas == 1) return;
    auto& replica_group = *options.replica_group();
    // The counts first, so that the fingerprints' AllGather has one length on every rank.
    auto differs = detail::first_differing_rank(
        detail::gather_int64(replica_group, {static_cast<int64_t>(units.size()), world}));
    if (!differs) {
      std::vector<int64_t> prints;
      for (const auto& unit : units) prints.push_back(fingerprint(*unit));
      differs = detail::first_differing_rank(detail::gather_int64(replica_group, prints));
    }
    TORCH_CHECK(!differs.has_value(), kWho, "hybrid sharding: replica ", differs.value_or(0),
                " has other units or another shard group size than replica 0; every shard group "
                "must shard the same model over as many ranks");
  }

  static int64_t fingerprint(const Unit& unit) {
    detail::Fingerprint print;  // the numbers that describe the unit
    print.add(static_cast<int64_t>(unit.params.size()))
        .add(static_cast<int64_t>(c10::typeMetaToScalarType(unit.options.dtype())))
        .add(static_cast<int64_t>(unit.options.device().type()));
    for (const auto& slot : unit.params) print.add_list(slot.sizes);
    return print.value();
  }

  static std::string describe(const Unit& unit) {
    std::ostringstream out;
    for (size_t i = 0; i < unit.params.size(); ++i) {
      out << (i ? ", " : "") << shape_text(unit.params[i].sizes);
    }
    out << " (" << unit.options.dtype() << ", " << unit.options.device() << ")";
    return out.str();
  }

  void make_groups(int64_t tag) {
    reduce_group = group;
    step_group = group;
    if (world == 1) return;
    const auto timeout = detail::group_timeout(*group);
    const auto name = "fsdp_" + std::to_string(tag);
    reduce_group = detail::make_subgroup(group, 0, world, name + "_reduce", timeout);
    if (options.overlap_step()) {
      step_group = detail::make_subgroup(group, 0, world, name + "_step", timeout);
    }
  }

  /// Rank 0's values everywhere: within the shard group, then (hybrid) across the replicas.
  void broadcast_values() {
    if (!options.broadcast_parameters()) return;
    for (auto& unit : units) {
      std::vector<at::Tensor> params;
      for (const auto& slot : unit->params) params.push_back(slot.param);
      const auto what = "the broadcast of unit '" + unit->name + "'";
      if (world > 1) detail::broadcast_from_rank_zero(*group, params, kWho, what);
      if (replicas > 1) {
        detail::broadcast_from_rank_zero(*options.replica_group(), params, kWho,
                                         what + " across replicas");
      }
    }
  }

  /// Lossless owners: whole parameters, the greedy balance by bytes of Shampoo's blocks.
  void assign_owners() {
    std::vector<int64_t> costs;
    for (const auto& unit : units) {
      for (const auto& slot : unit->params) {
        costs.push_back(detail::block_cost(slot.numel(), slot.param.element_size()));
      }
    }
    detail::OwnershipPlan plan(world);
    plan.add(costs);
    int64_t k = 0;
    for (auto& unit : units) {
      for (auto& slot : unit->params) slot.owner = plan.owner_of(k++);
    }
  }

  /// Each rank's row chunks, and the optimizers: lossless, one per rank over the parameters it
  /// owns in optimizer()'s groups (a parameter's state does not depend on the world size, so
  /// checkpoints move between sizes); local shards, one per unit over this rank's rows.
  void make_shards_and_optimizers() {
    at::NoGradGuard no_grad;
    for (auto& unit : units) {
      std::vector<at::Tensor> stepped;
      for (auto& slot : unit->params) {
        const int64_t valid = slot.valid_rows(rank);
        slot.shard = slot.param.detach()
                         .reshape({slot.rows, slot.row_numel})
                         .narrow(0, slot.first_row(rank), valid)
                         .clone()
                         .view(slot.shard_sizes(rank));
        if (!lossless() && valid > 0) {
          slot.shard.set_requires_grad(true);
          stepped.push_back(slot.shard);
        }
      }
      if (!stepped.empty()) unit->optimizer = factory(stepped);
    }
    if (!lossless()) return;
    rank_optimizer = std::make_unique<detail::RankOptimizer>(factory, kWho);
    const auto& groups = facade->param_groups();
    for (size_t g = 0; g < groups.size(); ++g) {
      std::vector<at::Tensor> owned;  // in the group's order
      for (const auto& p : groups[g].params()) {
        if (slot_for(p).owner == rank) owned.push_back(p);
      }
      rank_optimizer->add(g, owned, group_options());
    }
  }

  /// Whether the parameter is in one of optimizer()'s groups (else it is frozen: not stepped).
  bool in_a_group(const ParamSlot& slot) const { return group_of.count(impl_of(slot.param)) != 0; }

  /// The options of optimizer()'s param groups, as the rank optimizer asks for them.
  detail::RankOptimizer::GroupOptions group_options() {
    return [this](size_t g) -> const torch::optim::OptimizerOptions& {
      return facade->param_groups().at(g).options();
    };
  }

  void add_hooks() {
    std::weak_ptr<State> weak = shared_from_this();
    for (size_t u = 0; u < units.size(); ++u) {
      for (size_t i = 0; i < units[u]->params.size(); ++i) {
        units[u]->params[i].hook = detail::add_grad_ready_callback(units[u]->params[i].param,
                                                                   [weak, u, i](const at::Tensor&) {
                                                                     if (auto self = weak.lock())
                                                                       self->on_grad_ready(u, i);
                                                                   });
      }
    }
  }

  // ----- gathering and releasing -----

  /// All-gathers the unit's chunks over `via` into the full parameters (in the policy's compute
  /// dtype): one all-gather per parameter, straight into its storage when its rows split evenly
  /// (else through a padded buffer), all in flight at once.
  void gather(Unit& unit, c10d::ProcessGroup& via) {
    if (unit.gathered) return;
    at::NoGradGuard no_grad;
    const auto compute = unit.options.dtype(unit.compute_dtype);
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    std::vector<at::Tensor> inputs;
    std::vector<at::Tensor> padded(unit.params.size());
    for (size_t i = 0; i < unit.params.size(); ++i) {
      auto& slot = unit.params[i];
      allocate_full(slot.param, slot.sizes, unit.compute_dtype);
      auto input = slot.shard.reshape({-1}).to(unit.compute_dtype);
      if (input.numel() < slot.chunk_numel()) {
        input = at::empty({slot.chunk_numel()}, compute);
        write_shard(input, slot);
      }
      at::Tensor output = slot.param.variable_data().view({-1});
      if (slot.rows % world != 0) {
        padded[i] = at::empty({world * slot.chunk_numel()}, compute);
        output = padded[i];
      }
      inputs.push_back(input);
      works.push_back(via._allgather_base(output, inputs.back()));
    }
    wait_all_of(works, "the all-gather of unit '" + unit.name + "'", rank);
    for (size_t i = 0; i < unit.params.size(); ++i) {
      if (!padded[i].defined()) continue;
      const auto& slot = unit.params[i];
      slot.param.variable_data().view({-1}).copy_(padded[i].narrow(0, 0, slot.numel()));
    }
    unit.gathered = true;
  }

  void reshard(Unit& unit) {
    if (!unit.gathered) return;
    for (auto& slot : unit.params) release_full(slot.param, unit.dtype);
    unit.gathered = false;
  }

  // ----- forward and backward -----

  at::Tensor forward(size_t u, const std::function<at::Tensor()>& fn) {
    auto& unit = this->unit(u);
    if (holding) {
      TORCH_CHECK(!at::GradMode::is_enabled(), kWho, "the forward of unit '", unit.name,
                  "' runs with gradients between gather_all() and release_all(); those are for "
                  "forwards without gradients (evaluation)");
      return fn();
    }
    if (unit.pending.valid()) wait_for(unit);
    {
      std::lock_guard<std::recursive_mutex> lock(mutex);
      // The first forward of an iteration: no unit is gathered, groups added since join here.
      if (!pass.is_open() && forward_order.empty()) sync_groups();
      gather(unit, *group);
    }
    auto out = fn();
    TORCH_CHECK(out.defined(), kWho, "the forward of unit '", unit.name,
                "' returned an undefined tensor");
    if (out.requires_grad()) {
      std::lock_guard<std::recursive_mutex> lock(mutex);
      if (!unit.in_pass) {
        unit.in_pass = true;
        forward_order.push_back(u);
      }
      std::weak_ptr<State> weak = shared_from_this();
      out.register_hook([weak, u](const at::Tensor&) {
        if (auto self = weak.lock()) self->before_unit_backward(u);
      });
    }
    if (options.reshard_after_forward()) {
      std::lock_guard<std::recursive_mutex> lock(mutex);
      reshard(unit);
    }
    return out;
  }

  void open_pass() {
    std::weak_ptr<State> weak = shared_from_this();
    if (!pass.open([weak] {
          if (auto self = weak.lock()) self->close_pass();
        })) {
      return;
    }
    stepping = (passes_since_step + 1) % options.accumulation_steps() == 0;
    // With overlap the steps run during this pass: the options in effect are those at its start.
    if (stepping && options.overlap_step()) push_group_options();
  }

  /// Before the unit's backward: gather it, and every unit before it in reverse forward order
  /// (the same sequence of collectives on every rank, whatever order hooks fire in).
  void before_unit_backward(size_t u) {
    std::lock_guard<std::recursive_mutex> lock(mutex);
    open_pass();
    const auto position = std::find(forward_order.rbegin(), forward_order.rend(), u);
    if (position == forward_order.rend()) return;
    const auto last = static_cast<size_t>(position - forward_order.rbegin());
    for (; next_to_gather <= last; ++next_to_gather) {
      gather(unit(forward_order[forward_order.size() - 1 - next_to_gather]), *group);
    }
  }

  void on_grad_ready(size_t u, size_t i) {
    std::lock_guard<std::recursive_mutex> lock(mutex);
    open_pass();
    auto& slot = unit(u).params[i];
    if (!slot.arrived) {
      slot.arrived = true;
      ++unit(u).arrived;
    }
    // Reductions run in reverse forward order on every rank (their collectives must match).
    while (next_to_reduce < forward_order.size()) {
      auto& next = unit(forward_order[forward_order.size() - 1 - next_to_reduce]);
      if (next.arrived < static_cast<int64_t>(next.params.size())) break;
      reduce(next);
      ++next_to_reduce;
    }
  }

  void close_pass() {
    std::lock_guard<std::recursive_mutex> lock(mutex);
    // Units whose gradients did not all arrive (a parameter unused in this pass counts as zero).
    for (; next_to_reduce < forward_order.size(); ++next_to_reduce) {
      reduce(unit(forward_order[forward_order.size() - 1 - next_to_reduce]));
    }
    for (auto& unit : units) {
      unit->in_pass = false;
      unit->arrived = 0;
      for (auto& slot : unit->params) slot.arrived = false;
    }
    forward_order.clear();
    next_to_gather = 0;
    next_to_reduce = 0;
    pass.close();
    ++passes;
    ++passes_since_step;
    if (stepping && options.overlap_step()) {
      // The one point where an iteration's steps end: before backward() returns. What the user
      // does next (a scheduler's step, set_lr, zero_grad, a checkpoint) then never races with a
      // step on the worker, and options changed between iterations apply to the next one.
      wait_all();
      if (!pass_failure.empty()) {
        const bool undone = undo_pass();
        const auto message = std::exchange(pass_failure, std::string());
        passes_since_step = 0;
        write_state_entries();
        TORCH_CHECK(false, message, failure_outcome(undone));
      }
      commit_pass();
      finish_step();
      write_state_entries();
    }
  }

  // ----- reduction -----

  /// Averages the unit's gradients over the ranks into what this rank steps, releases the full
  /// gradients, and steps the unit on the worker (overlap) or marks it for step().
  void reduce(Unit& unit) {
    // The gathers for backward never come back to a reduced unit (the worker may release it).
    next_to_gather = std::max(next_to_gather, next_to_reduce + 1);
    const bool step_now = stepping && options.overlap_step();
    std::vector<at::Tensor> grads;
    for (auto& slot : unit.params) {
      auto grad = std::exchange(slot.param.mutable_grad(), at::Tensor());
      grads.push_back(grad.defined()
                          ? grad.view(slot.sizes).to(unit.reduce_dtype)
                          : at::zeros(slot.sizes, unit.options.dtype(unit.reduce_dtype)));
    }
    // The parameters go before the gradients are reduced. A lossless step right away keeps the
    // ones this rank owns when they hold its values exactly (gathered in their own dtype): the
    // step then needs no rows collected.
    if (step_now && lossless() && unit.gathered && unit.compute_dtype == unit.dtype) {
      for (auto& slot : unit.params) {
        if (slot.owner != rank) release_full(slot.param, unit.dtype);
      }
      unit.gathered = false;
      unit.owned_kept = true;
    } else {
      reshard(unit);
    }
    if (lossless()) {
      reduce_to_owners(unit, std::move(grads));
    } else {
      reduce_to_rows(unit, std::move(grads));
    }
    if (stepping) unit.to_step = true;
    if (step_now) {
      std::weak_ptr<State> weak = shared_from_this();
      Unit* target = &unit;
      unit.pending = worker->submit([weak, target] {
        if (auto self = weak.lock()) self->step_unit(*target, *self->step_group);
      });
    }
  }

  /// Lossless: each whole gradient is summed into its owner's copy in place (a c10d reduce, as
  /// gradient sharding does) and divided by the world size there: an all-reduce's average, with
  /// no buffer beyond the gradients themselves. The other ranks release theirs.
  void reduce_to_owners(Unit& unit, std::vector<at::Tensor> grads) {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (size_t i = 0; i < grads.size() && world > 1; ++i) {
      c10d::ReduceOptions reduce_options;
      reduce_options.rootRank = unit.params[i].owner;
      std::vector<at::Tensor> one{grads[i]};
      works.push_back(reduce_group->reduce(one, reduce_options));
    }
    wait_all_of(works, "the gradient reduction of unit '" + unit.name + "'", rank);
    std::vector<at::Tensor> owned;
    for (size_t i = 0; i < grads.size(); ++i) {
      if (unit.params[i].owner == rank) owned.push_back(grads[i]);
    }
    reduce_across_replicas(unit, owned);
    for (size_t i = 0; i < grads.size(); ++i) {
      if (unit.params[i].owner == rank) {
        accumulate(unit.params[i], grads[i].to(unit.dtype).div_(world * replicas));
      }
      grads[i] = at::Tensor();
    }
  }

  /// Local shards: a reduce-scatter of the rank-major row chunks (padded), averaged.
  void reduce_to_rows(Unit& unit, std::vector<at::Tensor> grads) {
    const auto reduce = unit.options.dtype(unit.reduce_dtype);
    auto send = at::empty({world, unit.shard_numel}, reduce);
    for (size_t i = 0; i < unit.params.size(); ++i) {
      const auto& slot = unit.params[i];
      write_chunks(send, slot, grads[i]);
      grads[i] = at::Tensor();
    }
    auto received = at::empty({unit.shard_numel}, reduce);
    auto flat = send.view({-1});
    wait_one(reduce_group->_reduce_scatter_base(received, flat),
             "the gradient reduce-scatter of unit '" + unit.name + "'", rank);
    send = at::Tensor();
    reduce_across_replicas(unit, {received});
    for (auto& slot : unit.params) {
      const int64_t n = slot.valid_rows(rank) * slot.row_numel;
      if (n > 0) {
        accumulate(slot, received.narrow(0, slot.offset, n)
                             .to(unit.dtype)
                             .div(world * replicas)
                             .view(slot.shard_sizes(rank)));
      }
    }
  }

  /// Hybrid: sums `sums` (what this rank reduced within its shard group) over the replica group,
  /// in place: the ranks there hold the same shards. Nothing without replicas.
  void reduce_across_replicas(const Unit& unit, const std::vector<at::Tensor>& sums) {
    if (replicas == 1) return;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (const auto& sum : sums) {
      std::vector<at::Tensor> one{sum};
      works.push_back(options.replica_group()->allreduce(one));
    }
    wait_all_of(works, "the gradient all-reduce across replicas of unit '" + unit.name + "'", rank);
  }

  /// Writes `full`'s rows (the parameter's full shape) into the rank-major [world, ...] buffer
  /// at `column`, one chunk per rank, zeros past the last row.
  static void write_chunks(const at::Tensor& by_rank, const ParamSlot& slot, const at::Tensor& full,
                           int64_t column) {
    const auto rows = full.reshape({slot.rows, slot.row_numel});
    const int world = static_cast<int>(by_rank.size(0));
    for (int r = 0; r < world; ++r) {
      auto chunk = by_rank[r].narrow(0, column, slot.chunk_numel()).view({slot.chunk_rows, -1});
      const int64_t valid = slot.valid_rows(r);
      if (valid > 0) chunk.narrow(0, 0, valid).copy_(rows.narrow(0, r * slot.chunk_rows, valid));
      if (valid < slot.chunk_rows) chunk.narrow(0, valid, slot.chunk_rows - valid).zero_();
    }
  }
  static void write_chunks(const at::Tensor& by_rank, const ParamSlot& slot,
                           const at::Tensor& full) {
    write_chunks(by_rank, slot, full, slot.offset);
  }

  /// The inverse of write_chunks: the rank-major buffer's chunks at `column` into `full`'s rows.
  static void read_chunks(const at::Tensor& by_rank, const ParamSlot& slot, int64_t column,
                          const at::Tensor& full) {
    const auto rows = full.view({slot.rows, slot.row_numel});
    for (int r = 0; r < static_cast<int>(by_rank.size(0)); ++r) {
      const int64_t valid = slot.valid_rows(r);
      if (valid == 0) continue;
      rows.narrow(0, r * slot.chunk_rows, valid)
          .copy_(by_rank[r].narrow(0, column, valid * slot.row_numel).view({valid, -1}));
    }
  }

  /// This rank's shard into `chunk` (chunk_numel elements, any dtype), zeros past its rows.
  static void write_shard(const at::Tensor& chunk, const ParamSlot& slot) {
    const auto n = slot.shard.numel();
    chunk.narrow(0, 0, n).copy_(slot.shard.detach().reshape({-1}));
    chunk.narrow(0, n, slot.chunk_numel() - n).zero_();
  }

  /// Per rank: the elements of the chunks of the unit's parameters that rank owns.
  std::vector<int64_t> chunks_by_owner(const Unit& unit) const {
    std::vector<int64_t> split(world, 0);
    for (const auto& slot : unit.params) split[slot.owner] += slot.chunk_numel();
    return split;
  }

  /// Where each rank's part starts in a buffer of consecutive parts of sizes `split`.
  static std::vector<int64_t> starts_of(const std::vector<int64_t>& split) {
    std::vector<int64_t> starts(split.size(), 0);
    for (size_t o = 1; o < split.size(); ++o) starts[o] = starts[o - 1] + split[o - 1];
    return starts;
  }

  static void accumulate(ParamSlot& slot, at::Tensor averaged) {
    if (slot.reduced.defined()) {
      slot.reduced += averaged;
    } else {
      slot.reduced = std::move(averaged);
    }
  }

  // ----- the step -----

  /// Steps one unit on the gradients reduced for it and releases them. Lossless: every rank
  /// sends each owner its rows of the owner's parameters over `via` (the full values in the
  /// parameters' own dtype, whatever the compute dtype), the owners step them whole, send every
  /// rank its rows back, and release them.
  void step_unit(Unit& unit, c10d::ProcessGroup& via) {
    at::NoGradGuard no_grad;
    if (!pass_failure.empty()) {  // an earlier unit of this pass failed, on every rank alike
      drop_unit_step(unit);
      return;
    }
    if (lossless() && !std::exchange(unit.owned_kept, false)) collect_rows(unit, via);
    UnitUndo undo;
    const auto failure = step_reduced(unit, undo);
    // Every rank learns whether any failed before any rank's rows change, so that all of them
    // go on (or stop) together instead of one waiting in the all-to-all.
    const auto flags = detail::gather_int64(via, {failure.empty() ? 0 : 1});
    std::vector<int> failed;
    for (int r = 0; r < world; ++r) {
      if (flags[r][0] != 0) failed.push_back(r);
    }
    if (!failed.empty()) {
      undo.revert();  // this rank's rows never changed
      if (lossless()) {
        for (auto& slot : unit.params) release_full(slot.param, unit.dtype);
      }
      unit.to_step = false;
      pass_failure = failure_message(unit, failed, failure);
      return;
    }
    if (journal()) {
      for (auto& slot : unit.params) undo.shards.emplace_back(slot.shard, slot.shard.clone());
    }
    if (lossless()) {
      scatter_rows(unit, via);
      for (auto& slot : unit.params) release_full(slot.param, unit.dtype);
    }
    if (journal()) pass_undo.push_back(std::move(undo));
    unit.to_step = false;
  }

  /// This rank's part of a unit's step: the reduced gradients set on what it steps (the whole
  /// owned parameters, or its rows), its optimizers stepped (what undoes that saved in `undo`),
  /// the gradients released. Returns why it failed (a non-finite gradient, an optimizer's error),
  /// or nothing.
  std::string step_reduced(Unit& unit, UnitUndo& undo) {
    // What this rank steps: (optimizer, its parameters with their gradients set).
    std::vector<std::pair<torch::optim::Optimizer*, std::vector<at::Tensor>>> work;
    // Without overlap every unit was checked before any stepped (check_finite_before_steps).
    std::string failure = options.overlap_step() ? non_finite_gradient(unit) : std::string();
    std::vector<at::Tensor> owned;  // lossless: the parameters this rank steps
    for (auto& slot : unit.params) {
      if (!slot.reduced.defined()) continue;
      auto& target = lossless() ? slot.param : slot.shard;
      target.mutable_grad() = slot.reduced;
      if (lossless() && in_a_group(slot)) owned.push_back(slot.param);
    }
    if (unit.optimizer) {
      std::vector<at::Tensor> rows;
      for (auto& slot : unit.params) {
        if (slot.shard.grad().defined()) rows.push_back(slot.shard);
      }
      work.push_back({unit.optimizer.get(), rows});
    }
    if (failure.empty()) {
      try {
        if (lossless()) rank_optimizer->step(owned, /*in_pass=*/true, journal() ? &undo : nullptr);
        for (auto& [optimizer, params] : work) step_optimizer(*optimizer, params, undo);
      } catch (const std::exception& e) {
        failure = std::string("the step of unit '") + unit.name + "' failed: " + e.what();
      }
    }
    for (auto& slot : unit.params) {
      (lossless() ? slot.param : slot.shard).mutable_grad() = at::Tensor();
      slot.reduced = at::Tensor();
    }
    return failure;
  }

  /// A unit of a pass whose earlier unit failed: its gradients are dropped, nothing steps.
  void drop_unit_step(Unit& unit) {
    for (auto& slot : unit.params) {
      slot.reduced = at::Tensor();
      if (lossless()) release_full(slot.param, unit.dtype);  // kept from backward, if it was
    }
    unit.owned_kept = false;
    unit.to_step = false;
  }

  /// Steps `params` with `optimizer`, first saving in `undo` what undoes it (with the journal).
  void step_optimizer(torch::optim::Optimizer& optimizer, const std::vector<at::Tensor>& params,
                      UnitUndo& undo) const {
    if (!journal()) {
      optimizer.step();
      return;
    }
    if (auto* phased = dynamic_cast<PhasedBackwardStep*>(&optimizer)) {
      // DistributedShampoo: its step in phases keeps its own journal until finished or aborted.
      if (!phased->backward_step_open()) {
        phased->begin_backward_step();
        undo.phased.push_back(phased);
      }
      phased->step_parameters(params);
      return;
    }
    if (!detail::libtorch_optimizer_name(optimizer).empty()) {
      for (const auto& p : params) {
        void* key = p.unsafeGetTensorImpl();
        const auto it = optimizer.state().find(key);
        undo.states.push_back({&optimizer, key,
                               it == optimizer.state().end()
                                   ? nullptr
                                   : detail::copy_param_state(optimizer, *it->second)});
      }
      optimizer.step();
      return;
    }
    undo.complete = false;  // an optimizer of another type: its step cannot be undone
    optimizer.step();
  }

  /// Undoes the steps of the units stepped in the failed pass; false when one of them cannot be.
  bool undo_pass() {
    bool complete = true;
    for (auto it = pass_undo.rbegin(); it != pass_undo.rend(); ++it) {
      complete = complete && it->complete;
      it->revert();
    }
    pass_undo.clear();
    if (rank_optimizer) {
      // Without the journal the steps taken stand (undo_failed_steps(false)).
      if (journal()) {
        rank_optimizer->abort();
      } else {
        rank_optimizer->finish();
      }
    }
    return complete;
  }

  void commit_pass() {
    for (auto& undo : pass_undo) undo.commit();
    pass_undo.clear();
    if (rank_optimizer) rank_optimizer->finish();
  }

  /// "parameter i ... holds inf or NaN" for the first owned averaged gradient that does, else "".
  std::string non_finite_gradient(const Unit& unit) const {
    for (size_t i = 0; i < unit.params.size(); ++i) {
      const auto& slot = unit.params[i];
      if (slot.reduced.defined() && !all_finite(slot.reduced)) {
        return "the averaged gradient of parameter " + std::to_string(i) + " of unit '" +
               unit.name + "' (shape " + shape_text(slot.sizes) +
               ") holds inf or NaN (a rank's gradient did, or the average overflowed)";
      }
    }
    return "";
  }

  /// Every rank's message for a unit whose step failed on the ranks `failed`; `here` is this
  /// rank's own reason (empty when it did not fail).
  std::string failure_message(const Unit& unit, const std::vector<int>& failed,
                              const std::string& here) const {
    std::ostringstream ranks;
    for (size_t k = 0; k < failed.size(); ++k) ranks << (k ? ", " : "") << failed[k];
    std::ostringstream out;
    out << kWho << "the step of unit '" << unit.name << "' failed on rank(s) " << ranks.str();
    if (here.empty()) {
      out << " (the error there says why)";
    } else {
      out << ": on rank " << rank << ", " << here;
    }
    return out.str();
  }

  /// The end of a failure's message: what the failed iteration left.
  static std::string failure_outcome(bool undone) {
    if (!undone) {
      return "; units stepped earlier in this backward pass by an optimizer that cannot undo a "
             "step (not DistributedShampoo or one of LibTorch's SGD, Adam, AdamW, Adagrad, "
             "RMSprop), or with FullyShardedOptions().undo_failed_steps(false), keep their step: "
             "load a checkpoint to go on from a known state";
    }
    return "; no unit was stepped in this iteration: parameters and optimizer state are as "
           "before it and the next iteration can run, as with data parallelism. A non-finite "
           "gradient comes from a non-finite loss or an overflow: skip the batch, lower the "
           "learning rate, or for fp16 use a GradScaler (with overlap_step(false))";
  }

  /// Lossless: every rank sends each owner its rows of the owner's parameters; the owners'
  /// parameters get their full values (in their own dtype).
  void collect_rows(Unit& unit, c10d::ProcessGroup& via) {
    auto send_split = chunks_by_owner(unit);
    const int64_t owned_chunks = send_split[rank];
    auto send = at::empty({c10::sum_integers(send_split)}, unit.options);
    auto offset = starts_of(send_split);
    for (const auto& slot : unit.params) {
      write_shard(send.narrow(0, offset[slot.owner], slot.chunk_numel()), slot);
      offset[slot.owner] += slot.chunk_numel();
    }
    auto received = at::empty({world, owned_chunks}, unit.options);
    auto flat = received.view({-1});
    std::vector<int64_t> receive_split(world, owned_chunks);
    wait_one(via.alltoall_base(flat, send, receive_split, send_split),
             "collecting the rows of unit '" + unit.name + "' for its step", rank);
    int64_t column = 0;
    for (auto& slot : unit.params) {
      if (slot.owner != rank) continue;
      allocate_full(slot.param, slot.sizes, unit.dtype);
      read_chunks(received, slot, column, slot.param.variable_data());
      column += slot.chunk_numel();
    }
  }

  /// Lossless: each owner sends every rank that rank's rows of the parameters it stepped.
  void scatter_rows(Unit& unit, c10d::ProcessGroup& via) {
    auto receive_split = chunks_by_owner(unit);
    const int64_t sent_per_rank = receive_split[rank];
    auto send = at::empty({world, sent_per_rank}, unit.options);
    int64_t column = 0;
    for (const auto& slot : unit.params) {
      if (slot.owner != rank) continue;
      write_chunks(send, slot, slot.param, column);
      column += slot.chunk_numel();
    }
    auto received = at::empty({c10::sum_integers(receive_split)}, unit.options);
    std::vector<int64_t> send_split(world, sent_per_rank);
    auto flat = send.view({-1});
    wait_one(via.alltoall_base(received, flat, receive_split, send_split),
             "sending the stepped rows of unit '" + unit.name + "'", rank);
    auto source_offset = starts_of(receive_split);
    for (auto& slot : unit.params) {
      const int64_t n = slot.valid_rows(rank) * slot.row_numel;
      if (n > 0) slot.shard.view({-1}).copy_(received.narrow(0, source_offset[slot.owner], n));
      source_offset[slot.owner] += slot.chunk_numel();
    }
  }

  void check_step_after_backward(const char* function) const {
    TORCH_CHECK(!options.overlap_step(), kWho, function,
                ": with overlap_step the steps run during backward; go on with the next forward "
                "(or call wait()), or construct with FullyShardedOptions().overlap_step(false)");
    TORCH_CHECK(passes_since_step >= options.accumulation_steps(), kWho, function,
                ": accumulation_steps is ", options.accumulation_steps(), " and ",
                passes_since_step, " backward pass(es) ran since the last step");
  }

  void step_all(const char* function) {
    check_step_after_backward(function);
    std::lock_guard<std::recursive_mutex> lock(mutex);
    sync_groups();
    push_group_options();
    check_finite_before_steps();
    if (lossless()) {
      step_all_owned();
    } else {
      for (auto& unit : units) {
        if (!unit->to_step) continue;
        step_unit(*unit, *group);
        if (!pass_failure.empty()) {
          for (auto& rest : units) {
            if (rest->to_step) drop_unit_step(*rest);
          }
          passes_since_step = 0;
          TORCH_CHECK(false, std::exchange(pass_failure, std::string()), failure_outcome(true));
        }
      }
    }
    finish_step();
    write_state_entries();
  }

  /// Lossless, after backward: every unit's owned parameters get their full values, the rank's
  /// optimizer steps them all in one ordinary step (DistributedShampoo's roots batched over all
  /// of them), and every rank gets its rows back. A failure on any rank changes nothing on
  /// every rank.
  void step_all_owned() {
    std::vector<Unit*> stepping;
    for (auto& unit : units) {
      if (unit->to_step) stepping.push_back(unit.get());
    }
    for (auto* unit : stepping) collect_rows(*unit, *group);
    std::vector<at::Tensor> owned;
    for (auto* unit : stepping) {
      for (auto& slot : unit->params) {
        if (!slot.reduced.defined() || !in_a_group(slot)) continue;
        slot.param.mutable_grad() = std::exchange(slot.reduced, at::Tensor());
        owned.push_back(slot.param);
      }
    }
    std::string failure;
    try {
      at::NoGradGuard no_grad;
      if (!owned.empty()) rank_optimizer->step(owned, /*in_pass=*/false, nullptr);
    } catch (const std::exception& e) {
      failure = std::string("the step failed: ") + e.what();
    }
    for (auto& p : owned) p.mutable_grad() = at::Tensor();
    const auto flags = detail::gather_int64(*group, {failure.empty() ? 0 : 1});
    std::vector<int> failed;
    for (int r = 0; r < world; ++r) {
      if (flags[r][0] != 0) failed.push_back(r);
    }
    for (auto* unit : stepping) {
      if (failed.empty()) scatter_rows(*unit, *group);
      drop_unit_step(*unit);
    }
    if (failed.empty()) return;
    passes_since_step = 0;
    std::ostringstream ranks;
    for (size_t k = 0; k < failed.size(); ++k) ranks << (k ? ", " : "") << failed[k];
    TORCH_CHECK(false, kWho, "the step failed on rank(s) ", ranks.str(),
                failure.empty() ? " (the error there says why)" : ": here, " + failure,
                failure_outcome(true));
  }

  /// Without overlap: every unit's averaged gradients are checked on their owners, and the
  /// ranks agree, before any unit steps; a non-finite one fails the step on every rank with
  /// nothing changed (the reduced gradients are dropped, as a skipped step drops them).
  void check_finite_before_steps() {
    std::vector<int64_t> flags;
    std::string here;
    for (const auto& unit : units) {
      auto found = unit->to_step ? non_finite_gradient(*unit) : std::string();
      if (here.empty()) here = found;
      flags.push_back(found.empty() ? 0 : 1);
    }
    const auto all = detail::gather_int64(*group, flags);
    for (size_t u = 0; u < units.size(); ++u) {
      std::vector<int> failed;
      for (int r = 0; r < world; ++r) {
        if (all[r][u] != 0) failed.push_back(r);
      }
      if (failed.empty()) continue;
      for (auto& unit : units) drop_unit_step(*unit);
      passes_since_step = 0;
      TORCH_CHECK(false, failure_message(*units[u], failed, here), failure_outcome(true));
    }
  }

  void skip_all() {
    check_step_after_backward("skip_step()");
    std::lock_guard<std::recursive_mutex> lock(mutex);
    for (auto& unit : units) {
      for (auto& slot : unit->params) slot.reduced = at::Tensor();
      unit->to_step = false;
    }
    passes_since_step = 0;
  }

  /// `function`: what the user called, for the error with overlap_step.
  std::vector<at::Tensor> reduced_gradients(const char* function) {
    TORCH_CHECK(!options.overlap_step(), kWho, function,
                ": with overlap_step (the default) each unit steps during backward as soon as its "
                "gradients are reduced, before the other units' gradients exist, so there is "
                "nothing left to work on after backward; construct the wrapper with "
                "FullyShardedOptions().overlap_step(false) and call it between backward and "
                "step()");
    std::vector<at::Tensor> out;
    for (auto& unit : units) {
      for (auto& slot : unit->params) {
        if (slot.reduced.defined()) out.push_back(slot.reduced);
      }
    }
    return out;
  }

  void finish_step() {
    passes_since_step = 0;
    ++steps;
  }

  static void wait_for(Unit& unit) {
    auto pending = std::exchange(unit.pending, {});
    pending.get();
  }

  void wait_all() {
    std::exception_ptr first;
    for (auto& unit : units) {
      if (!unit->pending.valid()) continue;
      try {
        wait_for(*unit);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
  }

  // ----- optimizer(): the user's param groups -----

  /// The options as bytes, to notice a change (OptimizerOptions has no operator==).
  static std::string options_bytes(const torch::optim::OptimizerOptions& options) {
    torch::serialize::OutputArchive archive;
    options.serialize(archive);
    std::ostringstream out;
    archive.save_to(out);
    return out.str();
  }

  /// Every group of `to` gets a copy of `from` (group g's options).
  static void copy_options(const torch::optim::OptimizerOptions& from, torch::optim::Optimizer& to,
                           size_t g) {
    for (auto& group : to.param_groups()) {
      TORCH_CHECK(typeid(from) == typeid(group.options()), kWho, "param group ", g,
                  ": its options are a ", c10::demangle(typeid(from).name()),
                  ", but the factory's optimizers take ",
                  c10::demangle(typeid(group.options()).name()),
                  " (give the group options of that type, or none for the factory's)");
      group.set_options(from.clone());
    }
  }

  /// Copies each group's options into the optimizers of its parameters where they changed since
  /// the last copy: the one point per iteration where options take effect (the start of backward
  /// with overlap, of step() without). Options set on one of optimizers() directly stay until
  /// then.
  void push_group_options() {
    auto& groups = facade->param_groups();
    for (size_t g = 0; g < group_sizes.size(); ++g) {
      auto bytes = options_bytes(groups[g].options());
      if (bytes == pushed[g]) continue;
      if (rank_optimizer) rank_optimizer->set_options(g, groups[g].options());
      for (auto& unit : units) {
        if (unit->optimizer) copy_options(groups[g].options(), *unit->optimizer, g);
      }
      pushed[g] = std::move(bytes);
    }
  }

  /// Registers the parameters of param group `g` from position `first` on: unit parameters in
  /// no other group, the same on every rank (checked before anything changes, then agreed on).
  /// Returns the registered parameters. Collective.
  std::vector<at::Tensor> register_group_params(size_t g, size_t first) {
    const auto& params = facade->param_groups()[g].params();
    std::string error;
    std::vector<int64_t> positions;
    std::unordered_map<const c10::TensorImpl*, size_t> fresh;
    for (size_t i = first; i < params.size() && error.empty(); ++i) {
      const auto where = "param group " + std::to_string(g) + ": parameter " + std::to_string(i);
      const auto slot = params[i].defined() ? slot_of.find(impl_of(params[i])) : slot_of.end();
      if (slot == slot_of.end()) {
        error = where + " is no unit's parameter (optimizer() steps the units' parameters)";
      } else if (group_of.count(impl_of(params[i])) != 0 ||
                 !fresh.emplace(impl_of(params[i]), i).second) {
        error = where + " is already in a param group (a parameter belongs to one group)";
      } else {
        positions.push_back(static_cast<int64_t>(slot->second.first));
        positions.push_back(static_cast<int64_t>(slot->second.second));
      }
    }
    // The positions, as every rank must have them.
    const auto all =
        detail::gather_int64(*group, {error.empty() ? 0 : 1, detail::fingerprint(positions)});
    TORCH_CHECK(error.empty(), kWho, error);
    for (int r = 0; r < world; ++r) {
      TORCH_CHECK(all[r][0] == 0, kWho, "adding param group ", g, " failed on rank ", r,
                  " (its error says why)");
      TORCH_CHECK(all[r][1] == all[0][1], kWho, "param group ", g,
                  " holds other parameters on rank ", r,
                  " than on rank 0; every rank must pass "
                  "the same groups");
    }
    std::vector<at::Tensor> added(params.begin() + static_cast<int64_t>(first), params.end());
    for (const auto& p : added) {
      group_of[impl_of(p)] = g;
      joined_at[impl_of(p)] = steps;
    }
    group_sizes[g] += added.size();
    return added;
  }

  /// Parameters that joined a group after construction (lossless): every rank gathers each one's
  /// full value (collective), its owner adds it to its optimizer. Only between iterations, when
  /// no unit is gathered.
  void add_later_params(const std::vector<at::Tensor>& added, size_t g) {
    TORCH_CHECK(lossless(), kWho, "param groups added after construction need step_mode kLossless");
    at::NoGradGuard no_grad;
    for (const auto& p : added) {
      const auto [u, i] = position_of(p);
      auto& unit = this->unit(u);
      auto& slot = unit.params[i];
      TORCH_CHECK(!unit.gathered, kWho, "param group ", g,
                  ": add param groups between iterations (unit '", unit.name, "' is gathered)");
      materialize(unit, slot,
                  "the all-gather of a parameter joining param group " + std::to_string(g));
      if (slot.owner == rank) rank_optimizer->add(g, {slot.param}, group_options());
      release_full(slot.param, unit.dtype);
    }
  }

  /// Gives the (released) parameter its full value in its own dtype: every rank's rows,
  /// all-gathered. Collective.
  void materialize(Unit& unit, ParamSlot& slot, const std::string& what) {
    at::NoGradGuard no_grad;
    allocate_full(slot.param, slot.sizes, unit.dtype);
    auto input = at::empty({slot.chunk_numel()}, unit.options);
    write_shard(input, slot);
    auto gathered = at::empty({world * slot.chunk_numel()}, unit.options);
    wait_one(group->_allgather_base(gathered, input), what, rank);
    slot.param.variable_data().view({-1}).copy_(gathered.narrow(0, 0, slot.numel()));
  }

  /// Registers what was appended to optimizer()'s param groups since the last call (through its
  /// add_param_group, or the base class's add_param_group or add_parameters). Collective when
  /// something was; only between iterations.
  void sync_groups() {
    if (!facade) return;
    auto& groups = facade->param_groups();
    bool added = false;
    for (size_t g = 0; g < groups.size(); ++g) {
      if (g >= group_sizes.size()) {
        TORCH_CHECK(typeid(groups[g].options()) == typeid(facade->defaults()), kWho, "param group ",
                    g, ": its options are a ", c10::demangle(typeid(groups[g].options()).name()),
                    ", but the factory's optimizers take ",
                    c10::demangle(typeid(facade->defaults()).name()));
        group_sizes.push_back(0);
        pushed.push_back(options_bytes(groups[g].options()));
      }
      if (groups[g].params().size() > group_sizes[g]) {
        add_later_params(register_group_params(g, group_sizes[g]), g);
        added = true;
      }
    }
    if (added) write_state_entries();
  }

  /// state() of optimizer(): per parameter of a group, its steps since it joined and its owner.
  void write_state_entries() {
    if (!facade) return;
    auto& state = facade->state();
    for (const auto& [impl, g] : group_of) {
      auto& entry = state[const_cast<c10::TensorImpl*>(impl)];
      auto* mine = dynamic_cast<ShardedParamState*>(entry.get());
      if (mine == nullptr) {
        entry = std::make_unique<ShardedParamState>();
        mine = static_cast<ShardedParamState*>(entry.get());
      }
      const auto [u, i] = slot_of.at(impl);
      mine->step(steps - joined_at.at(impl)).owner(unit(u).params[i].owner);
    }
  }

  /// optimizer(): its defaults and, without the user's groups, its one group's options are the
  /// factory's, read off an optimizer the factory makes over the smallest parameter (while the
  /// parameters are still whole) and then drops. Then the groups' parameters are registered.
  void make_facade(FullyShardedDataParallel& owner,
                   std::optional<std::vector<torch::optim::OptimizerParamGroup>> given) {
    const ParamSlot* smallest = nullptr;
    for (const auto& unit : units) {
      for (const auto& slot : unit->params) {
        if (smallest == nullptr || slot.numel() < smallest->numel()) smallest = &slot;
      }
    }
    std::unique_ptr<torch::optim::OptimizerOptions> defaults;
    std::unique_ptr<torch::optim::OptimizerOptions> first_options;
    {
      auto probe = factory({smallest->param});
      TORCH_CHECK(probe != nullptr, kWho, "the optimizer factory returned null");
      defaults = probe->defaults().clone();
      first_options = probe->param_groups().at(0).options().clone();
    }
    user_groups = given.has_value();
    if (!given) {
      std::vector<at::Tensor> all;
      for (const auto& unit : units) {
        for (const auto& slot : unit->params) all.push_back(slot.param);
      }
      given.emplace();
      given->emplace_back(std::move(all), std::move(first_options));
    }
    facade.reset(new FullyShardedOptimizer(owner, {}, std::move(defaults)));
    for (size_t g = 0; g < given->size(); ++g) {
      facade->torch::optim::Optimizer::add_param_group((*given)[g]);
      const auto& options = facade->param_groups()[g].options();
      TORCH_CHECK(typeid(options) == typeid(facade->defaults()), kWho, "param group ", g,
                  ": its options are a ", c10::demangle(typeid(options).name()),
                  ", but the factory's optimizers take ",
                  c10::demangle(typeid(facade->defaults()).name()));
      group_sizes.push_back(0);
      pushed.push_back(options_bytes(options));
      register_group_params(g, 0);
    }
  }

  // ----- checkpoints -----

  static std::string param_key(size_t u, size_t i) {
    return "unit_" + std::to_string(u) + "/param_" + std::to_string(i);
  }

  static std::vector<at::Tensor> shapes_of(const Unit& unit) {
    std::vector<at::Tensor> out;  // meta tensors: the shapes without the (released) values
    for (const auto& slot : unit.params) {
      out.push_back(at::empty(slot.sizes, at::TensorOptions().device(at::kMeta)));
    }
    return out;
  }

  void check_checkpointable() const {
    TORCH_CHECK(options.step_mode() == ShardedStepMode::kLossless, kWho,
                "checkpoints need step_mode kLossless: local shards keep optimizer state of row "
                "chunks, which depends on the world size");
  }

  void save_common(torch::serialize::OutputArchive& common) {
    check_checkpointable();
    wait_all();
    common.write("format", c10::IValue(kCheckpointFormat));
    common.write("world", c10::IValue(static_cast<int64_t>(world)));
    common.write("num_units", c10::IValue(static_cast<int64_t>(units.size())));
    common.write("backward_passes", c10::IValue(passes));
    common.write("steps_taken", c10::IValue(steps));
    common.write("passes_since_step", c10::IValue(passes_since_step));
    for (size_t u = 0; u < units.size(); ++u) {
      torch::serialize::OutputArchive archive;
      archive.write("name", c10::IValue(units[u]->name));
      detail::write_param_shapes(archive, shapes_of(*units[u]));
      common.write("unit_" + std::to_string(u), archive);
    }
    save_groups(common);
  }

  /// optimizer()'s param groups: per group its options (what a scheduler set), its parameters
  /// as (unit, index) and their step counts since they joined.
  void save_groups(torch::serialize::OutputArchive& common) {
    torch::serialize::OutputArchive all;
    const auto& groups = facade->param_groups();
    all.write("num_groups", c10::IValue(static_cast<int64_t>(groups.size())));
    for (size_t g = 0; g < groups.size(); ++g) {
      torch::serialize::OutputArchive archive;
      torch::serialize::OutputArchive options;
      groups[g].options().serialize(options);
      archive.write("options", options);
      std::vector<int64_t> positions;
      std::vector<int64_t> counts;
      for (const auto& p : groups[g].params()) {
        const auto [u, i] = position_of(p);
        positions.push_back(static_cast<int64_t>(u));
        positions.push_back(static_cast<int64_t>(i));
        counts.push_back(steps - joined_at.at(impl_of(p)));
      }
      archive.write("positions", at::tensor(positions, at::kLong), /*is_buffer=*/true);
      archive.write("steps", at::tensor(counts, at::kLong), /*is_buffer=*/true);
      all.write("group_" + std::to_string(g), archive);
    }
    common.write("optimizer_groups", all);
  }

  /// What loading the groups installs (checked against this wrapper's groups first); nothing
  /// for a checkpoint written before they were saved.
  std::function<void()> prepare_groups(torch::serialize::InputArchive& common) {
    torch::serialize::InputArchive all;
    if (!common.try_read("optimizer_groups", all)) return [] {};
    const auto& groups = facade->param_groups();
    const int64_t saved = read_int(all, "num_groups");
    TORCH_CHECK(saved == static_cast<int64_t>(groups.size()), kWho, "checkpoint: optimizer() had ",
                saved, " param groups there, ", groups.size(), " here");
    auto options = std::make_shared<std::vector<std::unique_ptr<torch::optim::OptimizerOptions>>>();
    auto joined = std::make_shared<std::vector<std::pair<const c10::TensorImpl*, int64_t>>>();
    for (size_t g = 0; g < groups.size(); ++g) {
      torch::serialize::InputArchive archive;
      torch::serialize::InputArchive saved_options;
      at::Tensor positions;
      at::Tensor counts;
      TORCH_CHECK(all.try_read("group_" + std::to_string(g), archive) &&
                      archive.try_read("options", saved_options) &&
                      archive.try_read("positions", positions, /*is_buffer=*/true) &&
                      archive.try_read("steps", counts, /*is_buffer=*/true),
                  kWho, "checkpoint: param group ", g, " of optimizer() is damaged");
      std::vector<int64_t> here;
      for (const auto& p : groups[g].params()) {
        const auto [u, i] = position_of(p);
        here.push_back(static_cast<int64_t>(u));
        here.push_back(static_cast<int64_t>(i));
      }
      TORCH_CHECK(at::equal(positions, at::tensor(here, at::kLong)), kWho,
                  "checkpoint: param group ", g,
                  " of optimizer() holds other parameters there than here (build the groups "
                  "as the saving run did)");
      options->push_back(groups[g].options().clone());
      options->back()->serialize(saved_options);
      for (size_t k = 0; k < groups[g].params().size(); ++k) {
        joined->emplace_back(impl_of(groups[g].params()[k]), counts[k].item<int64_t>());
      }
    }
    std::weak_ptr<State> weak = shared_from_this();
    return [weak, options, joined] {
      auto self = weak.lock();
      if (!self) return;
      auto& groups = self->facade->param_groups();
      for (size_t g = 0; g < groups.size(); ++g) {
        groups[g].set_options(std::move((*options)[g]));
        // Copied into the optimizers at the next defined point.
        self->pushed[g].clear();
      }
      for (const auto& [impl, count] : *joined) self->joined_at[impl] = self->steps - count;
      self->write_state_entries();
    };
  }

  void save_pieces(PieceWriter& pieces) {
    check_checkpointable();
    wait_all();
    for (size_t u = 0; u < units.size(); ++u) {
      for (size_t i = 0; i < units[u]->params.size(); ++i) {
        const auto& slot = units[u]->params[i];
        if (slot.valid_rows(rank) > 0) {
          torch::serialize::OutputArchive rows;
          rows.write("rows", slot.shard.detach(), /*is_buffer=*/true);
          pieces.add(param_key(u, i) + "/rows_" + std::to_string(rank), std::move(rows));
        }
        if (slot.reduced.defined() && slot.owner == rank) {
          // In the middle of a gradient accumulation: what was accumulated, so that the
          // resumed run steps on the same sum.
          torch::serialize::OutputArchive reduced;
          reduced.write("gradient", slot.reduced.detach(), /*is_buffer=*/true);
          pieces.add(param_key(u, i) + "/accumulated", std::move(reduced));
        }
      }
    }
    if (rank_optimizer) rank_optimizer->save_pieces(pieces, param_name());
  }

  /// A parameter's name in checkpoints: "unit_<u>/param_<i>".
  detail::RankOptimizer::ParamName param_name() const {
    return [this](const at::Tensor& p) {
      const auto [u, i] = position_of(p);
      return param_key(u, i);
    };
  }

  static int64_t read_int(torch::serialize::InputArchive& archive, const std::string& key) {
    return detail::read_int_entry(archive, key, "FullyShardedDataParallel checkpoint");
  }

  /// Format 2 (one optimizer per rank, its state saved per parameter); the first format (one
  /// optimizer per parameter, each saved whole) has no entry.
  static void check_format(torch::serialize::InputArchive& common) {
    c10::IValue format;
    TORCH_CHECK(common.try_read("format", format) && format.isInt(), kWho,
                "checkpoint: written by an earlier version of full sharding (one optimizer per "
                "parameter, saved whole); this version reads format ",
                kCheckpointFormat,
                " only: resume that run with the version that wrote it, or "
                "start from a model saved with save_full_model");
    TORCH_CHECK(format.toInt() == kCheckpointFormat, kWho, "checkpoint: format ", format.toInt(),
                ", this version reads format ", kCheckpointFormat);
  }

  /// Checks that the checkpoint holds these units (a checkpoint of another model is an error
  /// naming the first difference).
  void check_units(torch::serialize::InputArchive& common) {
    const int64_t saved = read_int(common, "num_units");
    TORCH_CHECK(saved == static_cast<int64_t>(units.size()), kWho, "checkpoint: it holds ", saved,
                " units, this model has ", units.size(), " (a checkpoint of another model?)");
    for (size_t u = 0; u < units.size(); ++u) {
      torch::serialize::InputArchive archive;
      TORCH_CHECK(common.try_read("unit_" + std::to_string(u), archive), kWho,
                  "checkpoint: no entry for unit ", u);
      c10::IValue name;
      TORCH_CHECK(archive.try_read("name", name) && name.isString(), kWho, "checkpoint: unit ", u,
                  " has no name");
      TORCH_CHECK(name.toStringRef() == units[u]->name, kWho, "checkpoint: unit ", u, " is named '",
                  name.toStringRef(), "' there and '", units[u]->name,
                  "' here (a checkpoint of another model?)");
      detail::check_param_shapes(archive, shapes_of(*units[u]),
                                 std::string(kWho) + "checkpoint: unit " + std::to_string(u) +
                                     " ('" + units[u]->name + "')");
    }
  }

  /// This rank's rows of parameter (u, i), from the chunks the ranks of the saving job wrote.
  at::Tensor read_rows(size_t u, size_t i, int64_t saved_world, PieceReader& pieces) {
    const auto& slot = unit(u).params[i];
    const int64_t valid = slot.valid_rows(rank);
    auto rows = at::empty({valid, slot.row_numel}, unit(u).options);
    const int64_t first = rank * slot.chunk_rows;
    const int64_t saved_chunk = (slot.rows + saved_world - 1) / saved_world;
    for (int64_t s = 0; s < saved_world; ++s) {
      const int64_t begin = s * saved_chunk;
      const int64_t end = std::min(slot.rows, begin + saved_chunk);
      const int64_t low = std::max(begin, first);
      const int64_t high = std::min(end, first + valid);
      if (low >= high) continue;
      const auto key = param_key(u, i) + "/rows_" + std::to_string(s);
      auto piece = pieces.read(key);
      at::Tensor saved;
      TORCH_CHECK(piece.try_read("rows", saved, /*is_buffer=*/true) &&
                      saved.numel() == (end - begin) * slot.row_numel,
                  kWho, "checkpoint: piece ", key, " is damaged");
      rows.narrow(0, low - first, high - low)
          .copy_(saved.reshape({end - begin, slot.row_numel}).narrow(0, low - begin, high - low));
    }
    return rows.view(slot.shard_sizes(rank));
  }

  std::function<void()> prepare_load(torch::serialize::InputArchive& common, PieceReader& pieces) {
    check_checkpointable();
    wait_all();
    check_format(common);
    check_units(common);
    const int64_t saved_world = read_int(common, "world");
    const int64_t saved_passes = read_int(common, "backward_passes");
    const int64_t saved_steps = read_int(common, "steps_taken");
    const int64_t saved_since = read_int(common, "passes_since_step");
    std::vector<std::pair<at::Tensor, at::Tensor>> shards;  // (this rank's shard, its rows)
    std::vector<std::function<void()>> installs;
    std::vector<std::pair<ParamSlot*, at::Tensor>> accumulated;  // mid-accumulation gradients
    for (size_t u = 0; u < units.size(); ++u) {
      for (size_t i = 0; i < unit(u).params.size(); ++i) {
        auto& slot = unit(u).params[i];
        shards.emplace_back(slot.shard, read_rows(u, i, saved_world, pieces));
        const auto key = param_key(u, i) + "/accumulated";
        if (saved_since > 0 && slot.owner == rank && pieces.contains(key)) {
          auto piece = pieces.read(key);
          at::Tensor gradient;
          TORCH_CHECK(piece.try_read("gradient", gradient, /*is_buffer=*/true) &&
                          gradient.sizes() == at::IntArrayRef(slot.sizes),
                      kWho, "checkpoint: piece ", key, " is damaged");
          accumulated.emplace_back(&slot, gradient.to(unit(u).options));
        }
      }
    }
    if (rank_optimizer) installs.push_back(rank_optimizer->prepare_load(pieces, param_name()));
    auto install_groups = prepare_groups(common);
    std::weak_ptr<State> weak = shared_from_this();
    return [weak, shards, installs, saved_passes, saved_steps, saved_since, accumulated,
            install_groups] {
      at::NoGradGuard no_grad;
      for (const auto& [shard, rows] : shards) shard.copy_(rows);
      for (const auto& install : installs) install();
      if (auto self = weak.lock()) {
        self->passes = saved_passes;
        self->steps = saved_steps;
        self->passes_since_step = saved_since;
        for (auto& unit : self->units) {
          for (auto& slot : unit->params) slot.reduced = at::Tensor();
        }
        for (const auto& [slot, gradient] : accumulated) slot->reduced = gradient;
      }
      install_groups();
    };
  }

  /// (unit, index in the unit) of `param`; an error for a tensor that is no unit's parameter.
  std::pair<size_t, size_t> position_of(const at::Tensor& param) const {
    const auto it = slot_of.find(param.unsafeGetTensorImpl());
    TORCH_CHECK(it != slot_of.end(), kWho, "this tensor is no unit's parameter");
    return it->second;
  }

  ParamSlot& slot_for(const at::Tensor& param) {
    const auto [u, i] = position_of(param);
    return unit(u).params[i];
  }
};

FullyShardedDataParallel::FullyShardedDataParallel(std::vector<ShardedUnit> units,
                                                   OptimizerFactory factory,
                                                   c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                   FullyShardedOptions options)
    : state_(std::make_shared<State>()) {
  init(std::move(units), std::nullopt, std::move(factory), std::move(group), options);
}

FullyShardedDataParallel::FullyShardedDataParallel(
    std::vector<ShardedUnit> units, std::vector<torch::optim::OptimizerParamGroup> param_groups,
    OptimizerFactory factory, c10::intrusive_ptr<c10d::ProcessGroup> group,
    FullyShardedOptions options)
    : state_(std::make_shared<State>()) {
  TORCH_CHECK(options.step_mode() == ShardedStepMode::kLossless, kWho,
              "param groups need step_mode kLossless (local shards step a unit's rows with one "
              "optimizer)");
  init(std::move(units), std::move(param_groups), std::move(factory), std::move(group), options);
}

void FullyShardedDataParallel::init(
    std::vector<ShardedUnit> units,
    std::optional<std::vector<torch::optim::OptimizerParamGroup>> param_groups,
    OptimizerFactory factory, c10::intrusive_ptr<c10d::ProcessGroup> group,
    FullyShardedOptions options) {
  TORCH_CHECK(group, kWho, "the process group is null");
  TORCH_CHECK(factory, kWho, "the optimizer factory is empty");
  TORCH_CHECK(!options.offload_state_to_cpu(), kWho,
              "offload_state_to_cpu: a CPU-resident optimizer state (the state and the step on "
              "the CPU while the model trains on a GPU) is not supported yet; leave it false");
  TORCH_CHECK(options.accumulation_steps() >= 1, kWho, "accumulation_steps: got ",
              options.accumulation_steps(), ", expected at least 1");
  for (const auto& [name, dtype] : {std::pair{"param_dtype", options.param_dtype()},
                                    std::pair{"reduce_dtype", options.reduce_dtype()}}) {
    TORCH_CHECK(!dtype || at::isFloatingType(*dtype), kWho, name, ": got ", *dtype,
                ", expected a floating-point dtype");
  }
  auto& s = *state_;
  s.group = std::move(group);
  s.options = options;
  s.rank = s.group->getRank();
  s.world = s.group->getSize();
  if (options.replica_group()) s.replicas = options.replica_group()->getSize();
  s.add_units(std::move(units));
  s.make_groups(s.agree_on_units());
  s.agree_across_replicas();
  s.broadcast_values();
  if (s.lossless()) s.assign_owners();
  s.factory = std::move(factory);
  s.make_facade(*this, std::move(param_groups));
  s.make_shards_and_optimizers();
  s.write_state_entries();
  for (auto& unit : s.units) s.reshard(*unit);
  s.add_hooks();
  if (options.overlap_step()) s.worker = std::make_unique<StepWorker>();
}

FullyShardedDataParallel::~FullyShardedDataParallel() {
  try {
    state_->wait_all();
  } catch (...) {  // a failed step was the caller's to see through wait(); nothing to do here
  }
  state_->worker.reset();
  for (auto& unit : state_->units) {
    for (auto& slot : unit->params) detail::remove_grad_ready_callback(slot.param, slot.hook);
  }
}

size_t FullyShardedDataParallel::num_units() const { return state_->units.size(); }

size_t FullyShardedDataParallel::unit_index(const std::string& name) const {
  const auto it = state_->unit_by_name.find(name);
  if (it == state_->unit_by_name.end()) {
    std::ostringstream names;
    for (const auto& unit : state_->units) {
      names << (names.tellp() > 0 ? ", '" : "'") << unit->name << "'";
    }
    TORCH_CHECK(false, kWho, "no unit is named '", name, "'; the units are ", names.str());
  }
  return it->second;
}

const std::string& FullyShardedDataParallel::unit_name(size_t unit) const {
  TORCH_CHECK(unit < state_->units.size(), kWho, "unit ", unit, " does not exist (",
              state_->units.size(), " units)");
  return state_->units[unit]->name;
}

at::Tensor FullyShardedDataParallel::forward(size_t unit, const std::function<at::Tensor()>& fn) {
  unit_name(unit);  // checks the index
  return state_->forward(unit, fn);
}

void FullyShardedDataParallel::step() { state_->step_all("step()"); }

void FullyShardedDataParallel::wait() { state_->wait_all(); }

std::vector<at::Tensor> FullyShardedDataParallel::reduced_gradients() {
  return state_->reduced_gradients("reduced_gradients()");
}

void FullyShardedDataParallel::skip_step() { state_->skip_all(); }

std::vector<at::Tensor> FullyShardedDataParallel::gradients_to_unscale(const char* caller) {
  TORCH_CHECK(!state_->options.overlap_step(), caller,
              ": this FullyShardedDataParallel steps each unit during backward (overlap_step, the "
              "default), before every gradient is known to be finite, so the scaler cannot skip "
              "a step; construct it with FullyShardedOptions().overlap_step(false)");
  return reduced_gradients();
}

void FullyShardedDataParallel::unscaled_step() {
  if (!state_->options.overlap_step()) step();  // with overlap it ran in backward
}

double FullyShardedDataParallel::clip_grad_norm_(double max_norm, double norm_type) {
  std::vector<at::Tensor> all;
  for (const auto& unit : state_->units) {
    for (const auto& slot : unit->params) all.push_back(slot.param);
  }
  return clip_grad_norm_of(all, max_norm, norm_type, "clip_grad_norm_");
}

double FullyShardedDataParallel::clip_grad_norm_of(const std::vector<at::Tensor>& params,
                                                   double max_norm, double norm_type,
                                                   const char* function) {
  auto& s = *state_;
  s.reduced_gradients(function);  // for its check: an error with overlap_step
  TORCH_CHECK(s.lossless(), kWho, function,
              ": needs step_mode kLossless (local shards hold row chunks, whose norms do not add "
              "up to a whole parameter's bit for bit)");
  std::vector<detail::SpreadGradient> spread;
  for (const auto& p : params) {
    const auto [u, i] = s.position_of(p);
    const auto& slot = s.unit(u).params[i];
    // The owner holds the parameter's whole averaged gradient; nobody else holds any of it.
    spread.push_back({slot.reduced, slot.reduced, s.unit(u).options});
  }
  const auto who = std::string(kWho) + function;
  return detail::clip_spread_grad_norm_(*s.group, spread, max_norm, norm_type, who.c_str());
}

void FullyShardedDataParallel::gather_all() {
  auto& s = *state_;
  s.wait_all();
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  for (auto& unit : s.units) s.gather(*unit, *s.group);
  s.holding = true;
}

void FullyShardedDataParallel::release_all() {
  auto& s = *state_;
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  for (auto& unit : s.units) s.reshard(*unit);
  s.holding = false;
}

torch::optim::Optimizer* FullyShardedDataParallel::optimizer_of(const at::Tensor& param) {
  auto& s = *state_;
  const auto [u, i] = s.position_of(param);
  if (!s.lossless()) return s.unit(u).optimizer.get();
  const bool stepped_here =
      s.unit(u).params[i].owner == s.rank && s.group_of.count(State::impl_of(param)) != 0;
  return stepped_here ? s.rank_optimizer->get() : nullptr;
}

std::vector<torch::optim::Optimizer*> FullyShardedDataParallel::optimizers() {
  std::vector<torch::optim::Optimizer*> out;
  if (state_->rank_optimizer && state_->rank_optimizer->get() != nullptr) {
    out.push_back(state_->rank_optimizer->get());
  }
  for (auto& unit : state_->units) {
    if (unit->optimizer) out.push_back(unit->optimizer.get());
  }
  return out;
}

int FullyShardedDataParallel::owner_of(const at::Tensor& param) const {
  return state_->lossless() ? state_->slot_for(param).owner : -1;
}

at::Tensor FullyShardedDataParallel::shard_of(const at::Tensor& param) const {
  return state_->slot_for(param).shard;
}

at::Tensor FullyShardedDataParallel::full_value(const at::Tensor& param) {
  auto& s = *state_;
  s.wait_all();
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  const auto& slot = s.slot_for(param);
  // The shards' own values (not a lower-precision compute copy), padded to whole chunks.
  auto input = at::empty({slot.chunk_numel()}, slot.shard.options().requires_grad(false));
  State::write_shard(input, slot);
  auto gathered = at::empty({s.world * slot.chunk_numel()}, input.options());
  wait_one(s.group->_allgather_base(gathered, input), "full_value's all-gather", s.rank);
  return gathered.narrow(0, 0, slot.numel()).view(slot.sizes).clone();
}

std::optional<at::ScalarType> FullyShardedDataParallel::param_dtype() const {
  return state_->options.param_dtype();
}

const FullyShardedOptions& FullyShardedDataParallel::options() const { return state_->options; }

int64_t FullyShardedDataParallel::backward_passes() const { return state_->passes; }
int64_t FullyShardedDataParallel::steps_taken() const { return state_->steps; }

int64_t FullyShardedDataParallel::shard_bytes() const {
  int64_t bytes = 0;
  for (const auto& unit : state_->units) {
    for (const auto& slot : unit->params) bytes += static_cast<int64_t>(slot.shard.nbytes());
  }
  return bytes;
}

int64_t FullyShardedDataParallel::gradient_bytes() const {
  int64_t bytes = 0;
  for (const auto& unit : state_->units) {
    for (const auto& slot : unit->params) {
      if (slot.reduced.defined()) bytes += static_cast<int64_t>(slot.reduced.nbytes());
    }
  }
  return bytes;
}

int64_t FullyShardedDataParallel::gathered_bytes() const {
  int64_t bytes = 0;
  for (const auto& unit : state_->units) {
    for (const auto& slot : unit->params) {
      bytes += static_cast<int64_t>(slot.param.unsafeGetTensorImpl()->storage().nbytes());
    }
  }
  return bytes;
}

const c10::intrusive_ptr<c10d::ProcessGroup>& FullyShardedDataParallel::process_group() const {
  return state_->group;
}

c10::intrusive_ptr<c10d::ProcessGroup> FullyShardedDataParallel::checkpoint_group() const {
  return state_->group;
}

int FullyShardedDataParallel::checkpoint_replicas() const { return state_->replicas; }

int FullyShardedDataParallel::checkpoint_replica() const {
  return state_->replicas == 1 ? 0 : state_->options.replica_group()->getRank();
}

bool FullyShardedDataParallel::agree_across_replicas(bool ok) const {
  if (state_->replicas == 1) return ok;
  const auto all = detail::gather_int64(*state_->options.replica_group(), {ok ? 1 : 0});
  return std::all_of(all.begin(), all.end(), [](const auto& v) { return v[0] == 1; });
}

void FullyShardedDataParallel::sync_for_checkpoint() const {
  auto& s = *state_;
  s.wait_all();
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  s.sync_groups();
  // Options changed since the last step (a scheduler's step() before the save) go into the
  // parameters' optimizers now, as they would at the next step: the checkpoint then holds the
  // options the next step uses, in both places.
  s.push_group_options();
}

void FullyShardedDataParallel::save_common(torch::serialize::OutputArchive& common) const {
  state_->save_common(common);
}

void FullyShardedDataParallel::save_pieces(PieceWriter& pieces) const {
  state_->save_pieces(pieces);
}

std::function<void()> FullyShardedDataParallel::prepare_load(torch::serialize::InputArchive& common,
                                                             PieceReader& pieces) {
  return state_->prepare_load(common, pieces);
}

torch::optim::Optimizer& FullyShardedDataParallel::optimizer() { return *state_->facade; }

FullyShardedOptimizer::FullyShardedOptimizer(
    FullyShardedDataParallel& owner, std::vector<torch::optim::OptimizerParamGroup> groups,
    std::unique_ptr<torch::optim::OptimizerOptions> defaults)
    : torch::optim::Optimizer(std::move(groups), std::move(defaults)), owner_(owner) {}

ScaledStepping& FullyShardedOptimizer::scaling_target() { return owner_; }

torch::Tensor FullyShardedOptimizer::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure) {
    c10::AutoGradMode enable_grad(true);
    loss = closure();  // its backward steps the units, with overlap_step
  }
  auto& s = *owner_.state_;
  if (!s.options.overlap_step()) s.step_all("optimizer().step()");
  return loss;
}

void FullyShardedOptimizer::add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
  auto& s = *owner_.state_;
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  s.sync_groups();  // groups appended through the base class before this one
  const size_t before = param_groups_.size();
  torch::optim::Optimizer::add_param_group(param_group);
  try {
    s.sync_groups();
  } catch (...) {  // checked on every rank before anything was registered
    if (s.group_sizes.size() > before && s.group_sizes.back() == 0) {
      s.group_sizes.pop_back();
      s.pushed.pop_back();
    }
    param_groups_.erase(param_groups_.begin() + static_cast<int64_t>(before), param_groups_.end());
    throw;
  }
}

void FullyShardedOptimizer::save(torch::serialize::OutputArchive&) const {
  TORCH_CHECK(false, kWho,
              "torch::save(optimizer) cannot hold a fully sharded model's state (each rank has "
              "its rows and its parameters' optimizers); save with "
              "shampoo::save_distributed_checkpoint(optimizer, dir) (or "
              "save_distributed_state(fsdp, dir)), which also holds the parameters");
}

void FullyShardedOptimizer::load(torch::serialize::InputArchive&) {
  TORCH_CHECK(false, kWho,
              "torch::load(optimizer) cannot restore a fully sharded model; load with "
              "shampoo::load_distributed_checkpoint(optimizer, dir) (or "
              "load_distributed_state(fsdp, dir))");
}

std::string FullyShardedOptimizer::checkpoint_kind() const { return owner_.checkpoint_kind(); }

c10::intrusive_ptr<c10d::ProcessGroup> FullyShardedOptimizer::checkpoint_group() const {
  return owner_.checkpoint_group();
}

void FullyShardedOptimizer::sync_for_checkpoint() const { owner_.sync_for_checkpoint(); }

int FullyShardedOptimizer::checkpoint_replicas() const { return owner_.checkpoint_replicas(); }

int FullyShardedOptimizer::checkpoint_replica() const { return owner_.checkpoint_replica(); }

bool FullyShardedOptimizer::agree_across_replicas(bool ok) const {
  return owner_.agree_across_replicas(ok);
}

void FullyShardedOptimizer::save_common(torch::serialize::OutputArchive& common) const {
  owner_.save_common(common);
}

void FullyShardedOptimizer::save_pieces(PieceWriter& pieces) const { owner_.save_pieces(pieces); }

std::function<void()> FullyShardedOptimizer::prepare_load(torch::serialize::InputArchive& common,
                                                          PieceReader& pieces) {
  return owner_.prepare_load(common, pieces);
}

void save_full_model(FullyShardedDataParallel& fsdp, const torch::nn::Module& model,
                     const std::filesystem::path& path) {
  auto& s = *fsdp.state_;
  s.wait_all();
  std::lock_guard<std::recursive_mutex> lock(s.mutex);
  TORCH_CHECK(!s.holding, kWho, "save_full_model: call it outside gather_all() / release_all()");
  std::string error;
  for (auto& unit : s.units) {
    TORCH_CHECK(!unit->gathered, kWho, "save_full_model: unit '", unit->name,
                "' is gathered; call it between iterations");
    for (auto& slot : unit->params) s.materialize(*unit, slot, "save_full_model's all-gather");
  }
  if (s.rank == 0) {
    try {
      torch::serialize::OutputArchive archive;
      model.save(archive);
      const auto temporary = path.string() + ".tmp";
      archive.save_to(temporary);
      std::filesystem::rename(temporary, path);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  for (auto& unit : s.units) {
    for (auto& slot : unit->params) release_full(slot.param, unit->dtype);
  }
  // Every rank returns once the file is there, or with rank 0's error.
  const auto flags = detail::gather_int64(*s.group, {error.empty() ? 0 : 1});
  TORCH_CHECK(error.empty(), kWho, "save_full_model: writing ", path.string(), " failed: ", error);
  TORCH_CHECK(flags[0][0] == 0, kWho, "save_full_model: rank 0 failed to write ", path.string(),
              " (its error says why)");
}

std::vector<ShardedUnit> sequential_units(const torch::nn::Sequential& model) {
  std::vector<ShardedUnit> units;
  for (size_t i = 0; i < model->size(); ++i) {
    auto params = model->ptr(i)->parameters();
    if (!params.empty()) units.push_back({std::to_string(i), std::move(params)});
  }
  return units;
}

at::Tensor forward_sequential(FullyShardedDataParallel& fsdp, torch::nn::Sequential& model,
                              at::Tensor input) {
  at::Tensor x = std::move(input);
  size_t index = 0;
  for (auto& module : *model) {
    if (module.ptr()->parameters().empty()) {
      x = module.forward(x);
    } else {
      // Mixed precision: the unit computes in the gathered parameters' dtype.
      if (fsdp.param_dtype() && x.is_floating_point()) x = x.to(*fsdp.param_dtype());
      x = fsdp.forward(fsdp.unit_index(std::to_string(index)), [&] { return module.forward(x); });
    }
    ++index;
  }
  return x;
}

}  // namespace shampoo
