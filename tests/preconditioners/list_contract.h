#pragma once
// The contract every preconditioner list keeps (preconditioners/preconditioner_list.h), as a typed
// test suite over family configs: a test file instantiates it for its configs
// (INSTANTIATE_TYPED_TEST_SUITE_P(Name, ListContract, Types)). A config type C names its list
// (C::List) and the contract builds it through make_family_list, as the engine does:
//   - zero gradients give a zero direction and finite state;
//   - finite gradients give a finite direction, precondition() changes no state, and a member's
//     result does not depend on the other members of its call;
//   - a NaN gradient either raises an error naming its block or stays in that block's direction
//     (or, where the family says so, gives a zero direction there);
//   - export/import round-trips a member's state bit for bit and rejects a missing entry;
//   - the family's state-size estimate equals the bytes the list allocates.
// ListContractTraits<C> may give other configs for a family (default: C{}).

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "preconditioners/preconditioner_family.h"
#include "support/test_support.h"

namespace shampoo::testing {

inline bool all_finite(const at::Tensor& t) { return at::isfinite(t).all().item<bool>(); }

/// What a family's traits say unless they say otherwise.
struct ListContractDefaults {
  /// A zero gradient gives a zero direction (false where the family documents otherwise).
  static constexpr bool kZeroGivesZero = true;
  /// A NaN element gives a zero direction there (false: the block's direction is non-finite or
  /// the call raises naming the block).
  static constexpr bool kNanGivesZero = false;
};

template <typename C>
struct ListContractTraits : ListContractDefaults {
  static C config() { return C{}; }
};

template <typename C>
class ListContract : public ::testing::Test {
 protected:
  static constexpr int64_t kMembers = 3;

  static detail::StackSpec spec() {
    detail::StackSpec s;
    s.block_shape = {4, 3};  // matrices, so that spectral descent applies too
    s.options = at::TensorOptions().dtype(at::kFloat);
    s.dim_exponents = {0.25, 0.25};
    for (int64_t i = 0; i < kMembers; ++i) s.names.push_back("block " + std::to_string(i));
    return s;
  }

  static std::unique_ptr<detail::PreconditionerList> make_list() {
    detail::MatrixPreconditionerSettings settings;
    settings.factor_dtype = at::kFloat;
    return detail::make_family_list(ListContractTraits<C>::config(), {spec()}, settings);
  }

  static detail::RowScalars scalars(const detail::Rows& rows, int64_t step) {
    detail::RowScalars s;
    for (int64_t i = 0; i < rows.size(); ++i) {
      s.beta2.push_back(0.99);
      s.factor_weight.push_back(0.01);
      s.bias_correction2.push_back(1.0 - std::pow(0.99, static_cast<double>(step)));
      s.epsilon.push_back(1e-6);
      s.step.push_back(step);
    }
    return s;
  }

  static at::Tensor gradients(int64_t rows, uint64_t seed) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    return at::randn({rows, 4, 3}, gen, at::TensorOptions().dtype(at::kFloat));
  }

  /// `steps` updates of `rows` (amortized at every step) with seeded gradients.
  static void run(detail::PreconditionerList& list, const detail::Rows& rows, int64_t steps,
                  uint64_t seed) {
    for (int64_t t = 1; t <= steps; ++t) {
      const std::vector<bool> amortize(rows.size(), true);
      list.update(0, rows, gradients(rows.size(), seed + t), scalars(rows, t), amortize);
    }
  }

  static std::vector<std::map<std::string, at::Tensor>> export_all(
      const detail::PreconditionerList& list) {
    std::vector<std::map<std::string, at::Tensor>> out;
    for (int64_t r = 0; r < kMembers; ++r) out.push_back(list.export_member(0, r));
    return out;
  }

  static ::testing::AssertionResult same_states(
      const std::vector<std::map<std::string, at::Tensor>>& a,
      const std::vector<std::map<std::string, at::Tensor>>& b) {
    if (a.size() != b.size()) return ::testing::AssertionFailure() << "member counts differ";
    for (size_t r = 0; r < a.size(); ++r) {
      if (a[r].size() != b[r].size()) {
        return ::testing::AssertionFailure() << "member " << r << ": entry counts differ";
      }
      for (const auto& [key, value] : a[r]) {
        const auto it = b[r].find(key);
        if (it == b[r].end()) return ::testing::AssertionFailure() << "missing " << key;
        if (!bit_equal(value, it->second)) {
          return ::testing::AssertionFailure() << "member " << r << " entry " << key << " differs";
        }
      }
    }
    return ::testing::AssertionSuccess();
  }
};

TYPED_TEST_SUITE_P(ListContract);

TYPED_TEST_P(ListContract, ZeroGradientsGiveAZeroDirection) {
  auto list = this->make_list();
  const auto rows = detail::Rows::every(this->kMembers);
  const auto zeros = at::zeros({this->kMembers, 4, 3});
  for (int64_t t = 1; t <= 2; ++t) {
    list->update(0, rows, zeros, this->scalars(rows, t), std::vector<bool>(rows.size(), true));
  }
  const auto p = list->precondition(0, rows, zeros, this->scalars(rows, 2));
  EXPECT_TRUE(all_finite(p));
  if (ListContractTraits<TypeParam>::kZeroGivesZero) {
    EXPECT_TRUE(at::equal(p, zeros)) << p;
  }
  for (const auto& member : this->export_all(*list)) {
    for (const auto& [key, value] : member) {
      EXPECT_TRUE(all_finite(value)) << key;
    }
  }
}

