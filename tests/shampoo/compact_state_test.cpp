// compact_state (opt-in): the inverse roots in bfloat16 or 8 bits, the grafting second moment, the
// filtered gradient and momentum in bfloat16 with stochastic rounding. The state shrinks by the
// expected factors (memory_summary()); training stays close to the float32 state; and the
// equivalences hold bit for bit within a compact setting: merged ≡ unmerged, resumed ≡
// uninterrupted, checkpoints load across settings. World 2 ≡ one process is in tests/distributor,
// in-backward in tests/parallel, failed steps in failed_step_test.
#include <shampoo/shampoo.h>
#include <torch/serialize.h>

#include <sstream>
#include <string>
#include <vector>

#include "shampoo/storage_test_support.h"
#include "support/test_support.h"

namespace {

using shampoo::CompactState;
using shampoo::DistributedOptions;
using shampoo::DistributedShampoo;
using shampoo::ShampooOptions;
using shampoo::testing::bit_equal;
using shampoo::testing::snapshot;

using Case = shampoo::testing::storage::NamedOptions;

// ε 1e-2: a compact state perturbs the preconditioner's input and roots by ~2^-9 (bfloat16) or
// ~2^-7 (8 bits) relative, and a preconditioner amplifies perturbations outside its factor's
// range by up to ε^(-exponent). These blocks see 8 gradients, so their factors are rank
// deficient; at ε 1e-6 the compact runs moved 37–49% of the travel away from float32, at 1e-3
// 2–6%, at 1e-2 0.8–1.3% (docs/math.md#compact-state).
ShampooOptions base_options() {
  return ShampooOptions::reference_defaults(0.02)
      .betas({0.9, 0.99})
      .epsilon(1e-2)
      .momentum(0.5)
      .precondition_frequency(2)
      .max_preconditioner_dim(8)
      .grafting(shampoo::AdamGraftingConfig{0.99, 1e-8});
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const auto compact : {CompactState::kBfloat16, CompactState::kInt8}) {
    const std::string suffix = compact == CompactState::kInt8 ? "_int8" : "_bf16";
    const auto base = base_options().compact_state(compact);
    out.push_back({"root_inverse" + suffix, base});
    out.push_back(
        {"root_inverse_dense" + suffix, ShampooOptions(base).use_symmetric_packing(false)});
    out.push_back({"root_inverse_kl" + suffix,
                   ShampooOptions(base).preconditioner(shampoo::RootInvKLShampooConfig{})});
    out.push_back({"root_inverse_double_factors" + suffix,
                   ShampooOptions(base).factor_matrix_dtype(at::kDouble)});
    out.push_back({"eigendecomposed" + suffix,
                   ShampooOptions(base).preconditioner(shampoo::EigendecomposedShampooConfig{})});
  }
  return out;
}

using shampoo::testing::storage::make_groups;
using shampoo::testing::storage::make_params;
using shampoo::testing::storage::step;

std::string saved(const DistributedShampoo& opt) {
  std::stringstream buffer;
  torch::serialize::OutputArchive archive;
  opt.save(archive);
  archive.save_to(buffer);
  return buffer.str();
}

void load(DistributedShampoo& opt, const std::string& bytes) {
  torch::serialize::InputArchive archive;
  std::stringstream copy(bytes);
  archive.load_from(copy);
  opt.load(archive);
}

class CompactStates : public ::testing::TestWithParam<Case> {};

TEST_P(CompactStates, MergedEqualsUnmergedBitForBit) {
  const auto& c = GetParam();
  auto merged_params = make_params();
  auto unmerged_params = make_params();
  DistributedShampoo merged(make_groups(merged_params, c.options), c.options);
  DistributedShampoo unmerged(make_groups(unmerged_params, c.options), c.options,
                              DistributedOptions().merge_param_groups(false));
  ASSERT_EQ(merged.stats().virtual_groups, 1);
  ASSERT_EQ(unmerged.stats().virtual_groups, 3);
  for (int t = 1; t <= 6; ++t) {
    step(merged, merged_params, t);
    step(unmerged, unmerged_params, t);
    ASSERT_TRUE(bit_equal(snapshot(merged_params), snapshot(unmerged_params)))
        << c.name << " step " << t;
  }
}

TEST_P(CompactStates, ResumedEqualsUninterruptedBitForBit) {
  const auto& c = GetParam();
  auto params = make_params();
  DistributedShampoo uninterrupted(make_groups(params, c.options), c.options);
  for (int t = 1; t <= 3; ++t) step(uninterrupted, params, t);
  const auto checkpoint = saved(uninterrupted);
  const auto at_save = snapshot(params);
  for (int t = 4; t <= 7; ++t) step(uninterrupted, params, t);

  std::vector<at::Tensor> resumed_params;
  for (const auto& p : at_save) resumed_params.push_back(p.clone().requires_grad_());
  DistributedShampoo resumed(make_groups(resumed_params, c.options), c.options);
  load(resumed, checkpoint);
  EXPECT_EQ(saved(resumed), checkpoint) << c.name << ": the state changed in a save-load cycle";
  for (int t = 4; t <= 7; ++t) step(resumed, resumed_params, t);
  EXPECT_TRUE(bit_equal(snapshot(resumed_params), snapshot(params))) << c.name;
}

