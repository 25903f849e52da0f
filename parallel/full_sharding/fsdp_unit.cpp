// Full sharding: a unit's rows (each rank's chunk of every parameter) gathered into the full
// parameters and released, collected on the owners and scattered back, and its gradients
// reduced to what each rank steps.
#include "parallel/full_sharding/fsdp_unit.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/accumulate.h>

#include <cmath>
#include <sstream>

#include "parallel/communication/collectives.h"

namespace shampoo::detail {
namespace {

/// Where each rank's part starts in a buffer of consecutive parts of sizes `split`.
std::vector<int64_t> starts_of(const std::vector<int64_t>& split) {
  std::vector<int64_t> starts(split.size(), 0);
  for (size_t o = 1; o < split.size(); ++o) starts[o] = starts[o - 1] + split[o - 1];
  return starts;
}

/// Whether every element is finite: one read pass (aminmax propagates NaN, and an infinity is its
/// min or max; isfinite(...).all() took 30x as long on 15M floats).
bool all_finite(const at::Tensor& t) {
  if (t.numel() == 0) return true;
  const auto [low, high] = at::aminmax(t);
  return std::isfinite(low.item<double>()) && std::isfinite(high.item<double>());
}

}  // namespace

void FsdpUnit::gather(c10d::ProcessGroup& via) {
  if (gathered) return;
  at::NoGradGuard no_grad;
  const auto compute = options.dtype(compute_dtype);
  const int world = mesh->world;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<at::Tensor> inputs;
  std::vector<at::Tensor> padded(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    auto& slot = params[i];
    allocate_full(slot.param, slot.sizes, compute_dtype);
    auto input = slot.shard.reshape({-1}).to(compute_dtype);
    if (input.numel() < slot.chunk_numel()) {
      input = at::empty({slot.chunk_numel()}, compute);
      slot.write_shard(input);
    }
    at::Tensor output = slot.param.variable_data().view({-1});
    if (slot.rows % world != 0) {
      padded[i] = at::empty({world * slot.chunk_numel()}, compute);
      output = padded[i];
    }
    inputs.push_back(input);
    works.push_back(start_all_gather(via, output, inputs.back()));
  }
  wait_all_of(works, "the all-gather of unit '" + name + "'", mesh->rank);
  for (size_t i = 0; i < params.size(); ++i) {
    if (!padded[i].defined()) continue;
    const auto& slot = params[i];
    slot.param.variable_data().view({-1}).copy_(padded[i].narrow(0, 0, slot.numel()));
  }
  gathered = true;
}

void FsdpUnit::reshard() {
  if (!gathered) return;
  release_storage();
  gathered = false;
}

void FsdpUnit::release_storage() {
  for (auto& slot : params) release_full(slot.param, dtype);
}

void FsdpUnit::materialize(ParamSlot& slot, const std::string& what) {
  at::NoGradGuard no_grad;
  allocate_full(slot.param, slot.sizes, dtype);
  auto input = at::empty({slot.chunk_numel()}, options);
  slot.write_shard(input);
  auto all = at::empty({mesh->world * slot.chunk_numel()}, options);
  wait_one(start_all_gather(*mesh->group, all, input), what, mesh->rank);
  slot.param.variable_data().view({-1}).copy_(all.narrow(0, 0, slot.numel()));
}

std::vector<int64_t> FsdpUnit::chunks_by_owner() const {
  std::vector<int64_t> split(mesh->world, 0);
  for (const auto& slot : params) split[slot.owner] += slot.chunk_numel();
  return split;
}

void FsdpUnit::collect_rows(c10d::ProcessGroup& via) {
  const int rank = mesh->rank;
  auto send_split = chunks_by_owner();
  const int64_t owned_chunks = send_split[rank];
  auto send = at::empty({c10::sum_integers(send_split)}, options);
  auto offset = starts_of(send_split);
  for (const auto& slot : params) {
    slot.write_shard(send.narrow(0, offset[slot.owner], slot.chunk_numel()));
    offset[slot.owner] += slot.chunk_numel();
  }
  auto received = at::empty({mesh->world, owned_chunks}, options);
  auto flat = received.view({-1});
  std::vector<int64_t> receive_split(mesh->world, owned_chunks);
  wait_one(start_all_to_all(via, flat, send, receive_split, send_split),
           "collecting the rows of unit '" + name + "' for its step", rank);
  int64_t column = 0;
  for (auto& slot : params) {
    if (slot.owner != rank) continue;
    allocate_full(slot.param, slot.sizes, dtype);
    slot.read_chunks(received, column, slot.param.variable_data());
    column += slot.chunk_numel();
  }
}

void FsdpUnit::scatter_rows(c10d::ProcessGroup& via) {
  const int rank = mesh->rank;
  auto receive_split = chunks_by_owner();
  const int64_t sent_per_rank = receive_split[rank];
  auto send = at::empty({mesh->world, sent_per_rank}, options);
  int64_t column = 0;
  for (const auto& slot : params) {
    if (slot.owner != rank) continue;
    slot.write_chunks(send, slot.param, column);
    column += slot.chunk_numel();
  }
  auto received = at::empty({c10::sum_integers(receive_split)}, options);
  std::vector<int64_t> send_split(mesh->world, sent_per_rank);
  auto flat = send.view({-1});
  wait_one(start_all_to_all(via, received, flat, receive_split, send_split),
           "sending the stepped rows of unit '" + name + "'", rank);
  auto source_offset = starts_of(receive_split);
  for (auto& slot : params) {
    const int64_t n = slot.valid_rows(rank) * slot.row_numel;
    if (n > 0) slot.shard.view({-1}).copy_(received.narrow(0, source_offset[slot.owner], n));
    source_offset[slot.owner] += slot.chunk_numel();
  }
}

void FsdpUnit::broadcast_stepped(const c10::intrusive_ptr<c10d::ProcessGroup>& replicas_via) {
  if (!mesh->split) return;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (auto& slot : params) {
    if (slot.owner != mesh->rank || !slot.in_a_group()) continue;
    std::vector<at::Tensor> one{slot.param.variable_data()};
    works.push_back(start_broadcast(*replicas_via, one, slot.replica_owner));
  }
  wait_all_of(works, "sending the stepped parameters of unit '" + name + "' to the other replicas",
              mesh->rank);
}

/// Each whole gradient is summed into its owner's copy in place (a c10d reduce, as gradient
/// sharding does) and divided by the world size there: an all-reduce's average, with no buffer
/// beyond the gradients themselves. The other ranks release theirs.
void FsdpUnit::reduce_to_owners(std::vector<at::Tensor> grads) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (size_t i = 0; i < grads.size() && mesh->world > 1; ++i) {
    std::vector<at::Tensor> one{grads[i]};
    works.push_back(start_reduce(*mesh->reduce_group, one, params[i].owner));
  }
  wait_all_of(works, "the gradient reduction of unit '" + name + "'", mesh->rank);
  std::vector<at::Tensor> owned;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (params[i].owner == mesh->rank) owned.push_back(grads[i]);
  }
  reduce_across_replicas(owned);
  for (size_t i = 0; i < grads.size(); ++i) {
    // Split across replicas: the sum reached the stepping replica only.
    if (params[i].steps_on(*mesh)) {
      params[i].accumulate(grads[i].to(dtype).div_(mesh->world * mesh->replicas));
    }
    grads[i] = at::Tensor();
  }
}

