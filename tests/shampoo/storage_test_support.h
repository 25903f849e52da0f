#pragma once
// Shared by the storage tests (symmetric_packing_test, compact_state_test): six parameters of
// assorted shapes, three param groups that differ only in lr (one virtual group when merged), and
// a step on seeded random gradients.
#include <shampoo/shampoo.h>

#include <memory>
#include <string>
#include <vector>

#include "support/test_support.h"

namespace shampoo::testing::storage {

/// A named set of options: one case of a parametrized storage test.
struct NamedOptions {
  std::string name;
  ShampooOptions options = ShampooOptions::reference_defaults();
};

inline std::vector<at::Tensor> make_params() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  std::vector<at::Tensor> params;
  for (const auto& shape :
       std::vector<std::vector<int64_t>>{{9, 7}, {13}, {4, 3, 5}, {20, 11}, {6}, {5, 5}}) {
    params.push_back(at::randn(shape, gen).requires_grad_());
  }
  return params;
}

/// Three groups with different floats: one virtual group when merged.
inline std::vector<torch::optim::OptimizerParamGroup> make_groups(
    const std::vector<at::Tensor>& params, const ShampooOptions& options) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (size_t g = 0; g < 3; ++g) {
    auto group_options = std::make_unique<ShampooOptions>(options);
    group_options->lr(options.lr() * (1.0 + 0.25 * static_cast<double>(g)));
    groups.emplace_back(std::vector<at::Tensor>{params[2 * g], params[2 * g + 1]},
                        std::move(group_options));
  }
  return groups;
}

inline void step(DistributedShampoo& opt, const std::vector<at::Tensor>& params, int t) {
  set_random_grads(params, 700 + t);
  opt.step();
}

}  // namespace shampoo::testing::storage
