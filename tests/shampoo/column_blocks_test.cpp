// Column blocks (a block that is a slice of a matrix's columns, not contiguous) on the CPU: the
// chain reads their gradient and parameter and adds the update where they lie
// (update/elementwise_chain.h, chain_takes_view). Checked bit for bit
// - against the route CUDA takes (gradient copied in, update staged and added after the chain;
//   set_chain_views(false)), over root-inverse Shampoo with grafting and L2 weight decay,
//   eigendecomposed Shampoo with Nesterov momentum, Adam as the main preconditioner (the fused
//   pass) and SGD with iterate averaging;
// - against the same blocks given as parameters of their own.
// And merge_strided_runs, which makes the copies and adds of that route one launch per run of
// equally spaced blocks.
#include <ATen/record_function.h>
#include <shampoo/shampoo.h>

#include <map>
#include <string>

#include "shampoo/param_updates.h"
#include "support/test_support.h"
#include "update/elementwise_chain.h"

namespace {

using shampoo::DistributedShampoo;
using shampoo::ShampooOptions;
using shampoo::testing::bit_equal;
using shampoo::testing::clone_params;
using shampoo::testing::snapshot;

constexpr int64_t kMaxDim = 80;

/// A 40×200 matrix (blocks of 80, 80 and 40 columns: rows long enough for the chain to take the
/// first two where they lie, the third copied), a 3×50×100 weight merged to 150×100 (blocks of 80
/// and 20 columns) and a vector in two blocks.
std::vector<at::Tensor> make_params(uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<at::Tensor> params;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{40, 200}, {3, 50, 100}, {100}}) {
    params.push_back(at::randn(shape, gen).requires_grad_());
  }
  return params;
}

struct ColumnCase {
  std::string name;
  ShampooOptions options = ShampooOptions::reference_defaults();
};

void PrintTo(const ColumnCase& c, std::ostream* os) { *os << c.name; }

std::vector<ColumnCase> cases() {
  const auto base = ShampooOptions::reference_defaults(0.05)
                        .betas({0.9, 0.99})
                        .epsilon(1e-3)
                        .max_preconditioner_dim(kMaxDim);
  return {
      {"root_inverse_graft_l2", ShampooOptions(base)
                                    .grafting(shampoo::AdamGraftingConfig{0.99, 1e-8, false})
                                    .weight_decay(0.1)
                                    .weight_decay_type(shampoo::WeightDecayType::kL2)
                                    .momentum(0.5)},
      {"eigendecomposed_nesterov", ShampooOptions(base)
                                       .preconditioner(shampoo::EigendecomposedShampooConfig{})
                                       .weight_decay(0.01)
                                       .momentum(0.9)
                                       .use_nesterov(true)},
      {"adam_main_fused", ShampooOptions(base)
                              .preconditioner(shampoo::AdamPreconditionerConfig{0.95, 1e-4, false})
                              .weight_decay(0.1)
                              .momentum(0.5)},
      {"sgd_main_averaging", ShampooOptions(base)
                                 .preconditioner(shampoo::SGDPreconditionerConfig{})
                                 .weight_decay(0.01)
                                 .iterate_averaging(shampoo::GeneralizedPrimalAveragingConfig{})},
  };
}

class ColumnBlocks : public ::testing::TestWithParam<ColumnCase> {};

TEST_P(ColumnBlocks, InPlaceEqualsCopiedAndStagedBitForBit) {
  const auto& c = GetParam();
  auto in_place = make_params(3);
  auto copied = clone_params(in_place);
  DistributedShampoo a(in_place, c.options);
  DistributedShampoo b(copied, c.options);
  for (int t = 1; t <= 4; ++t) {
    shampoo::testing::set_random_grads(in_place, 40 + t);
    shampoo::testing::set_random_grads(copied, 40 + t);
    const auto grads = snapshot({in_place[0].grad(), in_place[1].grad()});
    a.step();
    shampoo::detail::set_chain_views(false);
    b.step();
    shampoo::detail::set_chain_views(true);
    ASSERT_TRUE(bit_equal(snapshot(in_place), snapshot(copied))) << c.name << ", step " << t;
    // The gradients the chain read where they lie are unchanged.
    ASSERT_TRUE(bit_equal(snapshot({in_place[0].grad(), in_place[1].grad()}), grads));
  }
}

INSTANTIATE_TEST_SUITE_P(Families, ColumnBlocks, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

TEST(ColumnBlocks, EqualTheirBlocksAsParametersBitForBit) {
  // The 40×200 matrix against its three column blocks as parameters: the same stacks, the same
  // blocks in the same order, so the same bits.
  const auto options = cases().front().options;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  auto matrix = at::randn({40, 200}, gen).requires_grad_();
  std::vector<at::Tensor> parts;
  for (const int64_t start : {0, 80, 160}) {
    parts.push_back(matrix.detach().narrow(1, start, std::min<int64_t>(80, 200 - start)).clone());
    parts.back().requires_grad_();
  }
  DistributedShampoo whole({matrix}, options);
  DistributedShampoo split(parts, options);
  for (int t = 1; t <= 4; ++t) {
    shampoo::testing::set_random_grads({matrix}, 60 + t);
    for (size_t i = 0; i < parts.size(); ++i) {
      parts[i].mutable_grad() =
          matrix.grad().narrow(1, static_cast<int64_t>(80 * i), parts[i].size(1)).clone();
    }
    whole.step();
    split.step();
    ASSERT_TRUE(bit_equal(matrix.detach(), at::cat(snapshot(parts), 1))) << "step " << t;
  }
}

/// ATen operators called on this thread by name while fn runs, nested calls included.
std::map<std::string, int64_t> count_ops(const std::function<void()>& fn) {
  static thread_local std::map<std::string, int64_t>* counts = nullptr;
  std::map<std::string, int64_t> out;
  counts = &out;
  const auto handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback([](const at::RecordFunction& f)
                                     -> std::unique_ptr<at::ObserverContext> {
        if (counts != nullptr) ++(*counts)[f.name()];
        return nullptr;
      }).scopes({at::RecordScope::FUNCTION}));
  fn();
  at::removeCallback(handle);
  counts = nullptr;
  return out;
}

