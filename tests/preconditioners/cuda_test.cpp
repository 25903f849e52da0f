// The CUDA path against the CPU path (skipped without a GPU): cuSOLVER eigendecompositions
// against torch::linalg_eigh, inverse roots, the whole optimizer on CUDA parameters.
#include <shampoo/shampoo.h>
#include <torch/cuda.h>

#include <cstdio>
#include <functional>

#include "preconditioners/kronecker_contractions.h"
#include "preconditioners/kronecker_factors.h"
#include "support/test_support.h"

#if SHAMPOO_WITH_CUDA
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <limits>

#include "preconditioners/cuda/cuda_eigh.h"
#endif
#include "preconditioners/matrix_functions.h"
#include "shampoo/virtual_group.h"

namespace {

using shampoo::testing::all_close;
using shampoo::testing::bit_equal;

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

#if SHAMPOO_WITH_CUDA
using shampoo::detail::CudaEighMethod;

std::string method_name(CudaEighMethod method) {
  switch (method) {
    case CudaEighMethod::kAuto:
      return "Auto";
    case CudaEighMethod::kBatchedJacobi:
      return "BatchedJacobi";
    case CudaEighMethod::kBatched:
      return "Batched";
    case CudaEighMethod::kBatchedChunks:
      return "BatchedChunks";
    case CudaEighMethod::kSequential:
      return "Sequential";
    case CudaEighMethod::kConcurrent:
      return "Concurrent";
    case CudaEighMethod::kConcurrentStreams:
      return "ConcurrentStreams";
  }
  return "Unknown";
}

using StackCase = std::tuple<int64_t, int64_t, CudaEighMethod>;  // n, d, method

std::string stack_case_name(const ::testing::TestParamInfo<StackCase>& info) {
  const auto [n, d, method] = info.param;
  return std::to_string(n) + "x" + std::to_string(d) + "_" + method_name(method);
}

/// Q·diag(λ)·Qᵀ of every matrix, in float64 on the CPU.
at::Tensor reconstructed(const at::Tensor& eigenvalues, const at::Tensor& eigenvectors) {
  const auto q = eigenvectors.cpu().to(at::kDouble);
  const auto w = eigenvalues.cpu().to(at::kDouble);
  return at::bmm(q * w.unsqueeze(1), q.transpose(1, 2));
}

// Concurrent lanes ≡ divide and conquer one matrix after the other ≡ each matrix alone, bit for
// bit, and right (reconstruction within float32 tolerance).
class CudaEighConcurrent : public ::testing::TestWithParam<StackCase> {};

TEST_P(CudaEighConcurrent, BitForBitOneAtATime) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  const auto [n, d, method] = GetParam();
  const auto a = spd(n, d, at::kFloat).cuda();
  const auto sequential = shampoo::detail::cuda_eigh(a, CudaEighMethod::kSequential);
  const auto concurrent = shampoo::detail::cuda_eigh(a, method);
  EXPECT_TRUE(bit_equal(concurrent.eigenvalues, sequential.eigenvalues));
  EXPECT_TRUE(bit_equal(concurrent.eigenvectors, sequential.eigenvectors));
  for (int64_t i = 0; i < n; ++i) {
    const auto alone = shampoo::detail::cuda_eigh(a.narrow(0, i, 1), CudaEighMethod::kSequential);
    EXPECT_TRUE(concurrent.converged[i]) << "matrix " << i;
    EXPECT_TRUE(bit_equal(concurrent.eigenvalues[i], alone.eigenvalues[0])) << "matrix " << i;
    EXPECT_TRUE(bit_equal(concurrent.eigenvectors[i], alone.eigenvectors[0])) << "matrix " << i;
  }
  EXPECT_TRUE(all_close(reconstructed(concurrent.eigenvalues, concurrent.eigenvectors),
                        a.cpu().to(at::kDouble), {1e-4, 1e-4}));
}

// 10×64: more matrices than lanes, so lanes take several each.
INSTANTIATE_TEST_SUITE_P(Stacks, CudaEighConcurrent,
                         ::testing::Combine(::testing::Values(int64_t{6}),
                                            ::testing::Values(int64_t{256}),
                                            ::testing::Values(CudaEighMethod::kConcurrent,
                                                              CudaEighMethod::kConcurrentStreams)),
                         stack_case_name);
