// The list contract (list_contract.h) for every built-in family, each through its config's List as
// the engine builds it: root-inverse Shampoo (eigh and coupled Newton), root-inverse KL-Shampoo,
// eigendecomposed Shampoo and KL-Shampoo, eigenvalue-corrected Shampoo (eigh and QR), the
// diagonal list (SGD, AdaGrad, RMSprop, Adam) and the descent lists (spectral, sign).
#include "list_contract.h"
#include "preconditioners/descent_preconditioner_lists.h"
#include "preconditioners/diagonal_preconditioner_list.h"
#include "preconditioners/eigendecomposed_preconditioner_list.h"
#include "preconditioners/eigenvalue_corrected_preconditioner_list.h"
#include "preconditioners/kronecker_contractions.h"
#include "preconditioners/preconditioner_factory.h"
#include "preconditioners/shampoo_preconditioner_list.h"
#include "shampoo/shampoo_options.h"

namespace shampoo::testing {
namespace {

// A second config of a family, as a type of its own.
struct CoupledNewtonShampoo : RootInvShampooConfig {};
struct QREigenvalueCorrected : EigenvalueCorrectedShampooConfig {};
struct SVDSpectralDescent : SpectralDescentConfig {};

}  // namespace

template <>
struct ListContractTraits<CoupledNewtonShampoo> : ListContractDefaults {
  static RootInvShampooConfig config() {
    return RootInvShampooConfig{.solver = RootSolver::kCoupledNewton};
  }
};
template <>
struct ListContractTraits<QREigenvalueCorrected> : ListContractDefaults {
  static EigenvalueCorrectedShampooConfig config() {
    return EigenvalueCorrectedShampooConfig{.eigenbasis_method = EigenbasisMethod::kQR};
  }
};
template <>
struct ListContractTraits<SVDSpectralDescent> : ListContractDefaults {
  static SpectralDescentConfig config() {
    return SpectralDescentConfig{.method = OrthogonalizationMethod::kSVD};
  }
  // U·Vᵀ of a zero block is an arbitrary orthogonal matrix (as the reference's SVD path gives).
  static constexpr bool kZeroGivesZero = false;
};
// sign(NaN) is 0 (torch.sign, as the reference uses). The engine rejects non-finite gradients
// before any list sees them (DistributedShampoo's max |G| check).
template <>
struct ListContractTraits<SignDescentConfig> : ListContractDefaults {
  static SignDescentConfig config() { return {}; }
  static constexpr bool kNanGivesZero = true;
};

using Families =
    ::testing::Types<RootInvShampooConfig, CoupledNewtonShampoo, RootInvKLShampooConfig,
                     EigendecomposedShampooConfig, EigendecomposedKLShampooConfig,
                     EigenvalueCorrectedShampooConfig, QREigenvalueCorrected,
                     SGDPreconditionerConfig, AdaGradPreconditionerConfig,
                     RMSpropPreconditionerConfig, AdamPreconditionerConfig, SpectralDescentConfig,
                     SVDSpectralDescent, SignDescentConfig>;
INSTANTIATE_TYPED_TEST_SUITE_P(BuiltIn, ListContract, Families);

namespace {

// Eigendecomposed Shampoo keeps its roots X_k between amortized computations: what precondition
// multiplies by is, bit for bit, X_k formed afresh from the kept decompositions with the ε of the
// call, after an amortized computation, after ε changed, and after an import; with a compact
// state nothing is kept.
TEST(EigendecomposedKeptRoots, AreTheRootsFormedAfreshWhateverChanged) {
  detail::StackSpec spec;
  spec.block_shape = {5, 4};
  spec.options = at::TensorOptions().dtype(at::kFloat);
  spec.dim_exponents = {0.25, 0.25};
  spec.names = {"block 0", "block 1", "block 2"};
  detail::Rows all{{0, 1, 2}, true};
  auto scalars = [](double epsilon, int64_t step) {
    detail::RowScalars s;
    for (int i = 0; i < 3; ++i) {
      s.beta2.push_back(0.9);
      s.factor_weight.push_back(0.1);
      s.bias_correction2.push_back(1.0 - std::pow(0.9, static_cast<double>(step)));
      s.epsilon.push_back(epsilon * (i + 1));
      s.step.push_back(step);
    }
    return s;
  };
  detail::EigendecomposedPreconditionerList list({spec}, EigendecomposedShampooConfig{}, {});
  auto fresh = [&](const detail::Rows& rows, const detail::RowScalars& s, const at::Tensor& g) {
    auto out = g;
    for (int64_t k = 0; k < 2; ++k) {
      out = detail::stacked_multiply_along_dim(out, list.inverse_roots(0, rows, k, s), k);
    }
    return out;
  };
  at::manual_seed(12);
  const auto g = at::randn({3, 5, 4});
  // Before any decomposition, then after the first, then ε changed without a decomposition.
  EXPECT_TRUE(
      bit_equal(list.precondition(0, all, g, scalars(1e-3, 1)), fresh(all, scalars(1e-3, 1), g)));
  list.update(0, all, at::randn({3, 5, 4}), scalars(1e-3, 2), {true, true, true});
  EXPECT_TRUE(
      bit_equal(list.precondition(0, all, g, scalars(1e-3, 2)), fresh(all, scalars(1e-3, 2), g)));
  const auto changed = scalars(1e-1, 3);
  const auto with_changed = list.precondition(0, all, g, changed);
  EXPECT_TRUE(bit_equal(with_changed, fresh(all, changed, g)));
  EXPECT_FALSE(bit_equal(with_changed, list.precondition(0, all, g, scalars(1e-3, 3))));
  // Some rows: only member 1 amortized; then member 2 imported from member 0.
  list.update(0, all, at::randn({3, 5, 4}), changed, {false, true, false});
  const detail::Rows some{{1, 2}, false};
  const auto [rows, s] = detail::select_rows(all, changed, {false, true, true});
  const auto gs = g.narrow(0, 1, 2);
  EXPECT_TRUE(bit_equal(list.precondition(0, rows, gs, s), fresh(rows, s, gs)));
  list.import_member(0, 2, list.export_member(0, 0));
  EXPECT_TRUE(bit_equal(list.precondition(0, rows, gs, s), fresh(rows, s, gs)));
  EXPECT_GT(list.derived_state_bytes(), 0);
  // A compact state keeps no roots.
  detail::MatrixPreconditionerSettings compact;
  compact.compact = CompactState::kBfloat16;
  detail::EigendecomposedPreconditionerList small({spec}, EigendecomposedShampooConfig{}, compact);
  EXPECT_EQ(small.derived_state_bytes(), 0);
}

// The factory over PreconditionerConfig agrees with the family templates for every alternative.
TEST(PreconditionerFactory, EveryAlternativeBuildsItsList) {
  detail::StackSpec spec;
  spec.block_shape = {4, 3};
  spec.options = at::TensorOptions().dtype(at::kFloat);
  spec.dim_exponents = {0.25, 0.0};
  spec.names = {"block 0", "block 1"};
  detail::BlockLayout layout{spec.block_shape, spec.dim_exponents, 4, 4};
  for (size_t kind = 0; kind < std::variant_size_v<PreconditionerConfig>; ++kind) {
    PreconditionerConfig config;
    [&]<size_t... I>(std::index_sequence<I...>) {
      ((kind == I ? (config = std::variant_alternative_t<I, PreconditionerConfig>{}, 0) : 0), ...);
    }
    (std::make_index_sequence<std::variant_size_v<PreconditionerConfig>>{});
    const auto list = detail::make_preconditioner_list(config, {spec}, {});
    EXPECT_EQ(list->state_bytes(), 2 * detail::estimated_state_bytes(config, layout)) << kind;
    EXPECT_EQ(detail::block_order(config),
              std::holds_alternative<SpectralDescentConfig>(config) ? 2 : 1);
  }
}

}  // namespace
}  // namespace shampoo::testing
