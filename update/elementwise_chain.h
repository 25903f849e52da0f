#pragma once
/// Launcher of the elementwise chain (see elementwise_chain_kernels.h): checks the tensors of every
/// block, then runs one pass for all blocks of a virtual group at once, on the CPU (chunks in
/// parallel, each in the tiled loops of elementwise_chain_cpu.h) or on CUDA (one launch per
/// pass), by the device of the tensors.

#include <ATen/ATen.h>

#include <vector>

#include "update/elementwise_chain_kernels.h"

namespace shampoo::detail {

/// Tensors of one block in the chain; undefined = not used (same meaning as the null pointers of
/// kernels::ChainBlock). All defined tensors must be of one dtype and device and of the same numel,
/// and contiguous, except that on the CPU grad, param and param_out may be views the chain takes
/// where they lie (chain_takes_view: a column block of a matrix).
struct ChainBlockTensors {
  at::Tensor grad;
  at::Tensor param;
  at::Tensor gradient_out;
  at::Tensor filtered_out;
  at::Tensor filter_state;
  at::Tensor diagonal_state;
  at::Tensor preconditioned;
  at::Tensor momentum_state;
  at::Tensor average_state;
  at::Tensor param_out;
  at::Tensor update_out;
  /// CUDA: a one-element double tensor on the device holding the grafting ratio, set by
  /// run_chain_norms when it keeps the ratio on the device; the post pass reads it there instead
  /// of scalars.graft_ratio.
  at::Tensor graft_ratio;
  kernels::ChainScalars scalars;
};

/// Whether the chain reads or writes `t` where it lies, as grad, param or param_out: a contiguous
/// tensor, or on the CPU a view made of rows of its last dimension, each row contiguous and at
/// least kChainMinRow long, no two elements at one address (a column block of a matrix, whose
/// gradient and parameter would otherwise be copied before the chain and the update added back
/// after it). The CPU passes then run such a block a row at a time: the same formulas per element,
/// so the same bits as over contiguous copies.
bool chain_takes_view(const at::Tensor& t);
inline constexpr int64_t kChainMinRow = 64;

/// Whether chain_takes_view accepts views that are not contiguous (default true). false makes the
/// step copy them in and stage their updates, as it does on CUDA: for tests and benchmarks that
/// compare the two.
bool chain_views_enabled();
void set_chain_views(bool enabled);

/// Pre pass (L2 weight decay, diagonal statistics, filtering) for every block.
void run_chain_pre(const std::vector<ChainBlockTensors>& blocks);
/// Norm pass: the grafting ratio of every block in DirectionMode::kGraftNorm, into
/// scalars.graft_ratio on the host or, on CUDA while chain_norms_on_device() holds, into
/// graft_ratio on the device (no synchronization with the host; the same bits).
void run_chain_norms(std::vector<ChainBlockTensors>& blocks);

/// Whether run_chain_norms keeps CUDA ratios on the device (default true). false brings the norms
/// to the host as before: for tests and benchmarks that compare the two.
bool chain_norms_on_device();
void set_chain_norms_on_device(bool enabled);
/// Post pass (grafting, decoupled weight decay, momentum, × −lr, iterate averaging, apply or
/// write) for every block.
void run_chain_post(const std::vector<ChainBlockTensors>& blocks);

/// Pre and post as one pass, Ḡ not stored (filtered_out may be undefined): for blocks whose
/// direction is elementwise (DirectionMode kPreconditioned without a preconditioned tensor,
/// kDiagonal, kSign). CPU tensors only.
void run_chain_fused(const std::vector<ChainBlockTensors>& blocks);

/// Whether the CUDA kernels of the chain were compiled into this build.
bool chain_has_cuda_kernels();

}  // namespace shampoo::detail