INSTANTIATE_TEST_SUITE_P(LargeStacks, CudaEighConcurrent,
                         ::testing::Values(StackCase{3, 1024, CudaEighMethod::kConcurrent},
                                           StackCase{10, 64, CudaEighMethod::kConcurrent},
                                           StackCase{10, 64, CudaEighMethod::kConcurrentStreams}),
                         stack_case_name);

// The lanes start after the work already queued on the caller's stream: the input is written on
// a side stream behind a ~0.1 s spin kernel, the decomposition issued on it at once.
TEST(CudaEighConcurrentOrder, LanesWaitForTheCallersStream) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  const auto a = spd(4, 128, at::kFloat).cuda();
  const auto expected = shampoo::detail::cuda_eigh(a, CudaEighMethod::kSequential);
  torch::cuda::synchronize();
  const c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromPool());
  auto input = at::full_like(a, std::numeric_limits<float>::quiet_NaN());
  at::cuda::sleep(200'000'000);
  input.copy_(a);
  const auto concurrent = shampoo::detail::cuda_eigh(input, CudaEighMethod::kConcurrent);
  EXPECT_TRUE(bit_equal(concurrent.eigenvalues, expected.eigenvalues));
  EXPECT_TRUE(bit_equal(concurrent.eigenvectors, expected.eigenvectors));
}

// Small stacks through the batched routines, as decompose_cuda uses them: no matrix failed or
// needed the float64 retry, and the results match float64 linalg_eigh within float32 tolerance.
class CudaEighSmall : public ::testing::TestWithParam<StackCase> {};

TEST_P(CudaEighSmall, MatchesLinalgEigh) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  const auto [n, d, method] = GetParam();
  const auto a = spd(n, d, at::kFloat);
  const auto out =
      shampoo::detail::decompose_cuda(a.cuda(), /*retry_double_precision=*/true, method);
  const auto [values, vectors] = at::linalg_eigh(a.to(at::kDouble));
  EXPECT_EQ(out.retried, 0);
  for (int64_t i = 0; i < n; ++i) EXPECT_FALSE(out.failed[i]) << "matrix " << i;
  EXPECT_TRUE(all_close(out.eigenvalues.cpu().to(at::kDouble), values, {1e-4, 1e-5}));
  EXPECT_TRUE(
      all_close(reconstructed(out.eigenvalues, out.eigenvectors), a.to(at::kDouble), {1e-4, 1e-4}));
}

/// A matrix's result does not depend on the rest of its stack: the first 1, 2 and n/2 matrices
/// decomposed on their own give the same bits as in the whole stack.
void expect_independent_of_the_stack(const at::Tensor& a, CudaEighMethod method) {
  const int64_t n = a.size(0);
  const auto whole = shampoo::detail::cuda_eigh(a, method);
  for (const int64_t part : {int64_t{1}, int64_t{2}, n / 2}) {
    const auto some = shampoo::detail::cuda_eigh(a.narrow(0, 0, part), method);
    EXPECT_TRUE(bit_equal(whole.eigenvalues.narrow(0, 0, part), some.eigenvalues))
        << "first " << part << " of " << n;
    EXPECT_TRUE(bit_equal(whole.eigenvectors.narrow(0, 0, part), some.eigenvectors))
        << "first " << part << " of " << n;
  }
}

TEST_P(CudaEighSmall, PerMatrixIndependentOfTheStack) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  const auto [n, d, method] = GetParam();
  expect_independent_of_the_stack(spd(n, d, at::kFloat).cuda(), method);
}

INSTANTIATE_TEST_SUITE_P(Stacks, CudaEighSmall,
                         ::testing::Combine(::testing::Values(int64_t{256}, int64_t{64}),
                                            ::testing::Values(int64_t{16}, int64_t{32}),
                                            ::testing::Values(CudaEighMethod::kAuto,
                                                              CudaEighMethod::kBatched,
                                                              CudaEighMethod::kBatchedJacobi)),
                         stack_case_name);

