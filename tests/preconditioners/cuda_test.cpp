// The CUDA path against the CPU path (skipped without a GPU): cuSOLVER eigendecompositions
// against torch::linalg_eigh, inverse roots, the whole optimizer on CUDA parameters.
#include <shampoo/shampoo.h>
#include <torch/cuda.h>

#include "support/test_support.h"

#if SHAMPOO_WITH_CUDA
#include "preconditioners/cuda/cuda_eigh.h"
#endif
#include "preconditioners/matrix_functions.h"

namespace {

using shampoo::testing::all_close;

bool has_gpu() { return torch::cuda::is_available(); }

at::Tensor spd(int64_t n, int64_t d, at::ScalarType dtype) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(d);
  const auto g = at::randn({n, d, 2 * d}, gen, at::TensorOptions().dtype(at::kDouble));
  return (at::bmm(g, g.transpose(1, 2)) / (2.0 * d) + 0.1 * at::eye(d, at::kDouble)).to(dtype);
}

class CudaEigh : public ::testing::TestWithParam<std::tuple<int64_t, at::ScalarType>> {};

TEST_P(CudaEigh, MatchesLinalgEigh) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
#if !SHAMPOO_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  const auto [d, dtype] = GetParam();
  const auto a = spd(6, d, dtype);
  const auto result = shampoo::detail::cuda_eigh(a.cuda());
  const auto [values, vectors] = at::linalg_eigh(a);
  for (int64_t i = 0; i < 6; ++i) {
    EXPECT_TRUE(result.converged[i]);
    EXPECT_TRUE(all_close(result.eigenvalues[i].cpu(), values[i], {1e-4, 1e-5}));
    // Eigenvectors up to sign: reconstruct A.
    const auto q = result.eigenvectors[i].cpu().to(at::kDouble);
    const auto back = at::matmul(q * result.eigenvalues[i].cpu().to(at::kDouble), q.t());
    EXPECT_TRUE(all_close(back, a[i].to(at::kDouble), {1e-4, 1e-4}));
  }
#endif
}

INSTANTIATE_TEST_SUITE_P(Sizes, CudaEigh,
                         ::testing::Combine(::testing::Values(int64_t{8}, int64_t{32}, int64_t{33},
                                                              int64_t{200}),
                                            ::testing::Values(at::kFloat, at::kDouble)));

TEST(CudaRoots, InverseRootMatchesCpu) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  for (const int64_t d : {16, 100}) {
    const auto a = spd(4, d, at::kFloat);
    const std::vector<double> eps(4, 1e-6), exps(4, 0.25);
    const auto cpu = shampoo::detail::stacked_inverse_root(a, eps, exps, true);
    const auto gpu = shampoo::detail::stacked_inverse_root(a.cuda(), eps, exps, true);
    EXPECT_TRUE(all_close(gpu.values.cpu(), cpu.values, {1e-4, 1e-5})) << "d " << d;
  }
}

TEST(CudaOptimizer, MatchesCpuWithinTolerance) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  auto cpu_model = shampoo::testing::make_mlp(6, 16, 3, 1);
  auto gpu_model = shampoo::testing::make_mlp(6, 16, 3, 1);
  gpu_model->to(torch::kCUDA);
  const auto options = shampoo::ShampooOptions(0.01)
                           .epsilon(1e-4)
                           .precondition_frequency(2)
                           .grafting(shampoo::AdamGraftingConfig{})
                           .momentum(0.5);
  shampoo::DistributedShampoo cpu_opt(cpu_model->parameters(), options);
  shampoo::DistributedShampoo gpu_opt(gpu_model->parameters(), options);
  const auto data = shampoo::testing::make_blobs(64, 6, 3, 2);
  const shampoo::testing::Dataset gpu_data{data.inputs.cuda(), data.labels.cuda()};
  for (int step = 0; step < 5; ++step) {
    cpu_opt.zero_grad();
    gpu_opt.zero_grad();
    shampoo::testing::classification_loss(cpu_model, data, true);
    shampoo::testing::classification_loss(gpu_model, gpu_data, true);
    cpu_opt.step();
    gpu_opt.step();
  }
  const auto a = cpu_model->parameters();
  const auto b = gpu_model->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(all_close(b[i].cpu(), a[i], {1e-4, 1e-5})) << "parameter " << i;
  }
}

}  // namespace
