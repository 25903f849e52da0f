// The grafting method table (coefficients per method, configs by kind, checkpoint codes) and the
// elementwise state of the update (grafting statistics V, lazily allocated filter and momentum)
// against closed forms, driven through the fused chain as in a step.
#include "update/grafting.h"

#include <torch/serialize/archive.h>

#include <cmath>
#include <sstream>

#include "shampoo/shampoo_options.h"
#include "support/test_support.h"
#include "update/elementwise_state.h"

namespace {

using shampoo::detail::ChainBlockTensors;
using shampoo::detail::ElementwiseState;
using shampoo::detail::GraftingFloats;
using shampoo::detail::GraftingKind;
using shampoo::detail::StackSpec;
using shampoo::testing::all_close;

StackSpec spec(int64_t n) {
  StackSpec s;
  s.block_shape = {3, 2};
  s.options = at::TensorOptions().dtype(at::kDouble);
  s.dim_exponents = {0.25, 0.25};
  for (int64_t i = 0; i < n; ++i) s.names.push_back("block " + std::to_string(i));
  return s;
}

/// The coefficients of grafting `kind` with `f` at step t, as the chain gets them.
shampoo::detail::DiagonalCoefficients coefficients(GraftingKind kind, GraftingFloats f, int64_t t) {
  const auto config =
      shampoo::detail::with_grafting_floats(shampoo::detail::default_grafting(kind), f);
  const auto family = shampoo::detail::grafting_family(config);
  return family ? shampoo::detail::diagonal_coefficients(*family, t)
                : shampoo::detail::DiagonalCoefficients{};
}

TEST(GraftingMethods, CoefficientsPerMethod) {
  const GraftingFloats f{0.9, 1e-8};
  const auto ada = coefficients(GraftingKind::kAdaGrad, f, 5);
  EXPECT_EQ(ada.beta2, 1.0);
  EXPECT_EQ(ada.weight, 1.0);
  EXPECT_EQ(ada.bias_correction2, 1.0);
  EXPECT_EQ(ada.epsilon, 1e-8);
  const auto rms = coefficients(GraftingKind::kRMSprop, f, 5);
  EXPECT_DOUBLE_EQ(rms.weight, 0.1);
  EXPECT_EQ(rms.bias_correction2, 1.0);
  const auto adam = coefficients(GraftingKind::kAdam, f, 5);
  EXPECT_DOUBLE_EQ(adam.bias_correction2, 1.0 - std::pow(0.9, 5));
  EXPECT_EQ(coefficients(GraftingKind::kSGD, f, 5).epsilon, 0.0);
  EXPECT_FALSE(shampoo::detail::grafting_method(GraftingKind::kSGD).has_state);
  EXPECT_TRUE(shampoo::detail::grafting_method(GraftingKind::kAdaGrad).has_state);
  // The table's has_state is the family's.
  for (const auto kind :
       {GraftingKind::kSGD, GraftingKind::kAdaGrad, GraftingKind::kRMSprop, GraftingKind::kAdam}) {
    EXPECT_EQ(coefficients(kind, f, 1).has_state, shampoo::detail::grafting_method(kind).has_state);
  }
}

// Grafting configs are the diagonal preconditioner configs: dropping the weighting factor gives
// V ← beta2·V + G′² and no bias correction, as the diagonal list does.
TEST(GraftingMethods, DropWeightingFactorAsTheDiagonalFamily) {
  shampoo::AdamGraftingConfig adam{0.9, 1e-8};
  adam.drop_weighting_factor_on_gsquare = true;
  const auto c = shampoo::detail::diagonal_coefficients(adam, 5);
  EXPECT_EQ(c.weight, 1.0);
  EXPECT_EQ(c.bias_correction2, 1.0);
  shampoo::kernels::ChainScalars s;
  shampoo::detail::fill_chain_scalars(adam, 5, s);
  EXPECT_EQ(s.diagonal_weight, 1.0);
  EXPECT_EQ(s.diagonal_bias_correction, 1.0);
  static_assert(std::is_same_v<shampoo::AdamGraftingConfig, shampoo::AdamPreconditionerConfig>);
}

TEST(GraftingMethods, KindsConfigsAndFloatsAgree) {
  for (int64_t code = 0; code < shampoo::detail::kGraftingKinds; ++code) {
    const auto kind = shampoo::detail::grafting_kind_from_code(code);
    const auto config = shampoo::detail::default_grafting(kind);
    EXPECT_EQ(shampoo::detail::grafting_kind(config), kind);
    EXPECT_EQ(shampoo::detail::grafting_method(kind).kind, kind);
  }
  const shampoo::GraftingConfig adam = shampoo::AdamGraftingConfig{0.95, 1e-6};
  EXPECT_EQ(shampoo::detail::grafting_floats(adam), (GraftingFloats{0.95, 1e-6}));
  const auto ada = shampoo::detail::with_grafting_floats(shampoo::AdaGradGraftingConfig{},
                                                         GraftingFloats{0.5, 1e-3});
  EXPECT_EQ(std::get<shampoo::AdaGradGraftingConfig>(ada).epsilon, 1e-3);  // beta2: none
  EXPECT_EQ(shampoo::detail::grafting_floats(ada), (GraftingFloats{0.0, 1e-3}));
  shampoo::testing::expect_error([] { shampoo::detail::grafting_kind_from_code(5); },
                                 {"grafting kind", "5", "0..4"});
}

TEST(GraftingChainScalars, FilledFromTheTable) {
  shampoo::kernels::ChainScalars s;
  shampoo::detail::fill_chain_scalars(shampoo::RMSpropGraftingConfig{0.99, 1e-6}, 4, s);
  EXPECT_DOUBLE_EQ(s.diagonal_beta2, 0.99);
  EXPECT_DOUBLE_EQ(s.diagonal_weight, 1.0 - 0.99);
  EXPECT_DOUBLE_EQ(s.diagonal_epsilon, 1e-6);
  EXPECT_EQ(s.diagonal_bias_correction, 1.0);
}

/// One grafting-only chain step (P = P_graft, lr 1) of member `row` of stack 0 with gradient `g`.
at::Tensor graft_step(ElementwiseState& state, int64_t row, const shampoo::GraftingConfig& config,
                      int64_t t, const at::Tensor& g) {
  ChainBlockTensors c;
  c.scalars.direction_mode = static_cast<int32_t>(shampoo::kernels::DirectionMode::kDiagonal);
  c.scalars.lr = 1.0;
  shampoo::detail::fill_chain_scalars(config, t, c.scalars);
  c.grad = g.contiguous();
  c.gradient_out = at::empty_like(c.grad);
  c.filtered_out = at::empty_like(c.grad);
  c.update_out = at::empty_like(c.grad);
  state.bind(0, row, /*filter=*/false, /*momentum=*/false, c);
  shampoo::detail::run_chain_pre({c});
  shampoo::detail::run_chain_post({c});
  return -c.update_out;
}

TEST(ElementwiseState, AdamStatisticsMatchTheClosedFormOverSteps) {
  at::manual_seed(1);
  ElementwiseState state(GraftingKind::kAdam, {spec(2)});
  const std::vector<shampoo::GraftingConfig> configs{shampoo::AdamGraftingConfig{0.9, 1e-8},
                                                     shampoo::AdamGraftingConfig{0.5, 1e-3}};
  std::vector<at::Tensor> v{at::zeros({3, 2}, at::kDouble), at::zeros({3, 2}, at::kDouble)};
  for (int64_t t = 1; t <= 3; ++t) {
    for (int64_t row = 0; row < 2; ++row) {
      const auto& adam = std::get<shampoo::AdamGraftingConfig>(configs[row]);
      const auto g = at::randn({3, 2}, at::kDouble);
      const auto p = graft_step(state, row, configs[row], t, g);
      v[row] = adam.beta2 * v[row] + (1.0 - adam.beta2) * g * g;
      const auto expected = g / ((v[row] / (1 - std::pow(adam.beta2, t))).sqrt() + adam.epsilon);
      EXPECT_TRUE(all_close(p, expected)) << "row " << row << " step " << t;
    }
  }
  std::map<std::string, at::Tensor> exported;
  state.export_member(0, 1, exported);
  EXPECT_TRUE(all_close(exported.at("diagonal"), v[1]));
}

TEST(FactoredGrafting, RowAndColumnSumsFollowAdafactorAndTheNewestSquareEntersExactly) {
  // Blocks of 3×2 with factors: V kept as row sums r [3] and column sums c [2]; each step the
  // chain sees V = β2·r·cᵀ/Σr + (1 − β2)·G² and commit() keeps V's row and column sums.
  at::manual_seed(2);
  ElementwiseState state(GraftingKind::kAdam, {spec(2)}, /*compact=*/false, /*factored=*/true);
  ASSERT_TRUE(state.factored(0));
  EXPECT_EQ(state.state_bytes(), 2 * (3 + 2) * 8);
  const shampoo::AdamGraftingConfig adam{0.9, 1e-8};
  auto r = at::zeros({3}, at::kDouble);
  auto c = at::zeros({2}, at::kDouble);
  for (int64_t t = 1; t <= 4; ++t) {
    const auto g = at::randn({3, 2}, at::kDouble);
    const auto p = graft_step(state, 1, adam, t, g);
    state.commit();
    const auto history = t == 1 ? at::zeros({3, 2}, at::kDouble) : at::outer(r, c) / r.sum();
    const auto v = adam.beta2 * history + (1.0 - adam.beta2) * g * g;
    const auto expected = g / ((v / (1 - std::pow(adam.beta2, t))).sqrt() + adam.epsilon);
    EXPECT_TRUE(all_close(p, expected)) << "step " << t;
    r = v.sum(1);
    c = v.sum(0);
  }
  std::map<std::string, at::Tensor> exported;
  state.export_member(0, 1, exported);
  EXPECT_EQ(exported.count("diagonal"), 0u);
  EXPECT_TRUE(all_close(exported.at("diagonal_rows"), r));
  EXPECT_TRUE(all_close(exported.at("diagonal_cols"), c));
  // The other member was never bound: still zeros, and a discarded binding changes nothing.
  std::map<std::string, at::Tensor> other;
  ChainBlockTensors unused;
  state.bind(0, 0, false, false, unused);
  unused.diagonal_state.fill_(7.0);
  state.discard();
  state.export_member(0, 0, other);
  EXPECT_TRUE(at::equal(other.at("diagonal_rows"), at::zeros({3}, at::kDouble)));
}

TEST(FactoredGrafting, OnlyTwoDimensionalBlocksWithAFactorAreFactored) {
  auto no_factor = spec(1);
  no_factor.dim_exponents = {0.0, 0.0};  // takes the grafting update itself: V exact
  auto one_dimensional = spec(1);
  one_dimensional.block_shape = {5};
  one_dimensional.dim_exponents = {0.5};
  auto one_sided = spec(1);
  one_sided.dim_exponents = {0.0, 0.5};  // an embedding's block: a factor on one dim
  ElementwiseState state(GraftingKind::kAdam, {no_factor, one_dimensional, one_sided, spec(1)},
                         /*compact=*/false, /*factored=*/true);
  EXPECT_FALSE(state.factored(0));
  EXPECT_FALSE(state.factored(1));
  EXPECT_TRUE(state.factored(2));
  EXPECT_TRUE(state.factored(3));
  EXPECT_EQ(state.state_bytes(), (6 + 5 + 5 + 5) * 8);
  ElementwiseState exact(GraftingKind::kAdam, {spec(1)}, /*compact=*/false, /*factored=*/false);
  EXPECT_FALSE(exact.factored(0));
  ElementwiseState sgd(GraftingKind::kSGD, {spec(1)}, /*compact=*/false, /*factored=*/true);
  EXPECT_FALSE(sgd.factored(0));  // no V at all
  EXPECT_EQ(sgd.state_bytes(), 0);
}

TEST(FactoredGrafting, ImportConvertsBetweenExactAndFactored) {
  const auto v = at::rand({3, 2}, at::kDouble) + 0.5;
  ElementwiseState exact(GraftingKind::kAdam, {spec(1)}, /*compact=*/false, /*factored=*/false);
  exact.import_member(0, 0, {{"diagonal", v}});
  std::map<std::string, at::Tensor> from_exact;
  exact.export_member(0, 0, from_exact);
  ElementwiseState factored(GraftingKind::kAdam, {spec(1)}, /*compact=*/false, /*factored=*/true);
  factored.import_member(0, 0, from_exact);
  std::map<std::string, at::Tensor> sums;
  factored.export_member(0, 0, sums);
  EXPECT_TRUE(all_close(sums.at("diagonal_rows"), v.sum(1)));
  EXPECT_TRUE(all_close(sums.at("diagonal_cols"), v.sum(0)));
  ElementwiseState back(GraftingKind::kAdam, {spec(1)}, /*compact=*/false, /*factored=*/false);
  back.import_member(0, 0, sums);
  std::map<std::string, at::Tensor> unfactored;
  back.export_member(0, 0, unfactored);
  EXPECT_TRUE(all_close(unfactored.at("diagonal"), at::outer(v.sum(1), v.sum(0)) / v.sum()));
  // Neither form present: an error naming the member and the entry.
  shampoo::testing::expect_error([&] { factored.import_member(0, 0, {}); },
                                 {"block 0", "diagonal"});
}

TEST(ElementwiseState, SgdKeepsNoStatisticsAndGraftsTheGradient) {
  ElementwiseState state(GraftingKind::kSGD, {spec(1)});
  EXPECT_EQ(state.state_bytes(), 0);
  const auto g = at::randn({3, 2}, at::kDouble);
  EXPECT_TRUE(at::equal(graft_step(state, 0, shampoo::SGDGraftingConfig{}, 1, g), g));
}

TEST(ElementwiseState, ExportImportRoundTripAndLazyStacks) {
  ElementwiseState a(GraftingKind::kRMSprop, {spec(2)});
  ChainBlockTensors c;
  a.bind(0, 1, /*filter=*/true, /*momentum=*/false, c);
  c.diagonal_state.copy_(at::rand({3, 2}, at::kDouble));
  c.filter_state.fill_(0.5);
  std::map<std::string, at::Tensor> exported;
  a.export_member(0, 1, exported);
  EXPECT_EQ(exported.count("filter"), 1u);
  EXPECT_EQ(exported.count("momentum"), 0u);  // never used: not allocated

  ElementwiseState b(GraftingKind::kRMSprop, {spec(2)});
  const auto before = b.allocated();
  b.import_member(0, 1, exported);
  std::map<std::string, at::Tensor> back;
  b.export_member(0, 1, back);
  EXPECT_TRUE(at::equal(back.at("diagonal"), exported.at("diagonal")));
  EXPECT_TRUE(at::equal(back.at("filter"), exported.at("filter")));
  b.release_since(before);  // the filter stack was allocated by the import: dropped again
  std::map<std::string, at::Tensor> released;
  b.export_member(0, 1, released);
  EXPECT_EQ(released.count("filter"), 0u);
  shampoo::testing::expect_error([&] { b.import_member(0, 0, {}); }, {"block 0", "diagonal"});
}

}  // namespace

