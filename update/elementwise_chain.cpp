#include "update/elementwise_chain.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <atomic>

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
  auto check = [&](const at::Tensor& t, const char* name) {
    if (!t.defined()) return;
    TORCH_CHECK(t.scalar_type() == dtype, "elementwise chain: ", name, " has dtype ",
                t.scalar_type(), ", expected ", dtype);
    TORCH_CHECK(t.device() == device, "elementwise chain: ", name, " is on ", t.device(),
                ", expected ", device);
    TORCH_CHECK(t.is_contiguous(), "elementwise chain: ", name, " must be contiguous");
    TORCH_CHECK(t.numel() == numel, "elementwise chain: ", name, " has ", t.numel(),
                " elements, expected ", numel);
  };
  check(b.grad, "grad");
  check(b.param, "param");
  check(b.gradient_out, "gradient_out");
  check(b.filtered_out, "filtered_out");
  check(b.filter_state, "filter_state");
  check(b.diagonal_state, "diagonal_state");
  check(b.preconditioned, "preconditioned");
  check(b.momentum_state, "momentum_state");
  check(b.average_state, "average_state");
  check(b.param_out, "param_out");
  check(b.update_out, "update_out");
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

std::vector<WorkItem> make_work(const std::vector<ChainBlockTensors>& blocks,
                                const std::vector<bool>* only) {
  std::vector<WorkItem> items;
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (only != nullptr && !(*only)[i]) continue;
    const int64_t numel = blocks[i].grad.numel();
    for (int64_t begin = 0; begin < numel; begin += kernels::kChainChunk) {
      items.push_back(
          {static_cast<int64_t>(i), begin, std::min(numel, begin + kernels::kChainChunk)});
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
  const auto kblocks = to_kernel_blocks<T>(blocks);
  const auto items = make_work(blocks, nullptr);
  if (device.is_cuda()) {
    check_cuda_kernels();
    TORCH_CHECK(pass != Pass::kFused, "elementwise chain: the fused pass runs on the CPU only");
#if SHAMPOO_WITH_CUDA
    launch_chain_pass_cuda<T>(pass == Pass::kPre, kblocks, items, device);
#endif
    return;
  }
  const auto& tiles = kernels::chain_tiles<T>();
  const auto range = pass == Pass::kPre    ? tiles.pre
                     : pass == Pass::kPost ? tiles.post
                                           : tiles.fused;
  for_each_item(items,
                [&](const WorkItem& item) { range(kblocks[item.block], item.begin, item.end); });
}

}  // namespace

bool chain_has_cuda_kernels() { return SHAMPOO_WITH_CUDA != 0; }

namespace {
std::atomic<bool> norms_on_device{true};
}  // namespace

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
