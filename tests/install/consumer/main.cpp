// Minimizes a quadratic with DistributedShampoo from the installed package.
#include <shampoo/shampoo.h>

#include <iostream>

int main() {
  auto target = at::randn({8, 4});
  auto w = at::zeros({8, 4}).requires_grad_();
  shampoo::DistributedShampoo optimizer(
      {w}, shampoo::ShampooOptions(0.1).epsilon(1e-8).grafting(shampoo::AdamGraftingConfig{}));
  double first = 0.0, last = 0.0;
  for (int step = 0; step < 50; ++step) {
    optimizer.zero_grad();
    auto loss = (w - target).pow(2).sum();
    loss.backward();
    optimizer.step();
    last = loss.item<double>();
    if (step == 0) first = last;
  }
  std::cout << "consumer: loss " << first << " -> " << last << " (version " << SHAMPOO_VERSION
            << ")\n";
  if (!(last < 0.1 * first)) return 1;
  std::cout << "consumer: ok\n";
  return 0;
}
