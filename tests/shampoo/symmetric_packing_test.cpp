// use_symmetric_packing (the default): every Kronecker family keeps its factors (and root-inverse
// its inverse roots) as packed upper triangles, with the same results as dense storage bit for
// bit: merged groups, in-backward steps, checkpoints saved in one layout and resumed in the
// other. The distributed case is in tests/distributor (PackedWorldEqualsDenseSingle).
#include <shampoo/shampoo.h>
#include <torch/serialize.h>

#include <sstream>
#include <string>
#include <vector>

#include "shampoo/storage_test_support.h"
#include "support/test_support.h"

namespace {

using shampoo::DistributedShampoo;
using shampoo::ShampooOptions;
using shampoo::testing::bit_equal;
using shampoo::testing::snapshot;

using Family = shampoo::testing::storage::NamedOptions;

std::vector<Family> families() {
  const auto base = ShampooOptions::reference_defaults(0.02)
                        .betas({0.9, 0.99})
                        .epsilon(1e-6)
                        .precondition_frequency(2)
                        .max_preconditioner_dim(8)
                        .grafting(shampoo::AdamGraftingConfig{0.99, 1e-8});
  auto with = [&](shampoo::PreconditionerConfig p) {
    return ShampooOptions(base).preconditioner(p);
  };
  return {
      {"root_inverse_eigh", base},
      {"root_inverse_coupled_newton",
       with(shampoo::RootInvShampooConfig{.solver = shampoo::RootSolver::kCoupledNewton})},
      {"root_inverse_newton_db",
       with(shampoo::RootInvShampooConfig{.solver = shampoo::RootSolver::kNewtonDB})},
      {"root_inverse_pseudo_inverse",
       with(shampoo::RootInvShampooConfig{.rank_deficient_stability =
                                              shampoo::PseudoInverseConfig{.rank_rtol = 1e-5}})
           .epsilon(0.0)},
      {"root_inverse_kl", with(shampoo::RootInvKLShampooConfig{})},
      {"eigendecomposed", with(shampoo::EigendecomposedShampooConfig{})},
      {"eigendecomposed_qr", with(shampoo::EigendecomposedShampooConfig{
                                 .eigenbasis_method = shampoo::EigenbasisMethod::kQR})},
      {"eigendecomposed_kl", with(shampoo::EigendecomposedKLShampooConfig{})},
      {"eigenvalue_corrected", with(shampoo::EigenvalueCorrectedShampooConfig{})},
      {"eigenvalue_corrected_qr",
       with(shampoo::EigenvalueCorrectedShampooConfig{shampoo::EigenbasisMethod::kQR, false})},
      {"root_inverse_double_factors", ShampooOptions(base).factor_matrix_dtype(at::kDouble)},
  };
}

using shampoo::testing::storage::make_groups;
using shampoo::testing::storage::make_params;
using shampoo::testing::storage::step;

class SymmetricPacking : public ::testing::TestWithParam<Family> {};

TEST_P(SymmetricPacking, PackedEqualsDenseBitForBitAndHalvesTheMatrices) {
  const auto& f = GetParam();
  ASSERT_TRUE(f.options.use_symmetric_packing());  // the default
  const auto dense_options = ShampooOptions(f.options).use_symmetric_packing(false);
  auto packed_params = make_params();
  auto dense_params = make_params();
  DistributedShampoo packed(make_groups(packed_params, f.options), f.options);
  DistributedShampoo dense(make_groups(dense_params, dense_options), dense_options);
  EXPECT_EQ(packed.stats().virtual_groups, 1);
  for (int t = 1; t <= 7; ++t) {
    step(packed, packed_params, t);
    step(dense, dense_params, t);
    ASSERT_TRUE(bit_equal(snapshot(packed_params), snapshot(dense_params)))
        << f.name << " step " << t;
  }
  EXPECT_LT(packed.stats().state_bytes, dense.stats().state_bytes);
  EXPECT_EQ(packed.stats().failed_amortized_computations,
            dense.stats().failed_amortized_computations);
}

TEST_P(SymmetricPacking, CheckpointsResumeInEitherLayoutBitForBit) {
  const auto& f = GetParam();
  for (const bool saved_packed : {true, false}) {
    const auto save_options = ShampooOptions(f.options).use_symmetric_packing(saved_packed);
    auto params = make_params();
    DistributedShampoo uninterrupted(make_groups(params, save_options), save_options);
    for (int t = 1; t <= 3; ++t) step(uninterrupted, params, t);
    std::stringstream buffer;
    {
      torch::serialize::OutputArchive archive;
      uninterrupted.save(archive);
      archive.save_to(buffer);
    }
    const auto at_save = snapshot(params);
    for (int t = 4; t <= 6; ++t) step(uninterrupted, params, t);

    for (const bool load_packed : {true, false}) {
      const auto load_options = ShampooOptions(f.options).use_symmetric_packing(load_packed);
      std::vector<at::Tensor> resumed_params;
      for (const auto& p : at_save) resumed_params.push_back(p.clone().requires_grad_());
      DistributedShampoo resumed(make_groups(resumed_params, load_options), load_options);
      torch::serialize::InputArchive archive;
      std::stringstream copy(buffer.str());
      archive.load_from(copy);
      resumed.load(archive);
      for (int t = 4; t <= 6; ++t) step(resumed, resumed_params, t);
      EXPECT_TRUE(bit_equal(snapshot(resumed_params), snapshot(params)))
          << f.name << ": saved " << (saved_packed ? "packed" : "dense") << ", resumed "
          << (load_packed ? "packed" : "dense");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(KroneckerFamilies, SymmetricPacking, ::testing::ValuesIn(families()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
