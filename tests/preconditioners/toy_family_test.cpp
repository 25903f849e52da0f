// A preconditioner family built from the recipe of docs/extending.md, in this file only: an
// Adamax-style diagonal method (V ← max(beta2·V, |G′|), P = Ḡ / (V + epsilon)). The config names
// its list and lists its fields, the list keeps the contract (list_contract.h), and the library's
// family templates (preconditioner_family.h) build it, size it and block for it as they do the
// built-in families. Plugging it into ShampooOptions is the one registration the recipe adds in
// the library: its alternative in PreconditionerConfig.
#include <gtest/gtest.h>

#include "list_contract.h"

namespace toy {

class AdamaxList;

// ---- 1. the config: its fields, its name, its range checks ------------------------------------
struct AdamaxConfig {
  using List = AdamaxList;
  double beta2 = 0.999;
  double epsilon = 1e-8;
  bool operator==(const AdamaxConfig&) const = default;
};

template <typename C, typename F>
requires std::is_same_v<shampoo::detail::Plain<C>, AdamaxConfig>
void visit_fields(C& c, F&& f) {
  f("preconditioner_adamax_beta2", "beta2", c.beta2);
  f("preconditioner_adamax_epsilon", "epsilon", c.epsilon);
}

constexpr const char* family_name(const AdamaxConfig&) { return "Adamax preconditioner"; }

void check_config(const AdamaxConfig& c, const std::string& where) {
  TORCH_CHECK(c.beta2 > 0.0 && c.beta2 <= 1.0, where, ".beta2: got ", c.beta2,
              ", expected a value in (0, 1] (AdamaxConfig)");
  TORCH_CHECK(c.epsilon > 0.0, where, ".epsilon: got ", c.epsilon, ", expected > 0 (AdamaxConfig)");
}

// ---- 2. the list
// ---------------------------------------------------------------------------------
class AdamaxList final : public shampoo::detail::PreconditionerList {
 public:
  AdamaxList(std::vector<shampoo::detail::StackSpec> stacks, const AdamaxConfig& config,
             const shampoo::detail::MatrixPreconditionerSettings& /*settings*/)
      : stacks_(std::move(stacks)), config_(config) {
    for (const auto& spec : stacks_) {
      std::vector<int64_t> shape{spec.size()};
      shape.insert(shape.end(), spec.block_shape.begin(), spec.block_shape.end());
      norms_.push_back(at::zeros(shape, spec.options));
    }
  }

  /// V: the block's size in the blocks' dtype.
  static int64_t estimated_state_bytes(const AdamaxConfig& /*config*/,
                                       const shampoo::detail::BlockLayout& layout) {
    return layout.numel() * layout.state_element_size;
  }

  void update(int64_t stack, const shampoo::detail::Rows& rows, const at::Tensor& gradients,
              const shampoo::detail::RowScalars& /*scalars*/,
              const std::vector<bool>& /*amortize*/) override {
    auto v = shampoo::detail::gather_rows(norms_[stack], rows);
    v = at::maximum(v * config_.beta2, gradients.abs());
    shampoo::detail::scatter_rows(norms_[stack], rows, v);
  }
  using PreconditionerList::precondition;
  void precondition(int64_t stack, const shampoo::detail::Rows& rows, const at::Tensor& filtered,
                    const shampoo::detail::RowScalars& /*scalars*/,
                    at::Tensor& out) const override {
    const auto v = shampoo::detail::gather_rows(norms_[stack], rows);
    at::div_out(out, filtered, v + config_.epsilon);
  }
  bool identity_before_amortization() const override { return false; }
  std::map<std::string, at::Tensor> export_member(int64_t stack, int64_t row) const override {
    return {{"infinity_norm", norms_[stack][row].clone()}};
  }
  void import_member(int64_t stack, int64_t row,
                     const std::map<std::string, at::Tensor>& state) override {
    const auto& spec = stacks_[stack];
    norms_[stack][row].copy_(shampoo::detail::checked_state(
        state, "infinity_norm", spec.block_shape, norms_[stack].options(), spec.names[row]));
  }
  const shampoo::detail::AmortizedCounters& counters() const override { return counters_; }
  void set_counters(const shampoo::detail::AmortizedCounters& c) override { counters_ = c; }
  void add_memory(shampoo::MemorySummary& out) const override {
    for (const auto& v : norms_) {
      out.preconditioner_other += v.numel() * static_cast<int64_t>(v.element_size());
    }
  }

 private:
  std::vector<shampoo::detail::StackSpec> stacks_;
  AdamaxConfig config_;
  std::vector<at::Tensor> norms_;
  shampoo::detail::AmortizedCounters counters_;
};

}  // namespace toy

// ---- 3. the contract and the library's family templates
// ------------------------------------------
namespace shampoo::testing {

INSTANTIATE_TYPED_TEST_SUITE_P(Toy, ListContract, ::testing::Types<toy::AdamaxConfig>);

namespace {

TEST(ToyFamily, TheFamilyTemplatesTreatItAsABuiltInFamily) {
  EXPECT_EQ(detail::family_block_order<toy::AdamaxConfig>(), 1);
  detail::StackSpec spec;
  spec.block_shape = {2, 5};
  spec.options = at::TensorOptions().dtype(at::kDouble);
  spec.dim_exponents = {0.25, 0.25};
  spec.names = {"block 0"};
  const auto list = detail::make_family_list(toy::AdamaxConfig{}, {spec}, {});
  EXPECT_NE(dynamic_cast<toy::AdamaxList*>(list.get()), nullptr);
  EXPECT_EQ(
      list->state_bytes(),
      detail::family_state_bytes(toy::AdamaxConfig{},
                                 detail::BlockLayout{spec.block_shape, spec.dim_exponents, 4, 8}));
  // Its fields, as option merging and checkpoints read them.
  std::vector<std::string> keys;
  toy::AdamaxConfig config;
  visit_fields(config, [&](const char* key, const char*, double& v) {
    keys.push_back(key);
    v = 0.5;
  });
  EXPECT_EQ(keys, (std::vector<std::string>{"preconditioner_adamax_beta2",
                                            "preconditioner_adamax_epsilon"}));
  EXPECT_EQ(config, (toy::AdamaxConfig{0.5, 0.5}));
  EXPECT_STREQ(family_name(config), "Adamax preconditioner");
  expect_error(
      [] { check_config(toy::AdamaxConfig{.beta2 = 0.0}, "ShampooOptions.preconditioner"); },
      {"ShampooOptions.preconditioner.beta2: got 0", "AdamaxConfig"});
}

}  // namespace
}  // namespace shampoo::testing