// Larger blocks: right, and independent of the stack, except XsyevBatched on whole stacks: on an
// H100 with CUDA 13 its results for a matrix differed (up to 3e-4 in float32 eigenvectors of
// 1024×1024) between batches of 1, 2 and 5, which is why kAuto does not use it.
class CudaEighLarge : public ::testing::TestWithParam<StackCase> {};

TEST_P(CudaEighLarge, RightAndIndependentOfTheStack) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  const auto [n, d, method] = GetParam();
  const auto a = spd(n, d, at::kFloat);
  if (method != CudaEighMethod::kBatched) expect_independent_of_the_stack(a.cuda(), method);
  const auto out = shampoo::detail::decompose_cuda(a.cuda(), true, method);
  const auto [values, vectors] = at::linalg_eigh(a.to(at::kDouble));
  EXPECT_EQ(out.retried, 0);
  EXPECT_TRUE(all_close(out.eigenvalues.cpu().to(at::kDouble), values, {1e-4, 1e-5}));
  EXPECT_TRUE(
      all_close(reconstructed(out.eigenvalues, out.eigenvectors), a.to(at::kDouble), {1e-4, 1e-4}));
}

INSTANTIATE_TEST_SUITE_P(Stacks, CudaEighLarge,
                         ::testing::Values(StackCase{9, 64, CudaEighMethod::kBatched},
                                           StackCase{16, 256, CudaEighMethod::kBatched},
                                           StackCase{5, 1024, CudaEighMethod::kBatched},
                                           StackCase{16, 256, CudaEighMethod::kAuto},
                                           StackCase{5, 1024, CudaEighMethod::kAuto}),
                         stack_case_name);

// XsyevBatched in chunks of a fixed size: a matrix gives the same bits in a full chunk decomposed
// in place, in the padded last chunk, alone (padded), and at another position of another chunk.
class CudaEighBatchedChunks : public ::testing::TestWithParam<int64_t> {};

TEST_P(CudaEighBatchedChunks, IndependentOfTheStackAndRight) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t d = GetParam();
  const int64_t chunk = shampoo::detail::kBatchedChunk;
  const int64_t n = chunk + 3;
  const auto a = spd(n, d, at::kFloat);
  const auto whole = shampoo::detail::cuda_eigh(a.cuda(), CudaEighMethod::kBatchedChunks);
  auto expect_rows = [&](int64_t first, int64_t count) {
    const auto part = shampoo::detail::cuda_eigh(a.narrow(0, first, count).cuda(),
                                                 CudaEighMethod::kBatchedChunks);
    EXPECT_TRUE(bit_equal(whole.eigenvalues.narrow(0, first, count), part.eigenvalues))
        << "rows " << first << " to " << first + count - 1 << " of " << n;
    EXPECT_TRUE(bit_equal(whole.eigenvectors.narrow(0, first, count), part.eigenvectors))
        << "rows " << first << " to " << first + count - 1 << " of " << n;
  };
  expect_rows(0, 1);          // first of a full chunk, alone
  expect_rows(chunk + 1, 1);  // in the padded chunk, alone
  expect_rows(3, chunk);      // a full chunk shifted by 3: both chunks' matrices move
  for (int64_t i = 0; i < n; ++i) EXPECT_TRUE(whole.converged[i]) << "matrix " << i;
  EXPECT_TRUE(all_close(reconstructed(whole.eigenvalues, whole.eigenvectors), a.to(at::kDouble),
                        {1e-4, 1e-4}));
}

INSTANTIATE_TEST_SUITE_P(Sizes, CudaEighBatchedChunks,
                         ::testing::Values(int64_t{16}, int64_t{64}, int64_t{256}, int64_t{1024}));

