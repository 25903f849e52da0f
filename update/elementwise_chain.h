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
/// kernels::ChainBlock). All defined tensors must be contiguous, of one dtype and device, and of
/// the same numel.
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
  kernels::ChainScalars scalars;
};

/// Pre pass (L2 weight decay, diagonal statistics, filtering) for every block.
void run_chain_pre(const std::vector<ChainBlockTensors>& blocks);
/// Norm pass: sets scalars.graft_ratio of every block in DirectionMode::kGraftNorm.
void run_chain_norms(std::vector<ChainBlockTensors>& blocks);
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
