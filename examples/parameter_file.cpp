#include "examples/parameter_file.h"

#include <ATen/ops/cat.h>
#include <c10/util/Exception.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <system_error>

namespace shampoo::examples {

void write_parameter_file(const std::filesystem::path& path, const NamedTensors& params) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& [name, tensor] : params) dict.insert(name, tensor.detach().to(at::kCPU));
  const std::vector<char> bytes = torch::jit::pickle_save(c10::IValue(dict));
  if (path.has_parent_path()) {
    std::error_code ec;
    std::filesystem::create_directories(path.parent_path(), ec);
  }
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  TORCH_CHECK(out.good(), "--save-params: cannot write ", path.string());
}

NamedTensors read_parameter_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "parameter file: cannot read ", path.string());
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)),
                                std::istreambuf_iterator<char>());
  c10::IValue value;
  try {
    value = torch::jit::pickle_load(bytes);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "parameter file: ", path.string(),
                " is not a file of --save-params: ", e.what_without_backtrace());
  }
  TORCH_CHECK(value.isGenericDict(), "parameter file: ", path.string(),
              " does not hold a dict name -> tensor");
  NamedTensors params;
  for (const auto& entry : value.toGenericDict()) {
    TORCH_CHECK(entry.key().isString() && entry.value().isTensor(),
                "parameter file: ", path.string(), " does not hold a dict name -> tensor");
    params.emplace_back(entry.key().toStringRef(), entry.value().toTensor());
  }
  return params;
}

namespace {

ParameterDistance distance(const std::string& name, const at::Tensor& a, const at::Tensor& b) {
  const auto a64 = a.to(at::kDouble);
  const auto b64 = b.to(at::kDouble);
  const auto diff = a64 - b64;
  // A zero reference: the ratio is 0 when a equals it, infinite otherwise.
  auto ratio = [](double num, double den) {
    if (den > 0) return num / den;
    return num == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  };
  const double max_diff = diff.numel() ? diff.abs().max().item<double>() : 0.0;
  const double max_b = b64.numel() ? b64.abs().max().item<double>() : 0.0;
  return {name, ratio(max_diff, max_b),
          ratio(diff.norm().item<double>(), b64.norm().item<double>())};
}

}  // namespace

std::vector<ParameterDistance> parameter_distances(const NamedTensors& a, const NamedTensors& b) {
  if (a.size() != b.size()) {
    throw std::invalid_argument("the files hold " + std::to_string(a.size()) + " and " +
                                std::to_string(b.size()) + " parameters");
  }
  std::vector<ParameterDistance> rows;
  std::vector<at::Tensor> all_a;
  std::vector<at::Tensor> all_b;
  for (size_t i = 0; i < a.size(); ++i) {
    const auto& [name_a, tensor_a] = a[i];
    const auto& [name_b, tensor_b] = b[i];
    if (name_a != name_b) {
      throw std::invalid_argument("parameter " + std::to_string(i) + ": named " + name_a +
                                  " in the first file and " + name_b + " in the second");
    }
    if (tensor_a.sizes() != tensor_b.sizes()) {
      std::ostringstream shapes;
      shapes << tensor_a.sizes() << " and " << tensor_b.sizes();
      throw std::invalid_argument("parameter " + name_a + ": shapes " + shapes.str());
    }
    rows.push_back(distance(name_a, tensor_a, tensor_b));
    all_a.push_back(tensor_a.to(at::kDouble).flatten());
    all_b.push_back(tensor_b.to(at::kDouble).flatten());
  }
  if (!rows.empty()) rows.push_back(distance("(all)", at::cat(all_a), at::cat(all_b)));
  return rows;
}

}  // namespace shampoo::examples