void FsdpUnit::reduce_to_rows(std::vector<at::Tensor> grads) {
  const auto reduce = options.dtype(reduce_dtype);
  auto send = at::empty({mesh->world, shard_numel}, reduce);
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].write_chunks(send, grads[i]);
    grads[i] = at::Tensor();
  }
  auto received = at::empty({shard_numel}, reduce);
  auto flat = send.view({-1});
  wait_one(start_reduce_scatter(*mesh->reduce_group, received, flat),
           "the gradient reduce-scatter of unit '" + name + "'", mesh->rank);
  send = at::Tensor();
  reduce_across_replicas({received});
  for (auto& slot : params) {
    const int64_t n = slot.valid_rows(mesh->rank) * slot.row_numel;
    if (n > 0) {
      slot.accumulate(received.narrow(0, slot.offset, n)
                          .to(dtype)
                          .div(mesh->world * mesh->replicas)
                          .view(slot.shard_sizes(mesh->rank)));
    }
  }
}

/// In place: the ranks there hold the same shards. Nothing without replicas.
void FsdpUnit::reduce_across_replicas(const std::vector<at::Tensor>& sums) {
  if (mesh->replicas == 1) return;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<const ParamSlot*> owned;  // split: the slots of `sums`, for their replica
  for (const auto& slot : params) {
    if (slot.owner == mesh->rank) owned.push_back(&slot);
  }
  for (size_t k = 0; k < sums.size(); ++k) {
    std::vector<at::Tensor> one{sums[k]};
    if (mesh->split) {  // to the replica that steps it
      works.push_back(start_reduce(*mesh->replica_group, one, owned.at(k)->replica_owner));
    } else {
      works.push_back(start_all_reduce(*mesh->replica_group, one));
    }
  }
  wait_all_of(works, "the gradient all-reduce across replicas of unit '" + name + "'", mesh->rank);
}

void FsdpUnit::drop_step(bool lossless) {
  for (auto& slot : params) {
    slot.reduced = at::Tensor();
    if (lossless) release_full(slot.param, dtype);  // kept from backward, if it was
  }
  owned_kept = false;
  to_step = false;
}

void FsdpUnit::wait() {
  auto waited = std::exchange(pending, {});
  waited.get();
}

std::string FsdpUnit::non_finite_gradient() const {
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& slot = params[i];
    if (slot.reduced.defined() && !all_finite(slot.reduced)) {
      return "the averaged gradient of parameter " + std::to_string(i) + " of unit '" + name +
             "' (shape " + shape_text(slot.sizes) +
             ") holds inf or NaN (a rank's gradient did, or the average overflowed)";
    }
  }
  return "";
}

int64_t FsdpUnit::fingerprint() const {
  Fingerprint print;  // the numbers that describe the unit
  print.add(static_cast<int64_t>(params.size()))
      .add(static_cast<int64_t>(c10::typeMetaToScalarType(options.dtype())))
      .add(static_cast<int64_t>(options.device().type()));
  for (const auto& slot : params) print.add_list(slot.sizes);
  return print.value();
}

std::string FsdpUnit::describe() const {
  std::ostringstream out;
  for (size_t i = 0; i < params.size(); ++i) out << (i ? ", " : "") << shape_text(params[i].sizes);
  out << " (" << options.dtype() << ", " << options.device() << ")";
  return out.str();
}

std::vector<at::Tensor> FsdpUnit::shapes() const {
  std::vector<at::Tensor> out;  // meta tensors: the shapes without the (released) values
  for (const auto& slot : params) {
    out.push_back(at::empty(slot.sizes, at::TensorOptions().device(at::kMeta)));
  }
  return out;
}

}  // namespace shampoo::detail
