// The list contract (list_contract.h) for every built-in family, each through its config's List as
// the engine builds it: root-inverse Shampoo (eigh and coupled Newton), root-inverse KL-Shampoo,
// eigendecomposed Shampoo and KL-Shampoo, eigenvalue-corrected Shampoo (eigh and QR), the
// diagonal list (SGD, AdaGrad, RMSprop, Adam) and the descent lists (spectral, sign).
#include "list_contract.h"
#include "preconditioners/descent_preconditioner_lists.h"
#include "preconditioners/diagonal_preconditioner_list.h"
#include "preconditioners/eigendecomposed_preconditioner_list.h"
#include "preconditioners/eigenvalue_corrected_preconditioner_list.h"
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
