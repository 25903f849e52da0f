// Full sharding: construction (units checked and agreed on by the ranks, subgroups, rank 0's
// values, owners, shards, the optimizers, the gradient hooks).
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include "parallel/communication/collectives.h"
#include "parallel/communication/ownership_plan.h"
#include "parallel/data_parallel/grad_ready_hooks.h"
#include "parallel/full_sharding/fully_sharded_state.h"

namespace shampoo::detail {
namespace {

void check_param(FsdpState& s, const ShardedUnit& in, size_t u, size_t i) {
  const auto& p = in.params[i];
  const auto where = [&] {
    return std::string("parameter ") + std::to_string(i) + " of unit " + std::to_string(u) + " ('" +
           in.name + "')";
  };
  TORCH_CHECK(p.defined() && p.is_leaf() && p.requires_grad(), kFsdpWho, where(),
              " must be a leaf tensor that requires grad");
  TORCH_CHECK(p.numel() > 0, kFsdpWho, where(), " is empty (shape ", shape_text(p.sizes()), ")");
  TORCH_CHECK(p.device() == in.params[0].device() && p.dtype() == in.params[0].dtype(), kFsdpWho,
              where(), " is on ", p.device(), " with dtype ", p.dtype(), ", but parameter 0 is on ",
              in.params[0].device(), " with dtype ", in.params[0].dtype(),
              ": the parameters of a unit share one device and dtype");
  TORCH_CHECK(p.is_contiguous() && p.storage_offset() == 0 && p.storage().nbytes() == p.nbytes(),
              kFsdpWho, where(),
              " must own its storage (contiguous, not a view of a larger tensor): its storage is "
              "released while the unit is sharded");
  const auto [it, fresh] = s.slot_of.emplace(p.unsafeGetTensorImpl(), std::make_pair(u, i));
  const auto other = it->second.first;
  TORCH_CHECK(fresh, kFsdpWho, where(), " is also parameter ", it->second.second, " of unit ",
              other, " ('", other == u ? in.name : s.units.at(other)->name,
              "'); a parameter belongs to one unit, once. A parameter that two modules share (an "
              "embedding tied to the output projection) goes into one unit whose forward runs for "
              "each of them: fsdp.forward(unit, ...) for the embedding and again for the "
              "projection (docs/full_sharding.md, \"Tied weights\")");
}

void add_units(FsdpState& s, std::vector<ShardedUnit> given) {
  for (size_t u = 0; u < given.size(); ++u) {
    auto& in = given[u];
    TORCH_CHECK(!in.params.empty(), kFsdpWho, "unit ", u, " ('", in.name, "') has no parameters");
    TORCH_CHECK(s.unit_by_name.emplace(in.name, u).second, kFsdpWho, "two units are named '",
                in.name, "'; unit names must be unique");
    auto made = std::make_unique<FsdpUnit>();
    made->name = in.name;
    made->mesh = &s.mesh;
    made->options = in.params[0].options();
    made->dtype = in.params[0].scalar_type();
    made->compute_dtype = s.options.param_dtype().value_or(made->dtype);
    made->reduce_dtype = s.options.reduce_dtype().value_or(made->compute_dtype);
    for (size_t i = 0; i < in.params.size(); ++i) {
      check_param(s, in, u, i);
      ParamSlot slot;
      slot.param = in.params[i];
      slot.sizes = in.params[i].sizes().vec();
      slot.rows = slot.sizes.empty() ? 1 : slot.sizes[0];
      slot.row_numel = slot.rows == 0 ? 0 : in.params[i].numel() / slot.rows;
      slot.chunk_rows = (slot.rows + s.mesh.world - 1) / s.mesh.world;
      slot.offset = made->shard_numel;
      made->shard_numel += slot.chunk_numel();
      made->params.push_back(std::move(slot));
    }
    s.units.push_back(std::move(made));
  }
}

/// The ranks agree on the units (count, then each unit's shapes, dtype and device) before any
/// other collective, and draw the tag of this object's subgroups.
int64_t agree_on_units(FsdpState& s) {
  // Drawn at world 1 too when there is a store: over CUDA the worker gets a subgroup there.
  auto& group = *s.mesh.group;
  const auto& store = group.getStore();
  const int64_t ticket = s.mesh.rank == 0 && store ? store->add("shampoo_fsdp_ticket", 1) : 0;
  const auto counts = gather_int64(group, {ticket, static_cast<int64_t>(s.units.size())});
  for (int r = 0; r < s.mesh.world; ++r) {
    TORCH_CHECK(counts[r][1] == counts[0][1], kFsdpWho,
                "the units differ across ranks: rank 0 has ", counts[0][1], " units, rank ", r,
                " has ", counts[r][1]);
  }
  std::vector<int64_t> prints;
  for (const auto& unit : s.units) prints.push_back(unit->fingerprint());
  const auto all = gather_int64(group, prints);
  for (int r = 0; r < s.mesh.world; ++r) {
    for (size_t u = 0; u < s.units.size(); ++u) {
      TORCH_CHECK(all[r][u] == all[0][u], kFsdpWho, "the units differ across ranks: unit ", u,
                  " ('", s.units[u]->name,
                  "') has other parameter shapes, dtype or device on rank ", r,
                  " than on rank 0; here it holds ", s.units[u]->describe());
    }
  }
  return counts[0][0];
}

/// Hybrid: the replicas agree on the units as the shard group's ranks do (one small AllGather
/// over the replica group).
void agree_across_replicas(FsdpState& s) {
  if (s.mesh.replicas == 1) return;
  auto& replica_group = *s.mesh.replica_group;
  // The counts first, so that the fingerprints' AllGather has one length on every rank.
  auto differs = first_differing_rank(
      gather_int64(replica_group, {static_cast<int64_t>(s.units.size()), s.mesh.world}));
  if (!differs) {
    std::vector<int64_t> prints;
    for (const auto& unit : s.units) prints.push_back(unit->fingerprint());
    differs = first_differing_rank(gather_int64(replica_group, prints));
  }
  TORCH_CHECK(!differs.has_value(), kFsdpWho, "hybrid sharding: replica ", differs.value_or(0),
              " has other units or another shard group size than replica 0; every shard group "
              "must shard the same model over as many ranks");
}

/// Rank 0's values everywhere: within the shard group, then (hybrid) across the replicas.
void broadcast_values(FsdpState& s) {
  if (!s.options.broadcast_parameters()) return;
  for (auto& unit : s.units) {
    std::vector<at::Tensor> params;
    for (const auto& slot : unit->params) params.push_back(slot.param);
    const auto what = "the broadcast of unit '" + unit->name + "'";
    if (s.mesh.world > 1) broadcast_from_rank_zero(*s.mesh.group, params, kFsdpWho, what);
    if (s.mesh.replicas > 1) {
      broadcast_from_rank_zero(*s.mesh.replica_group, params, kFsdpWho, what + " across replicas");
    }
  }
}

/// Lossless owners: whole parameters, the greedy balance by bytes of Shampoo's blocks.
void assign_owners(FsdpState& s) {
  std::vector<int64_t> costs;
  for (const auto& unit : s.units) {
    for (const auto& slot : unit->params) {
      costs.push_back(block_cost(slot.numel(), slot.param.element_size()));
    }
  }
  // Split across replicas: one plan over every rank of both groups; bin b is shard rank
  // b % world of replica b / world.
  const int world = s.mesh.world;
  OwnershipPlan plan(s.mesh.split ? world * s.mesh.replicas : world);
  plan.add(costs);
  int64_t k = 0;
  for (auto& unit : s.units) {
    for (auto& slot : unit->params) {
      const int bin = plan.owner_of(k++);
      slot.owner = bin % world;
      slot.replica_owner = s.mesh.split ? bin / world : -1;
    }
  }
}

/// Each rank's row chunks, and the optimizers: lossless, one per rank over the parameters it
/// owns in optimizer()'s groups (a parameter's state does not depend on the world size, so
/// checkpoints move between sizes); local shards, one per unit over this rank's rows.
void make_shards_and_optimizers(FsdpState& s) {
  at::NoGradGuard no_grad;
  const int rank = s.mesh.rank;
  for (auto& unit : s.units) {
    std::vector<at::Tensor> stepped;
    for (auto& slot : unit->params) {
      const int64_t valid = slot.valid_rows(rank);
      slot.shard = slot.param.detach()
                       .reshape({slot.rows, slot.row_numel})
                       .narrow(0, slot.first_row(rank), valid)
                       .clone()
                       .view(slot.shard_sizes(rank));
      if (!s.lossless() && valid > 0) {
        slot.shard.set_requires_grad(true);
        stepped.push_back(slot.shard);
      }
    }
    if (!stepped.empty()) {
      unit->optimizer = std::make_unique<LocalOptimizer>(s.factory, kFsdpWho);
      unit->optimizer->make(torch::optim::OptimizerParamGroup(stepped));
    }
  }
  if (!s.lossless()) return;
  s.rank_optimizer = std::make_unique<LocalOptimizer>(s.factory, kFsdpWho);
  const auto& groups = s.groups.optimizer().param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<at::Tensor> owned;  // in the group's order
    for (const auto& p : groups[g].params()) {
      if (s.slot_for(p).steps_on(s.mesh)) owned.push_back(p);
    }
    s.rank_optimizer->add(g, owned, s.groups.options_of());
  }
  // A rank that owns no parameter (more ranks than parameters to spread) holds one too.
  s.rank_optimizer->make_empty(groups.size(), s.groups.options_of());
}

void add_hooks(FsdpState& s) {
  std::weak_ptr<FsdpState> weak = s.shared_from_this();
  for (size_t u = 0; u < s.units.size(); ++u) {
    for (size_t i = 0; i < s.units[u]->params.size(); ++i) {
      auto& slot = s.units[u]->params[i];
      slot.hook = add_grad_ready_callback(slot.param, [weak, u, i](const at::Tensor&) {
        if (auto self = weak.lock()) self->on_grad_ready(u, i);
      });
    }
  }
}

}  // namespace

void FsdpState::setup(FullyShardedDataParallel& owner, std::vector<ShardedUnit> given,
                      std::optional<std::vector<torch::optim::OptimizerParamGroup>> param_groups) {
  add_units(*this, std::move(given));
  mesh.make_groups(agree_on_units(*this), options.overlap_step());
  agree_across_replicas(*this);
  mesh.make_replica_step_group(options.overlap_step());
  broadcast_values(*this);
  if (lossless()) assign_owners(*this);
  groups.make(owner, std::move(param_groups));
  make_shards_and_optimizers(*this);
  groups.write_state_entries();
  for (auto& unit : units) unit->reshard();
  add_hooks(*this);
  if (options.overlap_step()) worker = std::make_unique<StepWorker>();
}

std::pair<size_t, size_t> FsdpState::position_of(const at::Tensor& param) const {
  const auto it = slot_of.find(param.unsafeGetTensorImpl());
  TORCH_CHECK(it != slot_of.end(), kFsdpWho, "this tensor is no unit's parameter");
  return it->second;
}

ParamSlot& FsdpState::slot_for(const at::Tensor& param) {
  const auto [u, i] = position_of(param);
  return unit(u).params[i];
}

}  // namespace shampoo::detail
