#pragma once
/// What the checkpoints need to know about LibTorch's own optimizers (SGD, Adam, AdamW, Adagrad,
/// RMSprop): their per-parameter state types, so that one parameter's state can be saved and
/// loaded on its own.

#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <memory>
#include <string>
#include <vector>

namespace shampoo::detail {

/// "Adam", "AdamW", "SGD", "Adagrad" or "RMSprop"; empty for any other optimizer type.
std::string libtorch_optimizer_name(const torch::optim::Optimizer& optimizer);

/// An empty per-parameter state of `optimizer`'s type (one of the above), to be filled by
/// OptimizerParamState::serialize(InputArchive&).
std::unique_ptr<torch::optim::OptimizerParamState> make_param_state(
    const torch::optim::Optimizer& optimizer);

/// Steps `optimizer` (any torch::optim optimizer, which steps every parameter with a gradient)
/// for the parameters in `ready` only: during the step its param groups hold those alone (put
/// back afterwards, also when the step throws), so the other parameters and their gradients are
/// not even read.
void step_hiding_others(torch::optim::Optimizer& optimizer, const std::vector<at::Tensor>& ready);

/// A checkpoint piece of `param`'s state in `optimizer` (one of the above): whether it has
/// state, and the state.
torch::serialize::OutputArchive param_state_piece(const torch::optim::Optimizer& optimizer,
                                                  const at::Tensor& param);
/// The state a param_state_piece holds, for `optimizer`'s type (null when the parameter had
/// none). `what` names the piece in the error for a damaged one.
std::unique_ptr<torch::optim::OptimizerParamState> read_param_state_piece(
    const torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& piece,
    const std::string& what);

/// A deep copy of `state` (a per-parameter state of `optimizer`, one of the above): tensors
/// copied, not shared (OptimizerParamState::clone shares them), for undoing a step.
std::unique_ptr<torch::optim::OptimizerParamState> copy_param_state(
    const torch::optim::Optimizer& optimizer, const torch::optim::OptimizerParamState& state);

}  // namespace shampoo::detail