// Entries up to near float32's largest: whatever the float32 pass gives, the result
// decompose_cuda hands back (in float32 or from the float64 retry) is right. At 1e38 the float32
// pass is not usable (its results, or their sums, overflow float32), so this exercises the retry.
TEST(CudaEighRetry, HugeEntriesEndRight) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  for (const double scale : {1e30, 1e38}) {
    for (const int64_t d : {16, 64}) {
      auto a = spd(4, d, at::kDouble);
      a[1].mul_(scale);
      const auto a32 = a.to(at::kFloat);
      ASSERT_TRUE(at::isfinite(a32).all().item<bool>());
      const auto out = shampoo::detail::decompose_cuda(a32.cuda(), true);
      const auto [values, vectors] = at::linalg_eigh(a32.to(at::kDouble));
      for (int64_t i = 0; i < 4; ++i) {
        ASSERT_FALSE(out.failed[i]) << "scale " << scale << " d " << d << " matrix " << i;
        const auto got = out.in_double[i] ? out.eigenvalues_double[i].cpu()
                                          : out.eigenvalues[i].cpu().to(at::kDouble);
        const auto norm = values[i].abs().max();
        EXPECT_TRUE(all_close(got / norm, values[i] / norm, {1e-4, 1e-5}))
            << "scale " << scale << " d " << d << " matrix " << i
            << " in float64: " << out.in_double[i];
      }
      if (scale > 1e37) {
        EXPECT_TRUE(out.in_double[1]) << "d " << d << ": the float64 retry was not exercised";
      }
    }
  }
}
#endif

// The acceptance rule of decompose_cuda, on the CPU: an accurate decomposition reported as not
// converged is used; an inaccurate one, one with eigenvalues out of order, a non-finite one are
// not.
TEST(CudaEighUsable, AcceptsAccurateUnconvergedOnly) {
#if !SHAMPOO_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  const int64_t d = 12;
  const auto a = spd(5, d, at::kFloat);
  auto [values, vectors] = at::linalg_eigh(a);
  shampoo::detail::CudaEighResult r;
  r.eigenvalues = values.clone();
  r.eigenvectors = vectors.clone();
  r.info = at::tensor({0, 1, 1, 1, 0}, at::TensorOptions().dtype(at::kInt));
  r.eigenvectors[2][0][0].add_(1e-2);
  r.eigenvalues[3].copy_(values[3].flip(0));
  r.eigenvectors[3].copy_(vectors[3].flip(1));
  r.eigenvalues[4][0].fill_(std::numeric_limits<float>::quiet_NaN());
  const auto usable = shampoo::detail::usable_decompositions(a, r);
  EXPECT_EQ(usable, (std::vector<bool>{true, true, false, false, false}));
#endif
}

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
  const auto options = shampoo::ShampooOptions::reference_defaults(0.01)
                           .epsilon(1e-4)
                           .precondition_frequency(2)
                           .grafting(shampoo::AdamGraftingConfig{})
                           .momentum(0.5);
  shampoo::DistributedShampoo cpu_opt(cpu_model->parameters(), options);
  shampoo::DistributedShampoo gpu_opt(gpu_model->parameters(), options);
  std::vector<at::Tensor> initial;
  for (const auto& p : cpu_model->parameters()) initial.push_back(p.detach().clone());
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
  // cuSOLVER's and LAPACK's eigenvectors, and the two matmul orders, differ in their last bits;
  // the roots (ε 1e-4 on factors of five 64-sample gradients) amplify that. So the criterion is
  // relative to how far the parameters travelled: a wrong update is off by a fraction of the
  // travel, rounding by ~1e-6 of it. Seen on an H200, 2026-11-26: 1.4e-5 on a travel of ~0.05
  // (an elementwise atol of 1e-5 failed on one element).
  const auto a = cpu_model->parameters();
  const auto b = gpu_model->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    const double travel = (a[i] - initial[i]).abs().max().item<double>();
    const double error = (b[i].cpu() - a[i]).abs().max().item<double>();
    EXPECT_GT(travel, 0.0) << "parameter " << i;
    EXPECT_LE(error, 1e-3 * travel)
        << "parameter " << i << ": max |GPU - CPU| " << error << ", max travel " << travel;
  }
}

/// Parameters after 5 steps of Shampoo (lr 0.01, ε 1e-4, f = 2, blocks of 8, Adam grafting, plus
/// `extra`) on a small MLP on `device`.
std::vector<at::Tensor> train_small_mlp(
    const at::Device& device,
    const std::function<void(shampoo::ShampooOptions&)>& extra = [](shampoo::ShampooOptions&) {}) {
  auto model = shampoo::testing::make_mlp(6, 16, 3, 1);
  model->to(device);
  auto options = shampoo::ShampooOptions::reference_defaults(0.01)
                     .epsilon(1e-4)
                     .precondition_frequency(2)
                     .max_preconditioner_dim(8)
                     .grafting(shampoo::AdamGraftingConfig{});
  extra(options);
  shampoo::DistributedShampoo opt(model->parameters(), options);
  const auto data = shampoo::testing::make_blobs(64, 6, 3, 2);
  const shampoo::testing::Dataset on_device{data.inputs.to(device), data.labels.to(device)};
  for (int step = 0; step < 5; ++step) {
    opt.zero_grad();
    shampoo::testing::classification_loss(model, on_device, true);
    opt.step();
  }
  return shampoo::testing::snapshot(model->parameters());
}

