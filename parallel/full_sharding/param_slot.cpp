// Full sharding: a parameter's storage released and allocated, and its rows in rank-major
// buffers.
#include "parallel/full_sharding/param_slot.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/accumulate.h>

#include <sstream>

namespace shampoo::detail {

void release_full(const at::Tensor& param, at::ScalarType dtype) {
  auto* impl = param.unsafeGetTensorImpl();
  auto* storage = impl->storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, param.device()));
  storage->set_nbytes(0);
  impl->set_storage_and_dtype(impl->storage(), c10::scalarTypeToTypeMeta(dtype));
  impl->set_sizes_contiguous({0});
}

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

std::string shape_text(at::IntArrayRef sizes) {
  std::ostringstream out;
  out << sizes;
  return out.str();
}

void ParamSlot::write_chunks(const at::Tensor& by_rank, const at::Tensor& full,
                             int64_t column) const {
  const auto all_rows = full.reshape({rows, row_numel});
  const int world = static_cast<int>(by_rank.size(0));
  for (int r = 0; r < world; ++r) {
    auto chunk = by_rank[r].narrow(0, column, chunk_numel()).view({chunk_rows, -1});
    const int64_t valid = valid_rows(r);
    if (valid > 0) chunk.narrow(0, 0, valid).copy_(all_rows.narrow(0, r * chunk_rows, valid));
    if (valid < chunk_rows) chunk.narrow(0, valid, chunk_rows - valid).zero_();
  }
}

void ParamSlot::write_chunks(const at::Tensor& by_rank, const at::Tensor& full) const {
  write_chunks(by_rank, full, offset);
}

void ParamSlot::read_chunks(const at::Tensor& by_rank, int64_t column,
                            const at::Tensor& full) const {
  const auto all_rows = full.view({rows, row_numel});
  for (int r = 0; r < static_cast<int>(by_rank.size(0)); ++r) {
    const int64_t valid = valid_rows(r);
    if (valid == 0) continue;
    all_rows.narrow(0, r * chunk_rows, valid)
        .copy_(by_rank[r].narrow(0, column, valid * row_numel).view({valid, -1}));
  }
}

void ParamSlot::write_shard(const at::Tensor& chunk) const {
  const auto n = shard.numel();
  chunk.narrow(0, 0, n).copy_(shard.detach().reshape({-1}));
  chunk.narrow(0, n, chunk_numel() - n).zero_();
}

void ParamSlot::accumulate(at::Tensor averaged) {
  if (reduced.defined()) {
    reduced += averaged;
  } else {
    reduced = std::move(averaged);
  }
}

}  // namespace shampoo::detail
