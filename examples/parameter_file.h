#pragma once
/// A model's parameters by name in one file (--save-params of the trainer; examples/param_distance
/// compares two such files): torch::jit::pickle_save of a dict name → tensor (CPU, float as
/// trained), in the model's order. LibTorch reads it with torch::jit::pickle_load
/// (read_parameter_file below), Python with torch.load(path).

#include <ATen/core/Tensor.h>

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace shampoo::examples {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// Writes `params` (copied to the CPU, detached) to `path`, replacing it. Throws c10::Error
/// naming the file when it cannot be written.
void write_parameter_file(const std::filesystem::path& path, const NamedTensors& params);

/// Reads a file of write_parameter_file. Throws c10::Error naming the file when it is missing or
/// not such a file.
NamedTensors read_parameter_file(const std::filesystem::path& path);

/// How far `a` is from the reference `b`, per parameter and over all of them:
/// max|a − b| / max|b| and ‖a − b‖ / ‖b‖ (Frobenius norms; over all: of the concatenation).
struct ParameterDistance {
  std::string name;
  double max_relative = 0;   ///< max|a − b| / max|b|
  double norm_relative = 0;  ///< ‖a − b‖ / ‖b‖
};

/// One row per parameter, then a last row named "(all)". Throws std::invalid_argument naming the
/// parameter when the names (in order) or shapes differ.
std::vector<ParameterDistance> parameter_distances(const NamedTensors& a, const NamedTensors& b);

}  // namespace shampoo::examples