TEST(StridedRuns, ColumnBlocksOnCudasRouteAreOneCopyAndOneAddPerRun) {
  // A [10, 5000] matrix in blocks of 1024 columns on the route CUDA takes (gradients copied
  // into the step's rows, updates staged and added) against the CPU's (read and updated where
  // they lie): the four full-width blocks are one more copy and one more add, the narrow last
  // block one more of each; not one per block (issue 46).
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  auto in_place = at::randn({10, 5000}, gen).requires_grad_();
  auto copied = in_place.detach().clone().requires_grad_();
  const auto options =
      ShampooOptions::reference_defaults(0.01).max_preconditioner_dim(1024).precondition_frequency(
          5);
  DistributedShampoo a({in_place}, options);
  DistributedShampoo b({copied}, options);
  std::map<std::string, int64_t> views, route;
  for (int t = 1; t <= 2; ++t) {  // the first step computes roots; the counted one is plain
    shampoo::testing::set_random_grads({in_place}, t);
    shampoo::testing::set_random_grads({copied}, t);
    views = count_ops([&] { a.step(); });
    shampoo::detail::set_chain_views(false);
    route = count_ops([&] { b.step(); });
    shampoo::detail::set_chain_views(true);
  }
  ASSERT_TRUE(bit_equal(in_place.detach(), copied.detach()));
  const auto more = [&](const char* name) { return route[name] - views[name]; };
  EXPECT_EQ(more("aten::copy_"), 2) << "the gradient blocks were not copied in two runs";
  EXPECT_EQ(more("aten::add_"), 2) << "the staged updates were not added in two runs";
}

TEST(StridedRuns, ColumnBlocksIntoStackRowsAreOneCopyPerRun) {
  // A [10, 5000] matrix in blocks of 1024 columns: four of 1024, then one of 904.
  const auto matrix = at::randn({10, 5000}, at::make_generator<at::CPUGeneratorImpl>(7));
  auto stack = at::full({4, 10, 1024}, NAN);
  auto last = at::full({10, 904}, NAN);
  std::vector<at::Tensor> to, from;
  for (int64_t b = 0; b < 5; ++b) {
    to.push_back(b < 4 ? stack[b] : last);
    from.push_back(matrix.narrow(1, 1024 * b, b < 4 ? 1024 : 904));
  }
  const auto runs = shampoo::detail::merge_strided_runs(to, from);
  ASSERT_EQ(runs.to.size(), 2u);
  EXPECT_EQ(runs.to[0].sizes(), at::IntArrayRef({4, 10, 1024}));
  EXPECT_EQ(runs.from[0].sizes(), at::IntArrayRef({4, 10, 1024}));
  shampoo::detail::copy_in_runs(to, from);
  for (int64_t b = 0; b < 5; ++b) {
    EXPECT_TRUE(bit_equal(to[static_cast<size_t>(b)], from[static_cast<size_t>(b)]))
        << "block " << b;
  }
}

TEST(StridedRuns, OnlyEquallySpacedViewsOfOneStorageMerge) {
  const auto source = at::randn({6, 8}, at::make_generator<at::CPUGeneratorImpl>(8));
  const auto other = at::randn({6, 8}, at::make_generator<at::CPUGeneratorImpl>(9));
  auto target = at::zeros({6, 8});
  using shampoo::detail::merge_strided_runs;
  // Rows in order: one run. Backwards, unequally spaced, or from another storage: none.
  EXPECT_EQ(merge_strided_runs({target[0], target[1], target[2]}, {source[3], source[4], source[5]})
                .to.size(),
            1u);
  EXPECT_EQ(merge_strided_runs({target[2], target[1]}, {source[2], source[1]}).to.size(), 2u);
  EXPECT_EQ(merge_strided_runs({target[0], target[1], target[3]}, {source[0], source[1], source[3]})
                .to.size(),
            2u);
  EXPECT_EQ(merge_strided_runs({target[0], target[1]}, {source[0], other[1]}).to.size(), 2u);
  // Views of other sizes or strides start a new run.
  EXPECT_EQ(merge_strided_runs({target[0].narrow(0, 0, 4), target[1]},
                               {source[0].narrow(0, 0, 4), source[1]})
                .to.size(),
            2u);
  // Whatever merges, every pair gets its values, bit for bit.
  std::vector<at::Tensor> to{target[0], target[1], target[3], target[4], target[5]};
  std::vector<at::Tensor> from{source[1], source[2], other[0], other[1], source[0]};
  shampoo::detail::copy_in_runs(to, from);
  for (size_t i = 0; i < to.size(); ++i) EXPECT_TRUE(bit_equal(to[i], from[i])) << "pair " << i;
  EXPECT_TRUE(bit_equal(target[2], at::zeros({8})));
}

}  // namespace
