#include "update/elementwise_chain.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <utility>

#include "shampoo/config.h"
#include "update/elementwise_chain_cpu.h"

#if SHAMPOO_WITH_CUDA
#include "update/cuda/chain_launch.h"
#endif

namespace shampoo::detail {
namespace {

using WorkItem = kernels::ChainWorkItem;

void check_block(const ChainBlockTensors& b, at::ScalarType dtype, at::Device device) {
  const int64_t numel = b.grad.numel();
  auto check = [&](const at::Tensor& t, const char* name, bool view) {
    if (!t.defined()) return;
    TORCH_CHECK(t.scalar_type() == dtype, "elementwise chain: ", name, " has dtype ",
                t.scalar_type(), ", expected ", dtype);
    TORCH_CHECK(t.device() == device, "elementwise chain: ", name, " is on ", t.device(),
                ", expected ", device);
    if (view) {
      TORCH_CHECK(chain_takes_view(t), "elementwise chain: ", name, " (sizes ", t.sizes(),
                  ", strides ", t.strides(),
                  ") must be contiguous, or on the CPU rows of at least ", kChainMinRow,
                  " contiguous elements that do not overlap");
    } else {
      TORCH_CHECK(t.is_contiguous(), "elementwise chain: ", name, " must be contiguous");
    }
    TORCH_CHECK(t.numel() == numel, "elementwise chain: ", name, " has ", t.numel(),
                " elements, expected ", numel);
  };
  check(b.grad, "grad", true);
  check(b.param, "param", true);
  check(b.gradient_out, "gradient_out", false);
  check(b.filtered_out, "filtered_out", false);
  check(b.filter_state, "filter_state", false);
  check(b.diagonal_state, "diagonal_state", false);
  check(b.preconditioned, "preconditioned", false);
  check(b.momentum_state, "momentum_state", false);
  check(b.average_state, "average_state", false);
  check(b.param_out, "param_out", true);
  check(b.update_out, "update_out", false);
}

/// No two elements of `t` share an address: taken by stride, each dimension steps past every
/// offset the smaller ones reach.
bool elements_do_not_overlap(const at::Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // {stride, size} of the dimensions that vary
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t reach = 0;
  for (const auto& [stride, size] : dims) {
    if (stride <= reach) return false;
    reach += stride * (size - 1);
  }
  return true;
}

/// The offsets (elements) of the rows of a view the chain takes, its dimensions but the last in
/// row-major order.
std::vector<int64_t> row_offsets(const at::Tensor& t) {
  const int64_t outer = t.dim() - 1;
  const int64_t rows = t.numel() / t.size(-1);
  std::vector<int64_t> offsets;
  offsets.reserve(static_cast<size_t>(rows));
  std::vector<int64_t> index(static_cast<size_t>(outer), 0);
  int64_t offset = 0;
  for (int64_t r = 0; r < rows; ++r) {
    offsets.push_back(offset);
    for (int64_t d = outer - 1; d >= 0; --d) {  // the next row: the last index that can grow
      offset += t.stride(d);
      if (++index[d] < t.size(d)) break;
      offset -= t.stride(d) * t.size(d);
      index[d] = 0;
    }
  }
  return offsets;
}

template <typename T>
T* ptr(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

template <typename T>
kernels::ChainBlock<T> to_kernel_block(const ChainBlockTensors& b) {
  kernels::ChainBlock<T> k;
  k.numel = b.grad.numel();
  k.grad = ptr<T>(b.grad);
  k.param = ptr<T>(b.param);
  k.gradient_out = ptr<T>(b.gradient_out);
  k.filtered_out = ptr<T>(b.filtered_out);
  k.filter_state = ptr<T>(b.filter_state);
  k.diagonal_state = ptr<T>(b.diagonal_state);
  k.preconditioned = ptr<T>(b.preconditioned);
  k.momentum_state = ptr<T>(b.momentum_state);
  k.average_state = ptr<T>(b.average_state);
  k.param_out = ptr<T>(b.param_out);
  k.update_out = ptr<T>(b.update_out);
  k.graft_ratio_device = b.graft_ratio.defined() ? b.graft_ratio.data_ptr<double>() : nullptr;
  k.s = b.scalars;
  return k;
}

/// Checks every block; returns false when there is nothing to do.
bool check_all(const std::vector<ChainBlockTensors>& blocks, at::ScalarType& dtype,
               at::Device& device) {
  if (blocks.empty()) return false;
  dtype = blocks.front().grad.scalar_type();
  device = blocks.front().grad.device();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, "elementwise chain: dtype ", dtype,
              " is not supported (Float or Double)");
  for (const auto& b : blocks) check_block(b, dtype, device);
  return true;
}

/// The work items of `blocks` (those flagged in `only` when given): chunks of kChainChunk
/// elements, or where `rows` gives a block's row length (not 0), whole rows of about as many.
std::vector<WorkItem> make_work(const std::vector<ChainBlockTensors>& blocks,
                                const std::vector<bool>* only,
                                const std::vector<int64_t>* rows = nullptr) {
  std::vector<WorkItem> items;
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (only != nullptr && !(*only)[i]) continue;
    const int64_t numel = blocks[i].grad.numel();
    const int64_t row = rows != nullptr ? (*rows)[i] : 0;
    const int64_t chunk =
        row == 0 ? kernels::kChainChunk : std::max<int64_t>(1, kernels::kChainChunk / row) * row;
    for (int64_t begin = 0; begin < numel; begin += chunk) {
      items.push_back({static_cast<int64_t>(i), begin, std::min(numel, begin + chunk)});
    }
  }
  return items;
}

/// Runs fn(item) for every work item, in parallel when there is enough work.
template <typename Fn>
void for_each_item(const std::vector<WorkItem>& items, Fn&& fn) {
  const auto n = static_cast<int64_t>(items.size());
  if (n <= 1) {
    for (const auto& item : items) fn(item);
    return;
  }
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) fn(items[i]);
  });
}

