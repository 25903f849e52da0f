#pragma once
/// Where the parameters change. Every write to a parameter is routed or done here:
///   - one process, a block the chain takes where it lies (contiguous, or on the CPU a column
///     block of a matrix; chain_takes_view): the chain's post pass adds the update in place;
///   - one process, other blocks (a column block of a matrix on CUDA): the update is staged in a
///     row of the step's own buffers and added to the parameter after the chain
///     (StepUpdates::finish);
///   - distributed: the owner writes the update (or W + U with communicate_params) into the
///     Distributor's slot of the block, cast-copied when the communication dtype differs, and
///     after the AllGather every rank applies every received block (apply_received);
///   - a step that is undone puts the parameters it changed in place back (restore_params).

#include <ATen/ATen.h>

#include <utility>
#include <vector>

#include "distributor/block_plan.h"
#include "distributor/distributor.h"
#include "update/elementwise_chain.h"

namespace shampoo::detail {

struct ParamEntry;
struct BlockEntry;

/// Pairs of equal-shaped views (to[i], from[i]) gathered into fewer pairs, so that an elementwise
/// op over them (a copy, an add) is one launch per run instead of one per pair: consecutive pairs
/// whose `to` views are equally spaced views of one storage with the same sizes, strides and
/// dtype, and whose `from` views are too, become one pair of views [k, sizes...] with that
/// spacing as the leading stride (the same elements, in the same order). The column blocks of a
/// matrix and the consecutive rows of a stack are such runs: a [10, 50176] weight in blocks of
/// 1024 columns is one copy and one add on CUDA, not 49 of each (issue 46). The caller's `to`
/// views must not overlap one another (blocks of one parameter, rows of one buffer).
struct StridedRuns {
  std::vector<at::Tensor> to;
  std::vector<at::Tensor> from;
};
StridedRuns merge_strided_runs(const std::vector<at::Tensor>& to,
                               const std::vector<at::Tensor>& from);

/// to[i].copy_(from[i]) for every i, one copy per run of merge_strided_runs.
void copy_in_runs(const std::vector<at::Tensor>& to, const std::vector<at::Tensor>& from);

/// The updates of the blocks of one compute call.
class StepUpdates {
 public:
  explicit StepUpdates(Distributor& distributor) : distributor_(distributor) {}

  /// Sets where the chain of engine block `block` reads W and writes its result (c.param,
  /// c.param_out or c.update_out), from `param_view` (the block of the parameter) and
  /// `staging` (a row of the step's buffers that the post pass may overwrite: it reads each
  /// element of a row before it writes the same element; undefined: a buffer like c.grad is
  /// allocated where one is needed). Call after c.scalars and c.grad are set.
  void route(int64_t block, const at::Tensor& param_view, const at::Tensor& staging,
             ChainBlockTensors& c);
  /// After the post pass: adds the staged updates to their parameters and copies the staged
  /// slots into the Distributor's buffer.
  void finish();

 private:
  Distributor& distributor_;
  std::vector<at::Tensor> apply_to_, apply_from_;  // one process, non-contiguous blocks
  std::vector<at::Tensor> cast_to_, cast_from_;    // distributed, another communication dtype
};

/// Distributed, after the AllGather: applies every updated block from the gathered buffer to the
/// parameters (owners included, so all ranks hold the same values, also with a lossy
/// communication dtype).
void apply_received(const Distributor& distributor, const std::vector<ParamEntry>& params,
                    const std::vector<BlockEntry>& blocks);

/// Puts back parameters saved before a step: (parameter, copy) pairs.
void restore_params(const std::vector<std::pair<at::Tensor, at::Tensor>>& saved);

}  // namespace shampoo::detail
