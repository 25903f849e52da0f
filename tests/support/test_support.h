#pragma once
/// Helpers shared by the test suites: the tolerances of docs/math.md (one helper, messages with
/// the largest errors and where), small deterministic models and data.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "shampoo/shampoo_options.h"
#include "support/rank_threads.h"

namespace shampoo::testing {

/// rtol/atol of torch.testing for a dtype (docs/math.md "Tolerances").
struct Tolerance {
  double rtol;
  double atol;
};
Tolerance tolerance_for(at::ScalarType dtype);

/// |actual − expected| ≤ atol + rtol·|expected| everywhere; the failure message gives the
/// largest absolute and relative errors and the index where they occur.
::testing::AssertionResult all_close(const at::Tensor& actual, const at::Tensor& expected,
                                     Tolerance tolerance);
::testing::AssertionResult all_close(const at::Tensor& actual, const at::Tensor& expected);
/// Bit-for-bit equality (same dtype, shape and bytes); the message says where they differ.
::testing::AssertionResult bit_equal(const at::Tensor& actual, const at::Tensor& expected);
::testing::AssertionResult bit_equal(const std::vector<at::Tensor>& actual,
                                     const std::vector<at::Tensor>& expected);

/// Runs `fn` and expects a c10::Error whose message contains every fragment (a test failure
/// naming the message and the missing fragment otherwise).
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& fragments);

/// Sets every parameter's gradient to fixed random values drawn from `seed`.
void set_random_grads(const std::vector<at::Tensor>& params, uint64_t seed);

/// Detached copies of the tensors' current values.
std::vector<at::Tensor> snapshot(const std::vector<at::Tensor>& tensors);

/// Deep copies of tensors (detached, with requires_grad as in the source).
std::vector<at::Tensor> clone_params(const std::vector<at::Tensor>& params);

/// A small MLP (in -> hidden -> hidden -> classes, tanh) with a fixed seed (thread-safe).
torch::nn::Sequential make_mlp(int64_t in, int64_t hidden, int64_t classes, uint64_t seed);

/// A fixed synthetic classification task: `n` points in `dims` dims, `classes` Gaussian blobs.
struct Dataset {
  at::Tensor inputs;
  at::Tensor labels;
};
Dataset make_blobs(int64_t n, int64_t dims, int64_t classes, uint64_t seed);

/// Cross-entropy of a model on a batch; backward() already called when `backward` is set.
at::Tensor classification_loss(torch::nn::Sequential& model, const Dataset& data, bool backward);

/// Fraction of correctly classified points.
double accuracy(torch::nn::Sequential& model, const Dataset& data);

/// Runs fn(rank, group) on `world` threads, each with its own Gloo process group over one shared
/// in-memory store (ranks as threads, one process: run_ranks_as_threads). Waits for all;
/// rethrows the first failure with its rank. `timeout` bounds every collective. With `with_nccl`
/// the groups also have an NCCL backend for CUDA tensors (NCCL wants one GPU per rank).
void run_ranks(int world, const RankFunction& fn,
               std::chrono::milliseconds timeout = std::chrono::seconds(60),
               bool with_nccl = false);

/// `text` as a gtest parameter name: every character other than a letter or digit becomes '_'.
std::string test_name(std::string text);

/// Removes `path` and everything under it (std::filesystem::remove_all crashes when called from
/// here: the torch wheel's libtorch.so exports its own copy).
void remove_tree(const std::filesystem::path& path);

/// A temporary file path unique to the test (removed by the caller or at exit).
std::string temp_path(const std::string& name);

/// The options `archive` holds, read into `read` (entries the archive lacks keep read's values),
/// through the bytes a checkpoint file would hold.
ShampooOptions read_options(torch::serialize::OutputArchive& archive, ShampooOptions read = {});
/// `written` serialized and read back into default options.
ShampooOptions options_round_trip(const ShampooOptions& written);

}  // namespace shampoo::testing