template <typename T>
std::vector<kernels::ChainBlock<T>> to_kernel_blocks(const std::vector<ChainBlockTensors>& blocks) {
  std::vector<kernels::ChainBlock<T>> out;
  out.reserve(blocks.size());
  for (const auto& b : blocks) out.push_back(to_kernel_block<T>(b));
  return out;
}

/// A block on the CPU. Where grad, param or param_out is a view of rows (chain_takes_view), the
/// passes run it a row at a time: the views' rows at their offsets, every other tensor's rows one
/// after the other.
template <typename T>
struct CpuBlock {
  kernels::ChainBlock<T> whole;  ///< pointers at element 0
  int64_t row = 0;               ///< the row length; 0: every tensor contiguous
  std::vector<int64_t> grad_rows, param_rows, param_out_rows;  ///< the views' row offsets
};

template <typename T>
CpuBlock<T> to_cpu_block(const ChainBlockTensors& b) {
  CpuBlock<T> out;
  out.whole = to_kernel_block<T>(b);
  const std::pair<const at::Tensor*, std::vector<int64_t>*> views[] = {
      {&b.grad, &out.grad_rows}, {&b.param, &out.param_rows}, {&b.param_out, &out.param_out_rows}};
  for (const auto& [view, rows] : views) {
    if (!view->defined() || view->is_contiguous()) continue;
    const int64_t row = view->size(-1);
    TORCH_CHECK(out.row == 0 || out.row == row, "elementwise chain: views with rows of ", out.row,
                " and of ", row, " elements in one block");
    out.row = row;
    *rows = row_offsets(*view);
  }
  return out;
}

/// Row r of a block of rows: every pointer at the row's first element, numel = the row length.
template <typename T>
kernels::ChainBlock<T> row_of(const CpuBlock<T>& b, int64_t r) {
  auto k = b.whole;
  k.numel = b.row;
  const auto shift = [&](auto& pointer, const std::vector<int64_t>* rows) {
    if (pointer != nullptr) pointer += rows == nullptr || rows->empty() ? r * b.row : (*rows)[r];
  };
  shift(k.grad, &b.grad_rows);
  shift(k.param, &b.param_rows);
  shift(k.param_out, &b.param_out_rows);
  shift(k.gradient_out, nullptr);
  shift(k.filtered_out, nullptr);
  shift(k.filter_state, nullptr);
  shift(k.diagonal_state, nullptr);
  shift(k.preconditioned, nullptr);
  shift(k.momentum_state, nullptr);
  shift(k.average_state, nullptr);
  shift(k.update_out, nullptr);
  return k;
}

enum class Pass { kPre, kPost, kFused };

void check_cuda_kernels() {
  TORCH_CHECK(chain_has_cuda_kernels(),
              "elementwise chain: CUDA tensors, but this build has no CUDA kernels");
}