// drop_weighting_factor_on_gsquare of a grafting config is structural (groups that differ in it
// do not merge), round-trips through the options archive, and an archive without its entry (as
// written before grafting configs were the diagonal configs) reads as false.
TEST(GraftingMethods, DropWeightingFactorIsStructuralAndArchived) {
  shampoo::AdamGraftingConfig adam{0.99, 1e-8};
  adam.drop_weighting_factor_on_gsquare = true;
  const auto dropping = shampoo::ShampooOptions::reference_defaults().grafting(adam);
  const auto keeping = shampoo::ShampooOptions::reference_defaults().grafting(
      shampoo::AdamGraftingConfig{0.99, 1e-8});
  EXPECT_FALSE(shampoo::structurally_equal(dropping, keeping));
  EXPECT_TRUE(shampoo::structurally_equal(
      dropping, shampoo::ShampooOptions(dropping).grafting(
                    shampoo::detail::with_grafting_floats(adam, GraftingFloats{0.9, 1e-6}))));
  const auto read = shampoo::testing::options_round_trip(dropping);
  EXPECT_TRUE(read.grafting() == dropping.grafting());

  torch::serialize::OutputArchive out;
  keeping.serialize(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  // The same archive without the entry: rebuilt from every entry but that one.
  torch::serialize::InputArchive full;
  std::istringstream in(bytes.str());
  full.load_from(in);
  torch::serialize::OutputArchive old;
  for (const auto& key : full.keys()) {
    if (key == "grafting_drop_weighting_factor_on_gsquare") continue;
    c10::IValue value;
    full.read(key, value);
    old.write(key, value);
  }
  std::ostringstream old_bytes;
  old.save_to(old_bytes);
  torch::serialize::InputArchive old_in;
  std::istringstream old_stream(old_bytes.str());
  old_in.load_from(old_stream);
  shampoo::ShampooOptions loaded = shampoo::ShampooOptions::reference_defaults();
  loaded.serialize(old_in);
  EXPECT_TRUE(loaded.grafting() == keeping.grafting());
}
