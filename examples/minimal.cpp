// The smallest complete use of DistributedShampoo: a 2-layer MLP on random data with README.md's
// recommended options, a few steps, then torch::save / torch::load of model and optimizer into
// fresh ones that keep training. Exits non-zero unless the loss decreased.
#include <fmt/format.h>
#include <shampoo/shampoo.h>
#include <torch/torch.h>

int main() {
  torch::manual_seed(0);
  const auto x = torch::randn({256, 16});
  const auto y = x.sum(1, /*keepdim=*/true).sin();  // a smooth target the MLP can fit
  auto make_model = [] {
    return torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::Tanh(),
                                 torch::nn::Linear(32, 1));
  };
  auto make_optimizer = [](torch::nn::Sequential& model) {
    return shampoo::DistributedShampoo(model->parameters(),
                                       shampoo::ShampooOptions(1e-2)
                                           .betas({0.9, 0.999})
                                           .epsilon(1e-12)
                                           .precondition_frequency(50)
                                           .grafting(shampoo::AdamGraftingConfig{0.999, 1e-8}));
  };
  auto train = [&](torch::nn::Sequential& model, shampoo::DistributedShampoo& optimizer,
                   int steps) {
    double loss = 0;
    for (int step = 0; step < steps; ++step) {
      optimizer.zero_grad();
      auto l = torch::mse_loss(model->forward(x), y);
      l.backward();
      optimizer.step();
      loss = l.item<double>();
    }
    return loss;
  };
  auto model = make_model();
  auto optimizer = make_optimizer(model);
  const double first = torch::mse_loss(model->forward(x), y).item<double>();
  const double before_save = train(model, optimizer, 60);
  torch::save(model, "minimal_model.pt");
  torch::save(optimizer, "minimal_optimizer.pt");

  auto resumed_model = make_model();  // fresh, other initial weights: everything comes from disk
  auto resumed_optimizer = make_optimizer(resumed_model);
  torch::load(resumed_model, "minimal_model.pt");
  torch::load(resumed_optimizer, "minimal_optimizer.pt");
  const double last = train(resumed_model, resumed_optimizer, 60);
  fmt::print("loss: {:.6f} at start, {:.6f} after 60 steps, {:.6f} after 60 more (resumed)\n",
             first, before_save, last);
  return last < before_save && before_save < first ? 0 : 1;
}
