#include "parallel/optimizers/options_push.h"

#include <c10/util/Exception.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/output-archive.h>

#include <mutex>
#include <sstream>
#include <typeindex>
#include <unordered_map>
#include <utility>

#include "parallel/optimizers/local_optimizer.h"

namespace shampoo::detail {
namespace {

/// The registered equalities by options type, LibTorch's from the start.
class Equalities {
 public:
  static Equalities& instance() {
    static Equalities equalities;
    return equalities;
  }
  void add(const std::type_info& type, OptionsEqual equal) {
    std::lock_guard<std::mutex> lock(mutex_);
    by_type_.emplace(type, equal);
  }
  OptionsEqual find(const std::type_info& type) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = by_type_.find(type);
    return it == by_type_.end() ? nullptr : it->second;
  }

 private:
  Equalities() {
    using namespace torch::optim;  // NOLINT(google-build-using-namespace): six names below
    by_type_ = {{typeid(AdamOptions), &options_equal_as<AdamOptions>},
                {typeid(AdamWOptions), &options_equal_as<AdamWOptions>},
                {typeid(SGDOptions), &options_equal_as<SGDOptions>},
                {typeid(AdagradOptions), &options_equal_as<AdagradOptions>},
                {typeid(RMSpropOptions), &options_equal_as<RMSpropOptions>},
                {typeid(LBFGSOptions), &options_equal_as<LBFGSOptions>}};
  }
  std::mutex mutex_;
  std::unordered_map<std::type_index, OptionsEqual> by_type_;
};

/// The options as bytes, to notice a change in options of a type without a registered equality
/// (OptimizerOptions has no operator==).
std::string options_bytes(const torch::optim::OptimizerOptions& options) {
  torch::serialize::OutputArchive archive;
  options.serialize(archive);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

/// The options' lr; nullopt for an options type without one (OptimizerOptions::get_lr throws
/// unless the type overrides it; LibTorch's and ShampooOptions do).
std::optional<double> lr_of(const torch::optim::OptimizerOptions& options) {
  try {
    return options.get_lr();
  } catch (const c10::Error&) {
    return std::nullopt;
  }
}

}  // namespace

void register_options_equality(const std::type_info& type, OptionsEqual equal) {
  Equalities::instance().add(type, equal);
}

OptionsPush::Pushed OptionsPush::pushed_as(const torch::optim::OptimizerOptions& options) {
  const bool typed = Equalities::instance().find(typeid(options)) != nullptr;
  return {options.clone(), typed ? std::string() : options_bytes(options), lr_of(options)};
}

bool OptionsPush::unchanged(const Pushed& pushed, const torch::optim::OptimizerOptions& options) {
  if (!pushed.options || typeid(*pushed.options) != typeid(options)) return false;
  if (const auto equal = Equalities::instance().find(typeid(options))) {
    return equal(*pushed.options, options);
  }
  return options_bytes(options) == pushed.bytes;
}

OptionsPush::OptionsPush(std::string who, std::string user, std::string driven)
    : who_(std::move(who)), user_(std::move(user)), driven_(std::move(driven)) {}

void OptionsPush::add_group(const torch::optim::OptimizerOptions& options) {
  pushed_.push_back(pushed_as(options));
}

void OptionsPush::pop_group() { pushed_.pop_back(); }

void OptionsPush::replaced(size_t g) { pushed_.at(g) = {}; }

void OptionsPush::settled(size_t g, const torch::optim::OptimizerOptions& options) {
  pushed_.at(g) = pushed_as(options);
}

std::optional<double> OptionsPush::lr_set_on_driven(size_t g,
                                                    const std::vector<LocalOptimizer*>& driven,
                                                    bool single_group) const {
  const auto& before = pushed_[g].lr;
  if (!before) return std::nullopt;
  const size_t k = single_group ? 0 : g;
  size_t holders = 0;
  std::vector<double> set;
  for (const auto* local : driven) {
    const auto* optimizer = local != nullptr ? local->get() : nullptr;
    if (optimizer == nullptr || k >= optimizer->param_groups().size()) continue;
    ++holders;
    const auto lr = lr_of(optimizer->param_groups()[k].options());
    if (lr && *lr != *before) set.push_back(*lr);
  }
  if (set.empty()) return std::nullopt;
  for (const double lr : set) {
    TORCH_CHECK(lr == set.front(), who_, "the lr of param group ", g, " was set to different ",
                "values (", set.front(), ", ", lr, ") on ", driven_,
                " since the last step; set it on ", user_, " (every optimizer gets it)");
  }
  TORCH_CHECK(set.size() == holders, who_, "the lr of param group ", g, " was set on ", set.size(),
              " of the ", holders, " optimizers in ", driven_, " (to ", set.front(),
              ") since the last step; set it on ", user_, " (every optimizer gets it)");
  return set.front();
}

void OptionsPush::push(std::vector<torch::optim::OptimizerParamGroup>& groups,
                       const std::vector<LocalOptimizer*>& driven, bool single_group) {
  TORCH_INTERNAL_ASSERT(groups.size() == pushed_.size());
  // Checked for every group before anything changes.
  std::vector<std::optional<double>> taken(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    taken[g] = lr_set_on_driven(g, driven, single_group);
    if (!taken[g]) continue;
    const auto lr = lr_of(groups[g].options());
    TORCH_CHECK(lr && *lr == *pushed_[g].lr, who_, "the lr of param group ", g, " was set both on ",
                user_, " (", lr.value_or(0.0), ") and on ", driven_, " (", *taken[g],
                ") since the last step; set it on ", user_, " alone");
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    auto& options = groups[g].options();
    if (taken[g]) options.set_lr(*taken[g]);
    if (unchanged(pushed_[g], options)) continue;
    for (auto* local : driven) {
      if (local != nullptr) local->set_options(single_group ? 0 : g, options);
    }
    pushed_[g] = pushed_as(options);
  }
}

}  // namespace shampoo::detail