/// {Σ P², Σ P_graft²} per part of a work item (one part per item on the CPU, see
/// launch_chain_norms_cuda on CUDA) of the blocks flagged in `needed`.
template <typename T>
std::vector<double> norm_partials(const std::vector<ChainBlockTensors>& blocks,
                                  const std::vector<bool>& needed, const at::Device& device,
                                  const std::vector<WorkItem>& items) {
  const auto kblocks = to_kernel_blocks<T>(blocks);
  if (device.is_cuda()) {
    check_cuda_kernels();
#if SHAMPOO_WITH_CUDA
    return launch_chain_norms_cuda<T>(kblocks, items, device);
#endif
  }
  std::vector<double> partials(2 * items.size(), 0.0);
  const auto norms = kernels::chain_tiles<T>().norms;
  for_each_item(items, [&](const WorkItem& item) {
    const auto i = static_cast<size_t>(&item - items.data());
    norms(kblocks[item.block], item.begin, item.end, partials[2 * i], partials[2 * i + 1]);
  });
  return partials;
}

/// The pre or post pass over every element of `blocks`: one kernel launch on CUDA tensors, the
/// work items in parallel on the CPU.
template <typename T>
void run_pass(Pass pass, const std::vector<ChainBlockTensors>& blocks, const at::Device& device) {
  if (device.is_cuda()) {
    check_cuda_kernels();
    TORCH_CHECK(pass != Pass::kFused, "elementwise chain: the fused pass runs on the CPU only");
#if SHAMPOO_WITH_CUDA
    launch_chain_pass_cuda<T>(pass == Pass::kPre, to_kernel_blocks<T>(blocks),
                              make_work(blocks, nullptr), device);
#endif
    return;
  }
  std::vector<CpuBlock<T>> cpu_blocks;
  std::vector<int64_t> rows;
  for (const auto& b : blocks) {
    cpu_blocks.push_back(to_cpu_block<T>(b));
    rows.push_back(cpu_blocks.back().row);
  }
  const auto items = make_work(blocks, nullptr, &rows);
  const auto& tiles = kernels::chain_tiles<T>();
  const auto range = pass == Pass::kPre    ? tiles.pre
                     : pass == Pass::kPost ? tiles.post
                                           : tiles.fused;
  for_each_item(items, [&](const WorkItem& item) {
    const auto& b = cpu_blocks[item.block];
    if (b.row == 0) {
      range(b.whole, item.begin, item.end);
      return;
    }
    for (int64_t r = item.begin / b.row; r < item.end / b.row; ++r) {
      range(row_of(b, r), 0, b.row);
    }
  });
}

}  // namespace

bool chain_has_cuda_kernels() { return SHAMPOO_WITH_CUDA != 0; }

namespace {
std::atomic<bool> views_enabled{true};
std::atomic<bool> norms_on_device{true};
}  // namespace

bool chain_views_enabled() { return views_enabled.load(); }
void set_chain_views(bool enabled) { views_enabled.store(enabled); }

bool chain_takes_view(const at::Tensor& t) {
  if (t.is_contiguous()) return true;
  return chain_views_enabled() && t.device().is_cpu() && t.dim() >= 2 && t.stride(-1) == 1 &&
         t.size(-1) >= kChainMinRow && elements_do_not_overlap(t);
}

bool chain_norms_on_device() { return norms_on_device.load(); }
void set_chain_norms_on_device(bool enabled) { norms_on_device.store(enabled); }

void run_chain_pre(const std::vector<ChainBlockTensors>& blocks) {
  at::ScalarType dtype;
  at::Device device(at::kCPU);
  if (!check_all(blocks, dtype, device)) return;
  for (const auto& b : blocks) {
    TORCH_INTERNAL_ASSERT(b.filtered_out.defined(), "pre pass needs filtered_out");
    TORCH_INTERNAL_ASSERT(b.param.defined() || b.scalars.l2_weight_decay == 0.0,
                          "pre pass: L2 weight decay needs the parameter");
  }
  AT_DISPATCH_FLOATING_TYPES(dtype, "shampoo_chain_pre",
                             [&] { run_pass<scalar_t>(Pass::kPre, blocks, device); });
}

