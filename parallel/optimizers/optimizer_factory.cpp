// What the sharding wrappers check of the optimizer a GroupOptimizerFactory made.
#include "parallel/optimizers/optimizer_factory.h"

#include <c10/util/Exception.h>
#include <c10/util/TypeIndex.h>

#include <typeinfo>

namespace shampoo::detail {

void check_factory_optimizer(const torch::optim::Optimizer& optimizer, const std::string& who) {
  TORCH_CHECK(optimizer.param_groups().size() == 1, who,
              "the optimizer factory must return an optimizer with one param group (the one "
              "it is given); it returned one with ",
              optimizer.param_groups().size());
  // A LibTorch optimizer casts its groups' options to its own options type when it steps.
  const auto& options = optimizer.param_groups()[0].options();
  TORCH_CHECK(typeid(options) == typeid(optimizer.defaults()), who,
              "param group 0: its options are a ", c10::demangle(typeid(options).name()),
              ", but the factory's optimizer (a ", c10::demangle(typeid(optimizer).name()),
              ") takes ", c10::demangle(typeid(optimizer.defaults()).name()),
              " (give the param groups options of the optimizer's type, or none)");
}

}  // namespace shampoo::detail