TYPED_TEST_P(ListContract, FiniteGradientsGiveAFiniteDirectionIndependentOfTheOtherMembers) {
  auto list = this->make_list();
  const auto every = detail::Rows::every(this->kMembers);
  this->run(*list, every, 3, 10);
  const auto filtered = this->gradients(this->kMembers, 99);
  const auto before = this->export_all(*list);
  const auto p = list->precondition(0, every, filtered, this->scalars(every, 3));
  EXPECT_EQ(p.sizes(), filtered.sizes());
  EXPECT_TRUE(all_finite(p));
  EXPECT_TRUE(this->same_states(before, this->export_all(*list))) << "precondition() changed state";
  // Member 1 alone, in place (out aliases the input), gives what it got beside the others.
  detail::Rows one;
  one.rows = {1};
  auto alone = filtered.narrow(0, 1, 1).clone();
  list->precondition(0, one, alone, this->scalars(one, 3), alone);
  EXPECT_TRUE(bit_equal(alone[0], p[1]));
  // Stepped alone from the start, member 1 has the same state as stepped beside the others.
  auto solo = this->make_list();
  for (int64_t t = 1; t <= 3; ++t) {
    solo->update(0, one, this->gradients(this->kMembers, 10 + t).narrow(0, 1, 1),
                 this->scalars(one, t), {true});
  }
  EXPECT_TRUE(this->same_states({list->export_member(0, 1)}, {solo->export_member(0, 1)}));
}

TYPED_TEST_P(ListContract, NanGradientRaisesNamingItsBlockOrStaysInIt) {
  auto list = this->make_list();
  const auto every = detail::Rows::every(this->kMembers);
  this->run(*list, every, 1, 20);
  auto g = this->gradients(this->kMembers, 21);
  g[0][1][2] = std::numeric_limits<float>::quiet_NaN();
  try {
    list->update(0, every, g, this->scalars(every, 2), std::vector<bool>(every.size(), true));
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("block 0"), std::string::npos) << e.what();
    return;
  }
  at::Tensor p;
  try {
    p = list->precondition(0, every, g, this->scalars(every, 2));
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("block 0"), std::string::npos) << e.what();
    return;
  }
  if (ListContractTraits<TypeParam>::kNanGivesZero) {
    EXPECT_EQ(p[0][1][2].item<float>(), 0.0f);
  } else {
    EXPECT_FALSE(all_finite(p[0])) << "a NaN gradient gave a finite direction";
  }
  EXPECT_TRUE(all_finite(p.narrow(0, 1, 2)));
}

TYPED_TEST_P(ListContract, ExportImportRoundTrips) {
  auto list = this->make_list();
  const auto every = detail::Rows::every(this->kMembers);
  this->run(*list, every, 2, 30);
  auto copy = this->make_list();
  for (int64_t r = 0; r < this->kMembers; ++r) copy->import_member(0, r, list->export_member(0, r));
  EXPECT_TRUE(this->same_states(this->export_all(*list), this->export_all(*copy)));
  // Both go on identically.
  this->run(*list, every, 2, 40);
  this->run(*copy, every, 2, 40);
  const auto filtered = this->gradients(this->kMembers, 50);
  EXPECT_TRUE(bit_equal(list->precondition(0, every, filtered, this->scalars(every, 4)),
                        copy->precondition(0, every, filtered, this->scalars(every, 4))));
  // A missing entry is an error naming it and the block.
  const auto state = list->export_member(0, 2);
  for (const auto& [key, value] : state) {
    if (key == "consecutive_failures") continue;  // optional: 0 when absent
    auto partial = state;
    partial.erase(key);
    expect_error([&] { copy->import_member(0, 2, partial); }, {key, "block 2"});
  }
  const detail::AmortizedCounters counters{7, 2, 1, 0};
  copy->set_counters(counters);
  EXPECT_EQ(copy->counters().computations, 7);
  EXPECT_EQ(copy->counters().failures, 2);
}

TYPED_TEST_P(ListContract, StateSizeEstimateIsWhatIsAllocated) {
  const auto list = this->make_list();
  const auto s = this->spec();
  detail::BlockLayout layout;
  layout.shape = s.block_shape;
  layout.dim_exponents = s.dim_exponents;
  layout.factor_element_size = 4;
  layout.state_element_size = 4;
  EXPECT_EQ(
      list->state_bytes(),
      this->kMembers * detail::family_state_bytes(ListContractTraits<TypeParam>::config(), layout));
  // What export gives is what is kept (checkpoints lose nothing), besides what is derived from it.
  int64_t exported = 0;
  for (const auto& member : this->export_all(*list)) {
    for (const auto& [key, value] : member) {
      if (key != "consecutive_failures") exported += value.numel() * value.element_size();
    }
  }
  EXPECT_EQ(exported + list->derived_state_bytes(), list->state_bytes());
}

REGISTER_TYPED_TEST_SUITE_P(ListContract, ZeroGradientsGiveAZeroDirection,
                            FiniteGradientsGiveAFiniteDirectionIndependentOfTheOtherMembers,
                            NanGradientRaisesNamingItsBlockOrStaysInIt, ExportImportRoundTrips,
                            StateSizeEstimateIsWhatIsAllocated);

}  // namespace shampoo::testing
