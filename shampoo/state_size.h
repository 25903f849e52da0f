#pragma once
/// The size of Shampoo's state, estimated from the block plans before any of it is allocated,
/// and the construction-time warning when it is far larger than the parameters it
/// preconditions, in total or for one parameter (a thin or 1-D parameter gets a d×d factor and
/// root per block of d elements: a 1×100000 parameter has 98 blocks and 409 MB of state for
/// 0.4 MB of parameters; a [50000, 128] embedding, 49 blocks of [1024, 128] whose 1024-row factors
/// dwarf the rest, 9× its bytes).

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "shampoo/shampoo_options.h"

namespace shampoo::detail {

/// The warning fires when the state exceeds both this multiple of the parameters' bytes ...
inline constexpr int64_t kStateSizeWarningRatio = 10;
/// ... and this many bytes (tiny models have large ratios that cost nothing);
inline constexpr int64_t kStateSizeWarningMinBytes = int64_t{64} << 20;
/// or when one parameter's state exceeds both this multiple of its bytes (a square weight whose
/// dims are each one block holds about 3×: factors and roots as packed triangles, and the
/// grafting state) ...
inline constexpr int64_t kParamStateWarningRatio = 5;
/// ... and this many bytes.
inline constexpr int64_t kParamStateWarningMinBytes = int64_t{8} << 20;

/// One parameter's share of the estimate.
struct ParamStateSize {
  int64_t param = -1;  ///< index over all groups, as in BlockId
  int64_t group = -1;
  std::vector<int64_t> shape;
  int64_t blocks = 0;
  /// The largest preconditioned block dim (0 when no dim is preconditioned), and whether every
  /// block is 1-D.
  int64_t largest_dim = 0;
  bool one_dimensional = false;
  int64_t param_bytes = 0;
  int64_t state_bytes = 0;
  /// What it gets (describe_factor_choice): "Kronecker factors on every dim", "the grafting
  /// method's update (a 1-D parameter; ...)", ...
  std::string treatment;
};

/// State that DistributedShampoo allocates when it registers parameters, over all blocks (every
/// rank's share): Kronecker factors with their inverse roots or eigenbases for every
/// preconditioned dim (exponent ≠ 0), eigenvalue corrections, and the grafting state. The
/// filtered gradient and momentum (each at most the parameters' size, allocated at the first
/// step) are not counted. Equals ShampooStats::state_bytes of a single process right after
/// construction.
struct StateSizeEstimate {
  int64_t param_bytes = 0;
  int64_t state_bytes = 0;
  /// Of state_bytes: the grafting statistics; the rest is the preconditioners' (factors, roots,
  /// eigenbases, ...).
  int64_t grafting_bytes = 0;
  /// The parameter holding the most state (indices over all groups, as in BlockId).
  int64_t largest_param = -1;
  int64_t largest_param_group = -1;
  std::vector<int64_t> largest_param_shape;
  int64_t largest_param_blocks = 0;
  int64_t largest_param_state_bytes = 0;
  /// Every parameter, in index order.
  std::vector<ParamStateSize> params;
};

/// The estimate for `groups` (a group without options takes `defaults`); nullopt when a group or
/// parameter is invalid (the optimizer reports that itself when it registers it).
std::optional<StateSizeEstimate> estimate_state_size(
    const std::vector<torch::optim::OptimizerParamGroup>& groups, const ShampooOptions& defaults);

/// The parameters whose state exceeds kParamStateWarningRatio × their bytes and
/// kParamStateWarningMinBytes, the largest state first.
std::vector<ParamStateSize> oversized_params(const StateSizeEstimate& estimate);

/// One TORCH_WARN when the state exceeds kStateSizeWarningRatio × the parameters' bytes and
/// kStateSizeWarningMinBytes, or a parameter's is oversized: the total, the largest parameter,
/// each oversized one (index, group, shape, its bytes and its state's) with what would shrink it,
/// and the options that shrink the state. Returns whether it warned.
bool warn_if_state_is_large(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                            const ShampooOptions& defaults);

}  // namespace shampoo::detail
