#include "preconditioners/preconditioner_factory.h"

#include <type_traits>

#include "preconditioners/descent_preconditioner_lists.h"
#include "preconditioners/diagonal_preconditioner_list.h"
#include "preconditioners/eigendecomposed_preconditioner_list.h"
#include "preconditioners/eigenvalue_corrected_preconditioner_list.h"
#include "preconditioners/kronecker_factor_list.h"
#include "preconditioners/preconditioner_family.h"
#include "preconditioners/shampoo_preconditioner_list.h"

namespace shampoo::detail {

std::unique_ptr<PreconditionerList> make_preconditioner_list(
    const PreconditionerConfig& config, std::vector<StackSpec> stacks,
    MatrixPreconditionerSettings settings) {
  return std::visit(
      [&](const auto& c) { return make_family_list(c, std::move(stacks), std::move(settings)); },
      config);
}

int64_t estimated_state_bytes(const PreconditionerConfig& config, const BlockLayout& layout) {
  return std::visit([&](const auto& c) { return family_state_bytes(c, layout); }, config);
}

int64_t block_order(const PreconditionerConfig& config) {
  return std::visit([](const auto& c) { return family_block_order<std::decay_t<decltype(c)>>(); },
                    config);
}

bool keeps_kronecker_factors(const PreconditionerConfig& config) {
  return std::visit(
      [](const auto& c) {
        return std::is_base_of_v<KroneckerFactorList, typename std::decay_t<decltype(c)>::List>;
      },
      config);
}

}  // namespace shampoo::detail
