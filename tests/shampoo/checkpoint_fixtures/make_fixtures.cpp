// Writes the checkpoint fixtures of this folder: for every entry of fixture_configs.h, the
// initial parameters, three gradients, the parameters after two steps and the optimizer's
// checkpoint after them. Built against the version whose checkpoints the fixtures keep (see
// README.md in this folder); not part of the build.
#include <torch/serialize.h>

#include <iostream>

#include "fixture_configs.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: make_fixtures <output folder>\n";
    return 2;
  }
  const std::string dir = argv[1];
  for (const auto& fixture : shampoo::fixtures::fixture_configs()) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
    std::vector<at::Tensor> init, params;
    for (size_t i = 0; i < shampoo::fixtures::kParams; ++i) {
      init.push_back(at::randn(shampoo::fixtures::param_shape(i), gen));
      params.push_back(init.back().clone().requires_grad_());
    }
    std::vector<at::Tensor> grads;
    for (int s = 0; s <= shampoo::fixtures::kStepsBeforeCheckpoint; ++s) {
      for (size_t i = 0; i < shampoo::fixtures::kParams; ++i) {
        grads.push_back(at::randn(shampoo::fixtures::param_shape(i), gen));
      }
    }
    shampoo::DistributedShampoo optimizer(params, fixture.options);
    for (int s = 0; s < shampoo::fixtures::kStepsBeforeCheckpoint; ++s) {
      for (size_t i = 0; i < shampoo::fixtures::kParams; ++i) {
        params[i].mutable_grad() = grads[s * shampoo::fixtures::kParams + i].clone();
      }
      optimizer.step();
    }
    std::vector<at::Tensor> after;
    for (const auto& p : params) after.push_back(p.detach().clone());
    torch::save(init, dir + "/" + fixture.name + "_init.pt");
    torch::save(grads, dir + "/" + fixture.name + "_grads.pt");
    torch::save(after, dir + "/" + fixture.name + "_params.pt");
    torch::save(optimizer, dir + "/" + fixture.name + "_optimizer.pt");
    std::cout << fixture.name << "\n";
  }
  return 0;
}