/// Every parameter of `a` within float32 tolerance of `b`'s.
void expect_close_parameters(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(all_close(a[i].cpu(), b[i].cpu(), {1e-5, 1e-6})) << "parameter " << i;
  }
}

TEST(CudaOptimizer, StepChunksDoNotChangeTheResult) {
  // The step in chunks of rows (here one row per chunk) against one chunk, on the GPU: the
  // batched kernels see fewer rows at a time; the results agree within float32 tolerance.
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  const auto run = [](int64_t chunk_bytes) {
    shampoo::detail::set_step_chunk_bytes_for_testing(chunk_bytes);
    auto result =
        train_small_mlp(at::kCUDA, [](shampoo::ShampooOptions& options) { options.momentum(0.5); });
    shampoo::detail::set_step_chunk_bytes_for_testing(0);
    return result;
  };
  expect_close_parameters(run(1), run(0));
}

/// train_small_mlp with the factor updates' outer products bounded by `chunk_bytes` (0 = the
/// default 8 MiB; 1 = one block at a time).
std::vector<at::Tensor> run_with_factor_chunks(const at::Device& device, int64_t chunk_bytes) {
  shampoo::detail::set_factor_update_chunk_bytes_for_benchmarks(chunk_bytes);
  auto result = train_small_mlp(device);
  shampoo::detail::set_factor_update_chunk_bytes_for_benchmarks(0);
  return result;
}

TEST(FactorUpdateChunks, DoNotChangeTheResultOnTheCpu) {
  // Every block's outer product is computed on its own on the CPU: bit for bit.
  const auto whole = run_with_factor_chunks(at::kCPU, 0);
  const auto one_by_one = run_with_factor_chunks(at::kCPU, 1);
  for (size_t i = 0; i < whole.size(); ++i) {
    EXPECT_TRUE(bit_equal(one_by_one[i], whole[i])) << "parameter " << i;
  }
}

TEST(CudaOptimizer, FactorUpdateChunksAgreeWithinTolerance) {
  // On the GPU the batched products see fewer blocks at a time (and may round differently).
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  expect_close_parameters(run_with_factor_chunks(at::kCUDA, 1),
                          run_with_factor_chunks(at::kCUDA, 0));
}

/// The stacked outer product along `dim` in float64 on the CPU, one block at a time.
at::Tensor outer_reference(const at::Tensor& blocks, int64_t dim) {
  const auto x = blocks.to(at::kCPU, at::kDouble);
  const int64_t n = x.size(0);
  const int64_t d = x.size(dim + 1);
  const auto m = x.movedim(dim + 1, 1).reshape({n, d, -1});
  return at::bmm(m, m.transpose(1, 2));
}

TEST(CudaContractions, LowerOuterProductsMatchTheFullProductOnAndBelowTheDiagonal) {
  // Factor updates read the lower triangle only; on CUDA its blocks come from two products (3/4
  // of the multiplications) for dims of 256 and up, and from the full product below.
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(11);
  const std::vector<std::vector<int64_t>> shapes{
      {3, 300, 200}, {2, 1024, 256}, {2, 512, 64}, {2, 260, 3, 300}, {1, 255}};
  for (const auto& shape : shapes) {
    for (const auto dtype : {at::kFloat, at::kDouble}) {
      const auto blocks = at::randn(shape, at::TensorOptions().dtype(dtype).device(at::kCUDA));
      for (int64_t dim = 0; dim + 1 < static_cast<int64_t>(shape.size()); ++dim) {
        const auto lower = shampoo::detail::stacked_outer_product_lower(blocks, dim);
        const auto expected = outer_reference(blocks, dim);
        const int64_t d = shape[dim + 1];
        ASSERT_EQ(lower.sizes(), expected.sizes());
        const auto mask = at::ones({d, d}, at::kBool).tril();
        const auto ours = at::where(mask, lower.to(at::kCPU, at::kDouble), 0.0);
        const auto reference = at::where(mask, expected, 0.0);
        const double scale = reference.abs().max().item<double>();
        const double error = (ours - reference).abs().max().item<double>();
        EXPECT_LE(error, (dtype == at::kFloat ? 1e-5 : 1e-12) * scale)
            << "shape " << at::IntArrayRef(shape) << ", dim " << dim << ", " << dtype;
      }
    }
  }
}

