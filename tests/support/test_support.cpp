#include "support/test_support.h"

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <sstream>

namespace shampoo::testing {

Tolerance tolerance_for(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16:
      return {1.6e-2, 1e-5};
    case at::kHalf:
      return {1e-3, 1e-5};
    case at::kDouble:
      return {1e-7, 1e-7};
    default:
      return {1.3e-6, 1e-5};
  }
}

::testing::AssertionResult all_close(const at::Tensor& actual, const at::Tensor& expected,
                                     Tolerance tolerance) {
  if (actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure()
           << "shapes differ: " << actual.sizes() << " vs " << expected.sizes();
  }
  const auto a = actual.detach().to(at::kDouble).cpu().flatten();
  const auto e = expected.detach().to(at::kDouble).cpu().flatten();
  if (a.numel() == 0) return ::testing::AssertionSuccess();
  const auto diff = (a - e).abs();
  const auto allowed = tolerance.atol + tolerance.rtol * e.abs();
  const auto bad = (diff > allowed).logical_or(a.isnan() != e.isnan());
  if (!bad.any().item<bool>()) return ::testing::AssertionSuccess();
  const auto worst = diff.argmax().item<int64_t>();
  const auto rel = diff / e.abs().clamp_min(1e-30);
  const auto worst_rel = rel.argmax().item<int64_t>();
  std::ostringstream out;
  out << bad.sum().item<int64_t>() << " of " << a.numel() << " elements outside rtol "
      << tolerance.rtol << " atol " << tolerance.atol << "; max abs error "
      << diff[worst].item<double>() << " at index " << worst << " (actual "
      << a[worst].item<double>() << ", expected " << e[worst].item<double>() << "); max rel error "
      << rel[worst_rel].item<double>() << " at index " << worst_rel;
  return ::testing::AssertionFailure() << out.str();
}

::testing::AssertionResult all_close(const at::Tensor& actual, const at::Tensor& expected) {
  return all_close(actual, expected, tolerance_for(expected.scalar_type()));
}

::testing::AssertionResult bit_equal(const at::Tensor& actual, const at::Tensor& expected) {
  if (actual.scalar_type() != expected.scalar_type() || actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure()
           << "dtype/shape differ: " << actual.scalar_type() << " " << actual.sizes() << " vs "
           << expected.scalar_type() << " " << expected.sizes();
  }
  const auto a = actual.detach().cpu().contiguous();
  const auto e = expected.detach().cpu().contiguous();
  // Empty tensors may have no storage: memcmp must not see their null pointers (UBSan).
  if (a.nbytes() == 0 || std::memcmp(a.data_ptr(), e.data_ptr(), a.nbytes()) == 0) {
    return ::testing::AssertionSuccess();
  }
  const auto diff = (a.to(at::kDouble) - e.to(at::kDouble)).abs().flatten();
  const auto worst = diff.argmax().item<int64_t>();
  return ::testing::AssertionFailure()
         << "not bit-identical: " << (diff > 0).sum().item<int64_t>() << " of " << a.numel()
         << " elements differ, max abs difference " << diff[worst].item<double>() << " at "
         << worst;
}

::testing::AssertionResult bit_equal(const std::vector<at::Tensor>& actual,
                                     const std::vector<at::Tensor>& expected) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure() << actual.size() << " tensors vs " << expected.size();
  }
  for (size_t i = 0; i < actual.size(); ++i) {
    auto r = bit_equal(actual[i], expected[i]);
    if (!r) return ::testing::AssertionFailure() << "tensor " << i << ": " << r.message();
  }
  return ::testing::AssertionSuccess();
}

void set_random_grads(const std::vector<at::Tensor>& params, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (const auto& p : params) {
    // Drawn on the CPU (the generator is a CPU one), then moved to the parameter's device.
    p.mutable_grad() =
        at::randn(p.sizes(), gen, p.options().device(at::kCPU).requires_grad(false)).to(p.device());
  }
}

std::vector<at::Tensor> snapshot(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.push_back(t.detach().clone());
  return out;
}

std::vector<at::Tensor> clone_params(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) {
    out.push_back(p.detach().clone().set_requires_grad(p.requires_grad()));
  }
  return out;
}

torch::nn::Sequential make_mlp(int64_t in, int64_t hidden, int64_t classes, uint64_t seed) {
  // Module initialization draws from the global generator: ranks running as threads must not
  // interleave their draws, or "the same seed" gives different weights.
  static std::mutex global_generator;
  std::lock_guard<std::mutex> lock(global_generator);
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(in, hidden), torch::nn::Tanh(),
                               torch::nn::Linear(hidden, hidden), torch::nn::Tanh(),
                               torch::nn::Linear(hidden, classes));
}

Dataset make_blobs(int64_t n, int64_t dims, int64_t classes, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto centers = at::randn({classes, dims}, gen) * 3.0;
  const auto labels = at::randint(classes, {n}, gen, at::TensorOptions().dtype(at::kLong));
  const auto inputs = centers.index_select(0, labels) + at::randn({n, dims}, gen);
  return {inputs, labels};
}

at::Tensor classification_loss(torch::nn::Sequential& model, const Dataset& data, bool backward) {
  auto loss = torch::nn::functional::cross_entropy(model->forward(data.inputs), data.labels);
  if (backward) loss.backward();
  return loss;
}

double accuracy(torch::nn::Sequential& model, const Dataset& data) {
  torch::NoGradGuard no_grad;
  const auto predicted = model->forward(data.inputs).argmax(1);
  return predicted.eq(data.labels).to(at::kDouble).mean().item<double>();
}

void run_ranks(int world, const RankFunction& fn, std::chrono::milliseconds timeout,
               bool with_nccl) {
  run_ranks_as_threads(world, fn, timeout, with_nccl);
}

std::string test_name(std::string text) {
  for (auto& ch : text) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return text;
}

void remove_tree(const std::filesystem::path& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(std::filesystem::symlink_status(path, ec))) {
    for (const auto& entry : std::filesystem::directory_iterator(path)) remove_tree(entry.path());
  }
  std::filesystem::remove(path, ec);
}

ShampooOptions read_options(torch::serialize::OutputArchive& archive, ShampooOptions read) {
  std::stringstream bytes;
  archive.save_to(bytes);
  torch::serialize::InputArchive in;
  in.load_from(bytes);
  read.serialize(in);
  return read;
}

ShampooOptions options_round_trip(const ShampooOptions& written) {
  torch::serialize::OutputArchive archive;
  written.serialize(archive);
  return read_options(archive);
}

std::string temp_path(const std::string& name) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string test =
      info != nullptr ? std::string(info->test_suite_name()) + "_" + info->name() : "test";
  for (auto& c : test) {
    if (c == '/') c = '_';
  }
  const auto dir = std::filesystem::temp_directory_path() / "shampoo_tests";
  std::filesystem::create_directories(dir);
  return (dir / (test + "_" + std::to_string(::getpid()) + "_" + name)).string();
}

void expect_error(const std::function<void()>& fn, const std::vector<std::string>& fragments) {
  try {
    fn();
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    for (const auto& f : fragments) {
      EXPECT_NE(message.find(f), std::string::npos)
          << "message '" << message << "' lacks '" << f << "'";
    }
    return;
  }
  ADD_FAILURE() << "no error thrown; expected one mentioning " << fragments.front();
}

}  // namespace shampoo::testing
