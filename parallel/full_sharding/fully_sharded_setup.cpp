// Full sharding: construction (units checked and agreed on by the ranks, subgroups, rank 0's
// values, owners, shards, the optimizers, the gradient hooks).
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <sstream>

#include "parallel/communication/collectives.h"
#include "parallel/communication/ownership_plan.h"
#include "parallel/communication/process_group.h"
#include "parallel/data_parallel/grad_ready_hooks.h"
#include "parallel/full_sharding/fully_sharded_state.h"

namespace shampoo {

void FullyShardedDataParallel::State::add_units(std::vector<ShardedUnit> given) {
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

void FullyShardedDataParallel::State::check_param(const ShardedUnit& in, size_t u, size_t i) {
  const auto& p = in.params[i];
  const auto where = [&] {
    return std::string("parameter ") + std::to_string(i) + " of unit " + std::to_string(u) + " ('" +
           in.name + "')";
  };
  TORCH_CHECK(p.defined() && p.is_leaf() && p.requires_grad(), kWho, where(),
              " must be a leaf tensor that requires grad");
  TORCH_CHECK(p.numel() > 0, kWho, where(), " is empty (shape ", detail::shape_text(p.sizes()),
              ")");
  TORCH_CHECK(p.device() == in.params[0].device() && p.dtype() == in.params[0].dtype(), kWho,
              where(), " is on ", p.device(), " with dtype ", p.dtype(), ", but parameter 0 is on ",
              in.params[0].device(), " with dtype ", in.params[0].dtype(),
              ": the parameters of a unit share one device and dtype");
  TORCH_CHECK(p.is_contiguous() && p.storage_offset() == 0 && p.storage().nbytes() == p.nbytes(),
              kWho, where(),
              " must own its storage (contiguous, not a view of a larger tensor): its storage is "
              "released while the unit is sharded");
  const auto [it, fresh] = slot_of.emplace(p.unsafeGetTensorImpl(), std::make_pair(u, i));
  const auto other = it->second.first;
  TORCH_CHECK(fresh, kWho, where(), " is also parameter ", it->second.second, " of unit ", other,
              " ('", other == u ? in.name : units.at(other)->name,
              "'); a parameter belongs to one unit, once. A parameter that two modules share (an "
              "embedding tied to the output projection) goes into one unit whose forward runs for "
              "each of them: fsdp.forward(unit, ...) for the embedding and again for the "
              "projection (docs/full_sharding.md, \"Tied weights\")");
}

/// The ranks agree on the units (count, then each unit's shapes, dtype and device) before any
/// other collective, and draw the tag of this object's subgroups.
int64_t FullyShardedDataParallel::State::agree_on_units() {
  // Drawn at world 1 too when there is a store: over CUDA the worker gets a subgroup there.
  const auto& store = group->getStore();
  const int64_t ticket = rank == 0 && store ? store->add("shampoo_fsdp_ticket", 1) : 0;
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
void FullyShardedDataParallel::State::agree_across_replicas() {
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

int64_t FullyShardedDataParallel::State::fingerprint(const Unit& unit) {
  detail::Fingerprint print;  // the numbers that describe the unit
  print.add(static_cast<int64_t>(unit.params.size()))
      .add(static_cast<int64_t>(c10::typeMetaToScalarType(unit.options.dtype())))
      .add(static_cast<int64_t>(unit.options.device().type()));
  for (const auto& slot : unit.params) print.add_list(slot.sizes);
  return print.value();
}

std::string FullyShardedDataParallel::State::describe(const Unit& unit) {
  std::ostringstream out;
  for (size_t i = 0; i < unit.params.size(); ++i) {
    out << (i ? ", " : "") << detail::shape_text(unit.params[i].sizes);
  }
  out << " (" << unit.options.dtype() << ", " << unit.options.device() << ")";
  return out.str();
}

void FullyShardedDataParallel::State::make_groups(int64_t tag) {
  reduce_group = group;
  step_group = group;
  const auto timeout = detail::group_timeout(*group);
  const auto name = "fsdp_" + std::to_string(tag);
  if (world == 1) {
    // An NCCL communicator must not be used by two threads at once (NCCL's thread-safety
    // rule), and with overlap_step the worker's all-to-alls run while backward gathers on the
    // autograd thread: over CUDA the worker gets a communicator of its own at world 1 too (seen
    // on an H200 without it: "unhandled system error" on the gathers, 2 runs in 24).
    if (options.overlap_step() && detail::has_cuda_backend(*group) && group->getStore()) {
      step_group = detail::make_subgroup(group, 0, 1, name + "_step", timeout);
    }
    return;
  }
  reduce_group = detail::make_subgroup(group, 0, world, name + "_reduce", timeout);
  if (options.overlap_step()) {
    step_group = detail::make_subgroup(group, 0, world, name + "_step", timeout);
  }
}

/// Hybrid with overlap: the worker's own group over the replica group's ranks, for its agreements
/// (and, split, broadcasts) across replicas while the main thread reduces across them, named by
/// a tag drawn over the replica group (its members come from different shard groups).
void FullyShardedDataParallel::State::make_replica_step_group() {
  replica_step_group = options.replica_group();
  if (replicas == 1 || !options.overlap_step()) return;
  auto& replica_group = options.replica_group();
  const int64_t ticket =
      replica == 0 ? replica_group->getStore()->add("shampoo_fsdp_replica_ticket", 1) : 0;
  const auto tag = detail::gather_int64(*replica_group, {ticket})[0][0];
  replica_step_group =
      detail::make_subgroup(replica_group, 0, replicas, "fsdp_replica_step_" + std::to_string(tag),
                            detail::group_timeout(*replica_group));
}

/// Rank 0's values everywhere: within the shard group, then (hybrid) across the replicas.
void FullyShardedDataParallel::State::broadcast_values() {
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
void FullyShardedDataParallel::State::assign_owners() {
  std::vector<int64_t> costs;
  for (const auto& unit : units) {
    for (const auto& slot : unit->params) {
      costs.push_back(detail::block_cost(slot.numel(), slot.param.element_size()));
    }
  }
  // Split across replicas: one plan over every rank of both groups; bin b is shard rank
  // b % world of replica b / world.
  detail::OwnershipPlan plan(split() ? world * replicas : world);
  plan.add(costs);
  int64_t k = 0;
  for (auto& unit : units) {
    for (auto& slot : unit->params) {
      const int bin = plan.owner_of(k++);
      slot.owner = bin % world;
      slot.replica_owner = split() ? bin / world : -1;
    }
  }
}

/// Each rank's row chunks, and the optimizers: lossless, one per rank over the parameters it
/// owns in optimizer()'s groups (a parameter's state does not depend on the world size, so
/// checkpoints move between sizes); local shards, one per unit over this rank's rows.
void FullyShardedDataParallel::State::make_shards_and_optimizers() {
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
    if (!stepped.empty()) {
      unit->optimizer = std::make_unique<detail::LocalOptimizer>(factory, kWho);
      unit->optimizer->make(torch::optim::OptimizerParamGroup(stepped));
    }
  }
  if (!lossless()) return;
  rank_optimizer = std::make_unique<detail::LocalOptimizer>(factory, kWho);
  const auto& groups = facade->param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<at::Tensor> owned;  // in the group's order
    for (const auto& p : groups[g].params()) {
      if (steps_here(slot_for(p))) owned.push_back(p);
    }
    rank_optimizer->add(g, owned, group_options());
  }
}

/// The options of optimizer()'s param groups, as the rank optimizer asks for them.
detail::LocalOptimizer::GroupOptions FullyShardedDataParallel::State::group_options() {
  return [this](size_t g) -> const torch::optim::OptimizerOptions& {
    return facade->param_groups().at(g).options();
  };
}

void FullyShardedDataParallel::State::add_hooks() {
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

/// (unit, index in the unit) of `param`; an error for a tensor that is no unit's parameter.
std::pair<size_t, size_t> FullyShardedDataParallel::State::position_of(
    const at::Tensor& param) const {
  const auto it = slot_of.find(param.unsafeGetTensorImpl());
  TORCH_CHECK(it != slot_of.end(), kWho, "this tensor is no unit's parameter");
  return it->second;
}

detail::ParamSlot& FullyShardedDataParallel::State::slot_for(const at::Tensor& param) {
  const auto [u, i] = position_of(param);
  return unit(u).params[i];
}

}  // namespace shampoo