#if SHAMPOO_WITH_CUDA
/// Counts the host's synchronizations with the GPU while it lives: LibTorch's sync debug mode
/// (torch.cuda.set_sync_debug_mode) warns at each, and a warning handler counts those warnings.
class SyncCounter : public c10::WarningHandler {
 public:
  SyncCounter() : guard_(this) {
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
  }
  ~SyncCounter() override {
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
  }
  void process(const c10::Warning& warning) override {
    if (warning.msg().find("synchroniz") != std::string::npos) ++count_;
  }
  int count() const { return count_; }

 private:
  c10::WarningUtils::WarningHandlerGuard guard_;
  int count_ = 0;
};
#endif

TEST(CudaOptimizer, PlainStepSynchronizesWithTheHostOnce) {
  // Regression: per-row scalars copied from pageable memory made the host wait for the stream
  // in every factor update (10 waits per plain step of bench_transformer), and so did the
  // grafting norms; the GPU idled while the host prepared the next launches. Left: the max-|G|
  // check, which must finish before anything changes.
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
#if SHAMPOO_WITH_CUDA
  auto model = shampoo::testing::make_mlp(6, 16, 3, 1);
  model->to(torch::kCUDA);
  shampoo::DistributedShampoo opt(
      model->parameters(),
      shampoo::ShampooOptions::reference_defaults(0.01).epsilon(1e-4).momentum(0.5).precondition_frequency(50));
  const auto data = shampoo::testing::make_blobs(64, 6, 3, 2);
  const shampoo::testing::Dataset gpu_data{data.inputs.cuda(), data.labels.cuda()};
  int plain_steps = 0;
  for (int step = 0; step < 4; ++step) {
    opt.zero_grad();
    shampoo::testing::classification_loss(model, gpu_data, true);
    const auto roots = opt.stats().amortized_computations;
    int syncs = 0;
    {
      SyncCounter counter;
      opt.step();
      syncs = counter.count();
    }
    if (opt.stats().amortized_computations != roots) continue;  // a root step may wait more
    ++plain_steps;
    EXPECT_EQ(syncs, 1) << "step " << step + 1;
  }
  EXPECT_GE(plain_steps, 3);
#endif
}

TEST(CudaOptimizer, CheckpointLoadedOntoTheGpuResumesTheRun) {
  // Regression: an archive loaded with a CUDA map location holds every tensor on the GPU, the
  // parameter shapes included; the load read those on the host (a segfault in the trainer's
  // resume on CUDA).
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  auto model = shampoo::testing::make_mlp(6, 16, 3, 1);
  model->to(torch::kCUDA);
  const auto options = shampoo::ShampooOptions::reference_defaults(0.01).epsilon(1e-4).precondition_frequency(2);
  shampoo::DistributedShampoo opt(model->parameters(), options);
  const auto data = shampoo::testing::make_blobs(64, 6, 3, 2);
  const shampoo::testing::Dataset gpu_data{data.inputs.cuda(), data.labels.cuda()};
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    shampoo::testing::classification_loss(model, gpu_data, true);
    opt.step();
  }
  const auto path = shampoo::testing::temp_path("cuda_opt.pt");
  {
    torch::serialize::OutputArchive archive;
    opt.save(archive);
    archive.save_to(path);
  }
  shampoo::DistributedShampoo resumed(model->parameters(), options);
  torch::serialize::InputArchive archive;
  archive.load_from(path, torch::Device(torch::kCUDA));
  resumed.load(archive);
  EXPECT_EQ(resumed.group_step(0), 3);
  std::remove(path.c_str());
}

}  // namespace