TEST_P(CompactStates, CheckpointsLoadAcrossSettings) {
  // A float32 checkpoint continues compactly and a compact one in float32: over two steps each
  // resumed run stays close to the run that saved it (the compact side rounds), and differs.
  const auto& c = GetParam();
  const auto full = ShampooOptions(c.options).compact_state(CompactState::kNone);
  for (const bool save_compact : {true, false}) {
    const auto& save_options = save_compact ? c.options : full;
    const auto& load_options = save_compact ? full : c.options;
    auto params = make_params();
    DistributedShampoo saver(make_groups(params, save_options), save_options);
    for (int t = 1; t <= 3; ++t) step(saver, params, t);
    const auto checkpoint = saved(saver);
    const auto at_save = snapshot(params);
    for (int t = 4; t <= 5; ++t) step(saver, params, t);

    std::vector<at::Tensor> loaded_params;
    for (const auto& p : at_save) loaded_params.push_back(p.clone().requires_grad_());
    DistributedShampoo loader(make_groups(loaded_params, load_options), load_options);
    load(loader, checkpoint);
    for (int t = 4; t <= 5; ++t) step(loader, loaded_params, t);
    const auto a = snapshot(loaded_params);
    const auto b = snapshot(params);
    double travel = 0, difference = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      travel = std::max(travel, (b[i] - at_save[i]).abs().max().item<double>());
      difference = std::max(difference, (a[i] - b[i]).abs().max().item<double>());
    }
    EXPECT_GT(difference, 0.0) << c.name << ": the compact state rounded nothing";
    EXPECT_LT(difference, 0.05 * travel)
        << c.name << (save_compact ? ": compact → float32" : ": float32 → compact");
  }
}

TEST_P(CompactStates, ShrinksTheStateAndTrainsCloseToFloat32) {
  const auto& c = GetParam();
  const auto full = ShampooOptions(c.options).compact_state(CompactState::kNone);
  auto params = make_params();
  auto full_params = make_params();
  DistributedShampoo compact(make_groups(params, c.options), c.options);
  DistributedShampoo reference(make_groups(full_params, full), full);
  const auto at_start = snapshot(params);
  for (int t = 1; t <= 8; ++t) {
    step(compact, params, t);
    step(reference, full_params, t);
  }
  const auto m = compact.memory_summary();
  const auto r = reference.memory_summary();
  // The first-order states in bfloat16: half of float32.
  EXPECT_EQ(2 * m.grafting, r.grafting) << c.name;
  EXPECT_EQ(2 * m.filtered_gradient, r.filtered_gradient) << c.name;
  EXPECT_EQ(2 * m.momentum, r.momentum) << c.name;
  EXPECT_EQ(m.factors, r.factors) << c.name;
  EXPECT_EQ(m.eigenvectors, r.eigenvectors) << c.name;
  if (std::holds_alternative<shampoo::EigendecomposedShampooConfig>(c.options.preconditioner()) ||
      std::holds_alternative<shampoo::EigendecomposedKLShampooConfig>(c.options.preconditioner())) {
    // Eigendecomposed Shampoo keeps its roots X_k between amortized computations, except with a
    // compact state: it forms them at every step instead.
    EXPECT_GT(r.inverse_roots, 0) << c.name;
    EXPECT_EQ(m.inverse_roots, 0) << c.name;
  } else if (r.inverse_roots > 0) {
    // bfloat16: half of float32, the dtype of the float32 parameters' uncompacted roots also
    // with float64 factors (KL-Shampoo's are in the factor dtype: a quarter of float64); 8 bits
    // with a float32 scale per 64 entries and the diagonal apart: a little over a quarter.
    const double ratio =
        static_cast<double>(m.inverse_roots) / static_cast<double>(r.inverse_roots);
    const bool kl =
        std::holds_alternative<shampoo::RootInvKLShampooConfig>(c.options.preconditioner());
    const bool dbl = kl && c.options.factor_matrix_dtype() == at::kDouble;
    if (c.options.compact_state() == CompactState::kBfloat16) {
      EXPECT_DOUBLE_EQ(ratio, dbl ? 0.25 : 0.5) << c.name;
    } else {
      // These blocks are at most 8×8, where a group of 64 entries is mostly padding and 8 bits
      // can take more than float32; the ratio for large blocks is in symmetric_matrices_test.
      EXPECT_NE(m.inverse_roots, r.inverse_roots) << c.name;
    }
  }
  EXPECT_EQ(m.state_total(), compact.stats().state_bytes);
  // Close to the float32 state after 8 steps: within 3% of the distance travelled.
  const auto a = snapshot(params);
  const auto b = snapshot(full_params);
  for (size_t i = 0; i < a.size(); ++i) {
    const double travel = (b[i] - at_start[i]).norm().item<double>();
    const double difference = (a[i] - b[i]).norm().item<double>();
    EXPECT_GT(difference, 0.0) << c.name << " parameter " << i;
    EXPECT_LT(difference, 0.03 * travel) << c.name << " parameter " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Settings, CompactStates, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

TEST(CompactStateOption, StructuralNamedInMessagesAndArchived) {
  const auto compact = ShampooOptions::reference_defaults().compact_state(CompactState::kInt8);
  EXPECT_FALSE(shampoo::structurally_equal(ShampooOptions::reference_defaults(), compact));
  // Saved and read back with the options.
  torch::serialize::OutputArchive out;
  compact.serialize(out);
  std::stringstream buffer;
  out.save_to(buffer);
  torch::serialize::InputArchive in;
  in.load_from(buffer);
  ShampooOptions read = ShampooOptions::reference_defaults();
  read.serialize(in);
  EXPECT_EQ(read.compact_state(), CompactState::kInt8);
}

}  // namespace