void run_chain_norms(std::vector<ChainBlockTensors>& blocks) {
  at::ScalarType dtype;
  at::Device device(at::kCPU);
  if (!check_all(blocks, dtype, device)) return;
  std::vector<bool> needed(blocks.size());
  bool any = false;
  for (size_t i = 0; i < blocks.size(); ++i) {
    needed[i] = blocks[i].scalars.direction_mode ==
                static_cast<int32_t>(kernels::DirectionMode::kGraftNorm);
    if (needed[i]) {
      TORCH_INTERNAL_ASSERT(blocks[i].preconditioned.defined());
      any = true;
    }
  }
  if (!any) return;
  std::vector<double> preconditioned_sq(blocks.size(), 0.0);
  std::vector<double> graft_sq(blocks.size(), 0.0);
  const auto items = make_work(blocks, &needed);
#if SHAMPOO_WITH_CUDA
  if (device.is_cuda() && chain_norms_on_device()) {
    check_cuda_kernels();
    AT_DISPATCH_FLOATING_TYPES(dtype, "shampoo_chain_norms", [&] {
      const auto ratios =
          launch_graft_ratios_cuda<scalar_t>(to_kernel_blocks<scalar_t>(blocks), items, device);
      for (size_t i = 0; i < blocks.size(); ++i) {
        if (needed[i]) blocks[i].graft_ratio = ratios.narrow(0, static_cast<int64_t>(i), 1);
      }
    });
    return;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES(dtype, "shampoo_chain_norms", [&] {
    const auto partials = norm_partials<scalar_t>(blocks, needed, device, items);
    // Combine in part order: the sum does not depend on the thread count, and a block's CUDA
    // ratio on the device adds the same parts in the same order.
    const size_t parts = items.empty() ? 1 : partials.size() / (2 * items.size());
    for (size_t e = 0; e < partials.size() / 2; ++e) {
      preconditioned_sq[items[e / parts].block] += partials[2 * e];
      graft_sq[items[e / parts].block] += partials[2 * e + 1];
    }
  });
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (needed[i]) {
      blocks[i].scalars.graft_ratio = kernels::graft_ratio(preconditioned_sq[i], graft_sq[i]);
      blocks[i].graft_ratio = at::Tensor();
    }
  }
}

namespace {

/// What the post half of the chain needs of a block (the post and the fused pass).
void check_post(const ChainBlockTensors& b) {
  TORCH_INTERNAL_ASSERT(b.param_out.defined() != b.update_out.defined(),
                        "post pass writes either param_out or update_out");
  TORCH_INTERNAL_ASSERT(
      b.param.defined() || (b.scalars.decoupled_weight_decay == 0.0 && !b.param_out.defined() &&
                            b.scalars.output_updated_param == 0 && !b.average_state.defined()),
      "post pass: this block needs the parameter");
  TORCH_INTERNAL_ASSERT((b.scalars.averaging != 0) == b.average_state.defined(),
                        "post pass: iterate averaging needs Z, and Z needs averaging");
}

}  // namespace

void run_chain_post(const std::vector<ChainBlockTensors>& blocks) {
  at::ScalarType dtype;
  at::Device device(at::kCPU);
  if (!check_all(blocks, dtype, device)) return;
  for (const auto& b : blocks) {
    TORCH_INTERNAL_ASSERT(b.filtered_out.defined());
    check_post(b);
  }
  AT_DISPATCH_FLOATING_TYPES(dtype, "shampoo_chain_post",
                             [&] { run_pass<scalar_t>(Pass::kPost, blocks, device); });
}

void run_chain_fused(const std::vector<ChainBlockTensors>& blocks) {
  at::ScalarType dtype;
  at::Device device(at::kCPU);
  if (!check_all(blocks, dtype, device)) return;
  for (const auto& b : blocks) {
    TORCH_INTERNAL_ASSERT(b.param.defined() || b.scalars.l2_weight_decay == 0.0,
                          "fused pass: L2 weight decay needs the parameter");
    const auto mode = static_cast<kernels::DirectionMode>(b.scalars.direction_mode);
    TORCH_INTERNAL_ASSERT(!b.preconditioned.defined() && mode != kernels::DirectionMode::kGraftNorm,
                          "fused pass: no matrix preconditioner, no grafting norms");
    check_post(b);
  }
  AT_DISPATCH_FLOATING_TYPES(dtype, "shampoo_chain_fused",
                             [&] { run_pass<scalar_t>(Pass::kFused, blocks, device); });
}

}  // namespace shampoo::detail
