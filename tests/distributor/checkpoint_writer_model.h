#pragma once
// The model of checkpoint_writer and of the kill tests that check its checkpoints: parameters of
// a few MB and few root computations (so that saves take most of the time and a kill at a random
// moment mostly lands in one), and fixed gradients.
#include <shampoo/shampoo.h>

#include <memory>
#include <vector>

namespace checkpoint_writer {

struct Model {
  std::vector<at::Tensor> params;
  std::unique_ptr<shampoo::DistributedShampoo> optimizer;

  Model() {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
    for (int i = 0; i < 6; ++i) params.push_back(at::randn({256, 256}, gen).requires_grad_());
    optimizer = std::make_unique<shampoo::DistributedShampoo>(
        params, shampoo::ShampooOptions::reference_defaults(0.01)
                    .epsilon(1e-6)
                    .precondition_frequency(50)
                    .max_preconditioner_dim(128)
                    .grafting(shampoo::AdamGraftingConfig{}));
  }

  void step(int t) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + t);
    for (auto& p : params) p.mutable_grad() = at::randn(p.sizes(), gen);
    optimizer->step();
  }
};

}  // namespace checkpoint_writer
