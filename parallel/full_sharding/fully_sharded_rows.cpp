// Full sharding: a unit's rows (each rank's chunk of every parameter), gathered into the full
// parameters and released, collected on owners and scattered back.
#include <ATen/core/grad_mode.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/accumulate.h>

#include <sstream>

#include "parallel/communication/collectives.h"
#include "parallel/full_sharding/fully_sharded_state.h"

namespace shampoo::detail {

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
  wait_collectives(works, kFsdpWho, what, rank);
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

}  // namespace shampoo::detail

namespace shampoo {

/// All-gathers the unit's chunks over `via` into the full parameters (in the policy's compute
/// dtype): one all-gather per parameter, straight into its storage when its rows split evenly
/// (else through a padded buffer), all in flight at once.
void FullyShardedDataParallel::State::gather(Unit& unit, c10d::ProcessGroup& via) {
  if (unit.gathered) return;
  at::NoGradGuard no_grad;
  const auto compute = unit.options.dtype(unit.compute_dtype);
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<at::Tensor> inputs;
  std::vector<at::Tensor> padded(unit.params.size());
  for (size_t i = 0; i < unit.params.size(); ++i) {
    auto& slot = unit.params[i];
    detail::allocate_full(slot.param, slot.sizes, unit.compute_dtype);
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
    works.push_back(detail::start_all_gather(via, output, inputs.back()));
  }
  detail::wait_all_of(works, "the all-gather of unit '" + unit.name + "'", rank);
  for (size_t i = 0; i < unit.params.size(); ++i) {
    if (!padded[i].defined()) continue;
    const auto& slot = unit.params[i];
    slot.param.variable_data().view({-1}).copy_(padded[i].narrow(0, 0, slot.numel()));
  }
  unit.gathered = true;
}

void FullyShardedDataParallel::State::reshard(Unit& unit) {
  if (!unit.gathered) return;
  for (auto& slot : unit.params) detail::release_full(slot.param, unit.dtype);
  unit.gathered = false;
}

/// Writes `full`'s rows (the parameter's full shape) into the rank-major [world, ...] buffer
/// at `column`, one chunk per rank, zeros past the last row.
void FullyShardedDataParallel::State::write_chunks(const at::Tensor& by_rank, const ParamSlot& slot,
                                                   const at::Tensor& full, int64_t column) {
  const auto rows = full.reshape({slot.rows, slot.row_numel});
  const int world = static_cast<int>(by_rank.size(0));
  for (int r = 0; r < world; ++r) {
    auto chunk = by_rank[r].narrow(0, column, slot.chunk_numel()).view({slot.chunk_rows, -1});
    const int64_t valid = slot.valid_rows(r);
    if (valid > 0) chunk.narrow(0, 0, valid).copy_(rows.narrow(0, r * slot.chunk_rows, valid));
    if (valid < slot.chunk_rows) chunk.narrow(0, valid, slot.chunk_rows - valid).zero_();
  }
}

void FullyShardedDataParallel::State::write_chunks(const at::Tensor& by_rank, const ParamSlot& slot,
                                                   const at::Tensor& full) {
  write_chunks(by_rank, slot, full, slot.offset);
}

/// The inverse of write_chunks: the rank-major buffer's chunks at `column` into `full`'s rows.
void FullyShardedDataParallel::State::read_chunks(const at::Tensor& by_rank, const ParamSlot& slot,
                                                  int64_t column, const at::Tensor& full) {
  const auto rows = full.view({slot.rows, slot.row_numel});
  for (int r = 0; r < static_cast<int>(by_rank.size(0)); ++r) {
    const int64_t valid = slot.valid_rows(r);
    if (valid == 0) continue;
    rows.narrow(0, r * slot.chunk_rows, valid)
        .copy_(by_rank[r].narrow(0, column, valid * slot.row_numel).view({valid, -1}));
  }
}

/// This rank's shard into `chunk` (chunk_numel elements, any dtype), zeros past its rows.
void FullyShardedDataParallel::State::write_shard(const at::Tensor& chunk, const ParamSlot& slot) {
  const auto n = slot.shard.numel();
  chunk.narrow(0, 0, n).copy_(slot.shard.detach().reshape({-1}));
  chunk.narrow(0, n, slot.chunk_numel() - n).zero_();
}

/// Per rank: the elements of the chunks of the unit's parameters that rank owns.
std::vector<int64_t> FullyShardedDataParallel::State::chunks_by_owner(const Unit& unit) const {
  std::vector<int64_t> split(world, 0);
  for (const auto& slot : unit.params) split[slot.owner] += slot.chunk_numel();
  return split;
}

/// Where each rank's part starts in a buffer of consecutive parts of sizes `split`.
std::vector<int64_t> FullyShardedDataParallel::State::starts_of(const std::vector<int64_t>& split) {
  std::vector<int64_t> starts(split.size(), 0);
  for (size_t o = 1; o < split.size(); ++o) starts[o] = starts[o - 1] + split[o - 1];
  return starts;
}

/// Lossless: every rank sends each owner its rows of the owner's parameters; the owners'
/// parameters get their full values (in their own dtype).
void FullyShardedDataParallel::State::collect_rows(Unit& unit, c10d::ProcessGroup& via) {
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
  detail::wait_one(detail::start_all_to_all(via, flat, send, receive_split, send_split),
                   "collecting the rows of unit '" + unit.name + "' for its step", rank);
  int64_t column = 0;
  for (auto& slot : unit.params) {
    if (slot.owner != rank) continue;
    detail::allocate_full(slot.param, slot.sizes, unit.dtype);
    read_chunks(received, slot, column, slot.param.variable_data());
    column += slot.chunk_numel();
  }
}

/// Lossless: each owner sends every rank that rank's rows of the parameters it stepped.
void FullyShardedDataParallel::State::scatter_rows(Unit& unit, c10d::ProcessGroup& via) {
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
  detail::wait_one(detail::start_all_to_all(via, received, flat, receive_split, send_split),
                   "sending the stepped rows of unit '" + unit.name + "'", rank);
  auto source_offset = starts_of(receive_split);
  for (auto& slot : unit.params) {
    const int64_t n = slot.valid_rows(rank) * slot.row_numel;
    if (n > 0) slot.shard.view({-1}).copy_(received.narrow(0, source_offset[slot.owner], n));
    source_offset[slot.owner] += slot.chunk_numel();
  }
}

/// Gives the (released) parameter its full value in its own dtype: every rank's rows,
/// all-gathered. Collective.
void FullyShardedDataParallel::State::materialize(Unit& unit, ParamSlot& slot,
                                                  const std::string& what) {
  at::NoGradGuard no_grad;
  detail::allocate_full(slot.param, slot.sizes, unit.dtype);
  auto input = at::empty({slot.chunk_numel()}, unit.options);
  write_shard(input, slot);
  auto gathered = at::empty({world * slot.chunk_numel()}, unit.options);
  detail::wait_one(detail::start_all_gather(*group, gathered, input), what, rank);
  slot.param.variable_data().view({-1}).copy_(gathered.narrow(0, 0, slot.numel()));
}

/// Split across replicas: each owned parameter's stepped full value, from the replica that
/// stepped it to this shard rank of the others (whose full value is the one before the step),
/// over `replicas_via`. Nothing otherwise.
void FullyShardedDataParallel::State::broadcast_stepped(
    Unit& unit, const c10::intrusive_ptr<c10d::ProcessGroup>& replicas_via) {
  if (!split()) return;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (auto& slot : unit.params) {
    if (slot.owner != rank || !in_a_group(slot)) continue;
    std::vector<at::Tensor> one{slot.param.variable_data()};
    works.push_back(detail::start_broadcast(*replicas_via, one, slot.replica_owner));
  }
  detail::wait_all_of(
      works, "sending the stepped parameters of unit '" + unit.name + "' to the other replicas",
      rank);
}

}  // namespace shampoo
