// LR schedulers (shampoo/lr_schedulers.h): each case's lrs equal PyTorch 2.11's bit for bit, step
// for step (golden data from tests/shampoo/make_lr_schedule_golden.py), through LibTorch's SGD,
// Adam and DistributedShampoo held as a torch::optim::Optimizer&; the lrs reach the optimizers'
// steps; resume(N) continues as the uninterrupted run, also through a checkpoint; bad arguments
// raise errors that name them. Everything is compared bit for bit, no tolerance: the C++ code
// repeats PyTorch's double arithmetic operation for operation and calls the same C library's cos
// and pow (the golden file was written on x86-64 Linux with glibc; a libm that rounded cos
// differently would show here as differences in the last bit).
#include <c10/util/Exception.h>
#include <shampoo/shampoo.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "support/test_support.h"

namespace {

using shampoo::testing::bit_equal;
using shampoo::testing::expect_error;
using History = std::vector<std::vector<double>>;  // [step][group]: the lrs after step() × step

constexpr int64_t kSteps = 60;  // as make_lr_schedule_golden.py's STEPS

// ---- the cases, as make_lr_schedule_golden.py's CASES ------------------------------------------

double pow95(int64_t epoch) { return std::pow(0.95, static_cast<double>(epoch)); }
double harmonic(int64_t epoch) { return 1.0 / static_cast<double>(epoch + 1); }
double ramp(int64_t epoch) { return std::min(1.0, static_cast<double>(epoch + 1) / 10); }

using MakeScheduler =
    std::function<std::unique_ptr<torch::optim::LRScheduler>(torch::optim::Optimizer&)>;

struct Case {
  std::vector<double> lrs;  // the param groups' lrs
  MakeScheduler make;
};

template <typename Scheduler, typename... Args>
MakeScheduler make(Args... args) {
  return [=](torch::optim::Optimizer& optimizer) {
    return std::make_unique<Scheduler>(optimizer, args...);
  };
}

MakeScheduler sequential(std::vector<shampoo::LrSchedule> schedules,
                         std::vector<int64_t> milestones) {
  return make<shampoo::SequentialLr>(schedules, milestones);
}

const std::map<std::string, Case>& cases() {
  using shampoo::CosineAnnealingLr;
  using shampoo::CosineAnnealingLrOptions;
  using shampoo::LambdaLr;
  using shampoo::LinearLr;
  using shampoo::LinearLrOptions;
  using shampoo::LrLambda;
  static const std::map<std::string, Case> table = {
      {"lambda_pow", {{0.1, 0.03}, make<LambdaLr>(LrLambda(pow95))}},
      {"lambda_per_group",
       {{0.1, 0.03}, make<LambdaLr>(shampoo::LambdaLrOptions({LrLambda(pow95), harmonic}))}},
      {"lambda_ramp", {{0.2}, make<LambdaLr>(LrLambda(ramp))}},
      {"linear_default", {{0.05}, make<LinearLr>()}},
      {"linear_warmup", {{0.1, 0.003}, make<LinearLr>(0.01, 1.0, int64_t{25})}},
      {"linear_decay", {{0.2}, make<LinearLr>(1.0, 0.1, int64_t{40})}},
      {"linear_to_zero",
       {{0.07},
        make<LinearLr>(LinearLrOptions().start_factor(0.5).end_factor(0.0).total_iters(10))}},
      {"cosine", {{0.1, 0.025}, make<CosineAnnealingLr>(int64_t{20})}},
      {"cosine_eta_min", {{0.1, 0.003}, make<CosineAnnealingLr>(int64_t{13}, 1e-4)}},
      {"cosine_t_max_1",
       {{0.1}, make<CosineAnnealingLr>(CosineAnnealingLrOptions(1).eta_min(0.01))}},
      {"cosine_long", {{3e-4}, make<CosineAnnealingLr>(int64_t{57}, 1e-6)}},
      {"sequential_warmup_cosine",
       {{0.1, 0.02},
        sequential({LinearLrOptions().start_factor(0.01).end_factor(1.0).total_iters(10),
                    CosineAnnealingLrOptions(40).eta_min(1e-5)},
                   {10})}},
      {"sequential_three",
       {{0.1, 0.03},
        sequential({LinearLrOptions().start_factor(0.1).total_iters(5),
                    CosineAnnealingLrOptions(10).eta_min(1e-3), shampoo::LambdaLrOptions(pow95)},
                   {5, 15})}},
      {"sequential_cosine_first",
       {{0.05},
        sequential({CosineAnnealingLrOptions(8).eta_min(1e-3),
                    LinearLrOptions().start_factor(0.5).end_factor(1.0).total_iters(4)},
                   {8})}},
      {"sequential_lambda_first",
       {{0.05}, sequential({shampoo::LambdaLrOptions(ramp), CosineAnnealingLrOptions(30)}, {12})}},
      {"sequential_restart_rounding",
       {{0.3, 0.1},
        sequential({LinearLrOptions().start_factor(0.2).total_iters(6),
                    CosineAnnealingLrOptions(20).eta_min(0.03)},
                   {6})}},
      {"sequential_one", {{0.05}, sequential({LinearLrOptions().total_iters(7)}, {})}},
      {"warmup_cosine",
       {{0.1, 0.02},
        [](torch::optim::Optimizer& optimizer) {
          return std::make_unique<shampoo::SequentialLr>(
              shampoo::warmup_cosine(optimizer, /*warmup_steps=*/10, /*total_steps=*/50,
                                     /*eta_min=*/1e-5, /*start_factor=*/0.01));
        }}},
      {"warmup_cosine_no_warmup",
       {{0.1},
        [](torch::optim::Optimizer& optimizer) {
          return std::make_unique<shampoo::SequentialLr>(
              shampoo::warmup_cosine(optimizer, /*warmup_steps=*/0, /*total_steps=*/30));
        }}},
  };
  return table;
}

// ---- the golden data ---------------------------------------------------------------------------

/// case name -> [group][step] lrs, read from the hexadecimal floats of the golden file.
std::map<std::string, std::vector<std::vector<double>>> read_golden() {
  std::ifstream file(SHAMPOO_LR_SCHEDULE_GOLDEN);
  EXPECT_TRUE(file.good()) << "cannot open " << SHAMPOO_LR_SCHEDULE_GOLDEN;
  std::map<std::string, std::vector<std::vector<double>>> golden;
  std::string line;
  std::getline(file, line);
  EXPECT_EQ(line.rfind("torch 2.11.0", 0), 0u) << "first line: " << line;
  while (std::getline(file, line)) {
    std::istringstream in(line);
    std::string name, word;
    size_t group = 0;
    in >> name >> group;
    auto& groups = golden[name];
    EXPECT_EQ(group, groups.size()) << line;
    groups.emplace_back();
    while (in >> word) groups.back().push_back(std::strtod(word.c_str(), nullptr));
  }
  return golden;
}

const std::vector<std::vector<double>>& golden(const std::string& name) {
  static const auto all = read_golden();
  const auto found = all.find(name);
  if (found == all.end()) {
    ADD_FAILURE() << "no case " << name << " in " << SHAMPOO_LR_SCHEDULE_GOLDEN;
    static const std::vector<std::vector<double>> none;
    return none;
  }
  return found->second;
}

std::string hex(double value) {
  std::ostringstream out;
  out << std::hexfloat << value;
  return out.str();
}

/// history[step][group] == golden[group][step] for every step and group, bit for bit.
::testing::AssertionResult equals_golden(const History& history,
                                         const std::vector<std::vector<double>>& expected) {
  if (expected.empty() || expected.size() != history.at(0).size()) {
    return ::testing::AssertionFailure() << "golden data for " << expected.size() << " groups, "
                                         << history.at(0).size() << " in the run";
  }
  for (size_t step = 0; step < history.size(); ++step) {
    for (size_t g = 0; g < expected.size(); ++g) {
      if (step >= expected[g].size() || history[step][g] != expected[g][step]) {
        return ::testing::AssertionFailure()
               << "group " << g << ", lr after " << step << " step() calls: got "
               << hex(history[step][g]) << ", PyTorch "
               << (step < expected[g].size() ? hex(expected[g][step]) : "(none)");
      }
    }
  }
  return ::testing::AssertionSuccess();
}

// ---- runs --------------------------------------------------------------------------------------

std::vector<double> group_lrs(const torch::optim::Optimizer& optimizer) {
  std::vector<double> lrs;
  for (const auto& group : optimizer.param_groups()) lrs.push_back(group.options().get_lr());
  return lrs;
}

/// One zero parameter per group (as the golden script's SGD).
std::vector<torch::optim::OptimizerParamGroup> param_groups(const std::vector<double>& lrs,
                                                            bool adam) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (const double lr : lrs) {
    std::vector<at::Tensor> params{at::zeros({2, 3}).requires_grad_()};
    if (adam) {
      groups.emplace_back(params, std::make_unique<torch::optim::AdamOptions>(lr));
    } else {
      groups.emplace_back(params, std::make_unique<torch::optim::SGDOptions>(lr));
    }
  }
  return groups;
}

/// The lrs after construction and after each of `steps` step() calls.
History run_schedule(torch::optim::Optimizer& optimizer, torch::optim::LRScheduler& scheduler,
                     int64_t steps) {
  History history{group_lrs(optimizer)};
  for (int64_t t = 0; t < steps; ++t) {
    scheduler.step();
    history.push_back(group_lrs(optimizer));
  }
  return history;
}

/// history[from..][group] as [group][step − from], the golden data's order.
std::vector<std::vector<double>> by_group(const History& history, int64_t from) {
  std::vector<std::vector<double>> groups(history.at(0).size());
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t t = from; t < history.size(); ++t) groups[g].push_back(history[t][g]);
  }
  return groups;
}

class LrSchedulerGolden : public ::testing::TestWithParam<std::string> {};

TEST_P(LrSchedulerGolden, SgdLrsEqualPyTorch) {
  const Case& c = cases().at(GetParam());
  torch::optim::SGD sgd(param_groups(c.lrs, false), torch::optim::SGDOptions(1.0));
  torch::optim::Optimizer& optimizer = sgd;
  auto scheduler = c.make(optimizer);
  EXPECT_TRUE(equals_golden(run_schedule(optimizer, *scheduler, kSteps), golden(GetParam())));
  // The bookkeeping PyTorch users read: last_epoch and get_last_lr().
  const auto& ours = dynamic_cast<const shampoo::PhasedLrScheduler&>(*scheduler);
  EXPECT_EQ(ours.last_epoch(), kSteps);
  EXPECT_EQ(ours.get_last_lr(), group_lrs(optimizer));
  EXPECT_EQ(ours.base_lrs(), c.lrs);
}

TEST_P(LrSchedulerGolden, AdamLrsEqualPyTorch) {
  const Case& c = cases().at(GetParam());
  torch::optim::Adam adam(param_groups(c.lrs, true), torch::optim::AdamOptions(1.0));
  torch::optim::Optimizer& optimizer = adam;
  auto scheduler = c.make(optimizer);
  EXPECT_TRUE(equals_golden(run_schedule(optimizer, *scheduler, kSteps), golden(GetParam())));
}

TEST_P(LrSchedulerGolden, ShampooLrsEqualPyTorch) {
  const Case& c = cases().at(GetParam());
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (const double lr : c.lrs) {
    groups.emplace_back(std::vector<at::Tensor>{at::zeros({4, 3}).requires_grad_()},
                        std::make_unique<shampoo::ShampooOptions>(lr));
  }
  shampoo::DistributedShampoo shampoo(groups, shampoo::ShampooOptions(1.0));
  torch::optim::Optimizer& optimizer = shampoo;
  auto scheduler = c.make(optimizer);
  EXPECT_TRUE(equals_golden(run_schedule(optimizer, *scheduler, kSteps), golden(GetParam())));
  for (size_t g = 0; g < c.lrs.size(); ++g) {
    EXPECT_EQ(shampoo.group_options(g).lr(), golden(GetParam())[g][kSteps]);
  }
}

/// resume(N) on a fresh scheduler, whatever lrs the optimizer holds, gives the lrs of the
/// uninterrupted run after N steps and continues as it did.
TEST_P(LrSchedulerGolden, ResumeAfterAnyStepEqualsUninterrupted) {
  const Case& c = cases().at(GetParam());
  torch::optim::SGD sgd(param_groups(c.lrs, false), torch::optim::SGDOptions(1.0));
  auto scheduler = c.make(sgd);
  const History uninterrupted = run_schedule(sgd, *scheduler, kSteps);
  for (const int64_t n : {0, 1, 2, 5, 9, 10, 11, 12, 14, 15, 16, 20, 21, 27, 40, 41, 59, 60}) {
    torch::optim::SGD fresh(param_groups(c.lrs, false), torch::optim::SGDOptions(1.0));
    auto resumed = c.make(fresh);
    for (auto& group : fresh.param_groups()) group.options().set_lr(123.0);  // a stale lr
    dynamic_cast<shampoo::PhasedLrScheduler&>(*resumed).resume(n);
    const History rest = run_schedule(fresh, *resumed, kSteps - n);
    EXPECT_TRUE(equals_golden(rest, by_group(uninterrupted, n)))
        << "resumed after " << n << " steps (lrs numbered from there)";
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, LrSchedulerGolden, ::testing::ValuesIn([] {
                           std::vector<std::string> names;
                           for (const auto& [name, c] : cases()) names.push_back(name);
                           return names;
                         }()),
                         [](const auto& info) { return info.param; });

TEST(LrSchedulerGoldenFile, HoldsExactlyTheCasesOfThisTest) {
  std::ifstream file(SHAMPOO_LR_SCHEDULE_GOLDEN);
  std::string line;
  std::getline(file, line);
  size_t lines = 0;
  while (std::getline(file, line)) {
    std::istringstream in(line);
    std::string name;
    in >> name;
    EXPECT_EQ(cases().count(name), 1u) << "golden case " << name << " has no C++ case";
    ++lines;
  }
  size_t groups = 0;
  for (const auto& [name, c] : cases()) groups += c.lrs.size();
  EXPECT_EQ(lines, groups);
}

// ---- the lrs reach the steps -------------------------------------------------------------------

/// A small least-squares problem stepped `steps` times; before step t + 1 the lrs are either left
/// to the scheduler (its step() after each optimizer step) or set by hand from `lrs[t]`.
std::vector<at::Tensor> train(torch::optim::Optimizer& optimizer,
                              const std::vector<at::Tensor>& params,
                              torch::optim::LRScheduler* scheduler, const History& lrs,
                              int64_t steps) {
  const auto x = at::linspace(-1, 1, 24).reshape({8, 3});
  const auto y = at::cos(at::arange(8, at::kFloat)).reshape({8, 1});
  for (int64_t t = 0; t < steps; ++t) {
    if (scheduler == nullptr) {
      for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
        optimizer.param_groups()[g].options().set_lr(lrs[t][g]);
      }
    }
    optimizer.zero_grad();
    const auto loss = (x.matmul(params[0]).add(params[1]) - y).pow(2).mean();
    loss.backward();
    optimizer.step();
    if (scheduler != nullptr) scheduler->step();
  }
  return shampoo::testing::snapshot(params);
}

std::vector<at::Tensor> two_params() {
  return {at::full({3, 1}, 0.3).requires_grad_(), at::full({1}, -0.2).requires_grad_()};
}

std::vector<torch::optim::OptimizerParamGroup> adam_groups(const std::vector<at::Tensor>& params) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{params[0]},
                      std::make_unique<torch::optim::AdamOptions>(0.1));
  groups.emplace_back(std::vector<at::Tensor>{params[1]},
                      std::make_unique<torch::optim::AdamOptions>(0.02));
  return groups;
}

TEST(LrSchedulerStep, AdamWithWarmupCosineEqualsAdamWithTheLrsSetByHand) {
  const auto& lrs = golden("warmup_cosine");  // groups 0.1 and 0.02
  History by_step(kSteps + 1);
  for (int64_t t = 0; t <= kSteps; ++t) by_step[t] = {lrs[0][t], lrs[1][t]};
  const auto scheduled_params = two_params();
  torch::optim::Adam scheduled(adam_groups(scheduled_params), torch::optim::AdamOptions(1.0));
  auto scheduler = shampoo::warmup_cosine(scheduled, 10, 50, 1e-5, 0.01);
  const auto by_hand_params = two_params();
  torch::optim::Adam by_hand(adam_groups(by_hand_params), torch::optim::AdamOptions(1.0));
  const auto a = train(scheduled, scheduled_params, &scheduler, by_step, 40);
  const auto b = train(by_hand, by_hand_params, nullptr, by_step, 40);
  EXPECT_TRUE(bit_equal(a, b));
  // Not the constant lr's run: the schedule matters here.
  const auto constant_params = two_params();
  torch::optim::Adam constant(adam_groups(constant_params), torch::optim::AdamOptions(1.0));
  History base(kSteps + 1, std::vector<double>{0.1, 0.02});
  EXPECT_FALSE(bit_equal(train(constant, constant_params, nullptr, base, 40), a));
}

shampoo::DistributedShampoo make_shampoo(const std::vector<at::Tensor>& params) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  auto options =
      shampoo::ShampooOptions(0.1).precondition_frequency(3).start_preconditioning_step(3);
  groups.emplace_back(std::vector<at::Tensor>{params[0]},
                      std::make_unique<shampoo::ShampooOptions>(options));
  groups.emplace_back(std::vector<at::Tensor>{params[1]},
                      std::make_unique<shampoo::ShampooOptions>(options.lr(0.02)));
  return shampoo::DistributedShampoo(groups, options);
}

TEST(LrSchedulerStep, ShampooWithCosineEqualsShampooWithTheLrsSetByHand) {
  const auto& lrs = golden("cosine");  // groups 0.1 and 0.025, T_max 20, past it from step 21
  const auto scheduled_params = two_params();
  auto scheduled = make_shampoo(scheduled_params);
  scheduled.param_groups()[1].options().set_lr(0.025);
  torch::optim::Optimizer& optimizer = scheduled;
  shampoo::CosineAnnealingLr scheduler(optimizer, 20);
  History by_step(kSteps + 1);
  for (int64_t t = 0; t <= kSteps; ++t) by_step[t] = {lrs[0][t], lrs[1][t]};
  const auto by_hand_params = two_params();
  auto by_hand = make_shampoo(by_hand_params);
  const auto a = train(optimizer, scheduled_params, &scheduler, by_step, 30);
  const auto b = train(by_hand, by_hand_params, nullptr, by_step, 30);
  EXPECT_TRUE(bit_equal(a, b));
}

/// The trainer's way of resuming: the scheduler made on the fresh optimizer, the optimizer and
/// parameters loaded from a checkpoint taken after N steps, then resume(N).
TEST(LrSchedulerResume, ShampooFromACheckpointContinuesAsTheUninterruptedRun) {
  constexpr int64_t kTotal = 30;
  const History none;
  for (const int64_t n : {4, 10, 17}) {
    const auto uninterrupted_params = two_params();
    auto uninterrupted = make_shampoo(uninterrupted_params);
    auto uninterrupted_scheduler = shampoo::warmup_cosine(uninterrupted, 8, kTotal, 1e-4, 0.05);
    const auto expected =
        train(uninterrupted, uninterrupted_params, &uninterrupted_scheduler, none, kTotal);

    const auto first_params = two_params();
    auto first = make_shampoo(first_params);
    auto first_scheduler = shampoo::warmup_cosine(first, 8, kTotal, 1e-4, 0.05);
    const auto at_save = train(first, first_params, &first_scheduler, none, n);
    const auto path = shampoo::testing::temp_path("lr_schedulers_resume.pt");
    torch::save(first, path);

    const auto resumed_params = two_params();
    auto resumed = make_shampoo(resumed_params);
    auto resumed_scheduler = shampoo::warmup_cosine(resumed, 8, kTotal, 1e-4, 0.05);
    torch::load(resumed, path);
    std::filesystem::remove(path);
    {
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < resumed_params.size(); ++i) resumed_params[i].copy_(at_save[i]);
    }
    resumed_scheduler.resume(n);
    EXPECT_EQ(resumed_scheduler.get_last_lr(), first_scheduler.get_last_lr()) << n;
    EXPECT_TRUE(
        bit_equal(train(resumed, resumed_params, &resumed_scheduler, none, kTotal - n), expected))
        << "resumed after " << n << " steps";
  }
}

// ---- bad arguments -----------------------------------------------------------------------------

struct Sgd {
  std::vector<at::Tensor> params{at::zeros({2}).requires_grad_()};
  torch::optim::SGD optimizer{params, torch::optim::SGDOptions(0.1)};
};

TEST(LrSchedulerArguments, LinearLrNamesTheFactorOrCount) {
  Sgd s;
  expect_error([&] { shampoo::LinearLr(s.optimizer, 0.0); },
               {"LinearLr: start_factor: got 0, expected a value in (0, 1]"});
  expect_error([&] { shampoo::LinearLr(s.optimizer, 1.5); },
               {"LinearLr: start_factor: got 1.5", "(0, 1]"});
  expect_error([&] { shampoo::LinearLr(s.optimizer, std::nan("")); },
               {"LinearLr: start_factor: got nan"});
  expect_error([&] { shampoo::LinearLr(s.optimizer, 0.5, -0.1); },
               {"LinearLr: end_factor: got -0.1, expected a value in [0, 1]"});
  expect_error([&] { shampoo::LinearLr(s.optimizer, 0.5, 1.0, 0); },
               {"LinearLr: total_iters: got 0, expected >= 1"});
}

TEST(LrSchedulerArguments, CosineAnnealingLrNamesTMaxOrEtaMin) {
  Sgd s;
  expect_error([&] { shampoo::CosineAnnealingLr(s.optimizer, 0); },
               {"CosineAnnealingLr: t_max: got 0, expected >= 1"});
  expect_error([&] { shampoo::CosineAnnealingLr(s.optimizer, -3); }, {"t_max: got -3"});
  expect_error([&] { shampoo::CosineAnnealingLr(s.optimizer, 10, -1e-3); },
               {"CosineAnnealingLr: eta_min: got -0.001, expected a finite value >= 0"});
  expect_error(
      [&] { shampoo::CosineAnnealingLr(s.optimizer, 10, std::numeric_limits<double>::infinity()); },
      {"eta_min: got inf"});
}

TEST(LrSchedulerArguments, LambdaLrNamesTheFunctions) {
  std::vector<at::Tensor> a{at::zeros({2}).requires_grad_()}, b{at::zeros({2}).requires_grad_()};
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(a);
  groups.emplace_back(b);
  torch::optim::SGD sgd(groups, torch::optim::SGDOptions(0.1));
  const shampoo::LrLambda f = pow95;
  expect_error(
      [&] {
        shampoo::LambdaLr(sgd, std::vector<shampoo::LrLambda>{f, f, f});
      },
      {"LambdaLr: lr_lambdas: got 3 functions", "one per param group (2)"});
  expect_error(
      [&] {
        shampoo::LambdaLr(sgd, std::vector<shampoo::LrLambda>{f, nullptr});
      },
      {"LambdaLr: lr_lambdas[1]: got an empty std::function"});
  expect_error([&] { shampoo::LambdaLr(sgd, shampoo::LrLambda()); },
               {"LambdaLr: lr_lambdas[0]: got an empty std::function"});
}

TEST(LrSchedulerArguments, SequentialLrNamesTheMilestonesOrTheSchedule) {
  Sgd s;
  const shampoo::LinearLrOptions linear;
  const shampoo::CosineAnnealingLrOptions cosine(10);
  expect_error([&] { shampoo::SequentialLr(s.optimizer, {}, {}); },
               {"SequentialLr: schedules: got none, expected at least one"});
  expect_error(
      [&] {
        shampoo::SequentialLr(s.optimizer, {linear, cosine}, {});
      },
      {"SequentialLr: milestones: got 0 ([]) for 2 schedules",
       "expected one fewer than the schedules"});
  expect_error(
      [&] {
        shampoo::SequentialLr(s.optimizer, {linear, cosine, linear}, {5, 5});
      },
      {"SequentialLr: milestones: got [5, 5], expected strictly increasing epochs >= 1"});
  expect_error(
      [&] {
        shampoo::SequentialLr(s.optimizer, {linear, cosine}, {0});
      },
      {"milestones: got [0]"});
  expect_error(
      [&] {
        shampoo::SequentialLr(s.optimizer, {linear, shampoo::CosineAnnealingLrOptions(0)}, {5});
      },
      {"SequentialLr: schedules[1].t_max: got 0, expected >= 1"});
}

TEST(LrSchedulerArguments, WarmupCosineNamesTheSteps) {
  Sgd s;
  expect_error([&] { shampoo::warmup_cosine(s.optimizer, 10, 10); },
               {"warmup_cosine: warmup_steps: got 10, expected 0 <= warmup_steps < total_steps "
                "(10)"});
  expect_error([&] { shampoo::warmup_cosine(s.optimizer, -1, 10); }, {"warmup_steps: got -1"});
  expect_error([&] { shampoo::warmup_cosine(s.optimizer, 0, 0); },
               {"warmup_cosine: total_steps: got 0, expected >= 1"});
  expect_error([&] { shampoo::warmup_cosine(s.optimizer, 2, 10, -1.0); },
               {"warmup_cosine: eta_min: got -1"});
  expect_error([&] { shampoo::warmup_cosine(s.optimizer, 2, 10, 0.0, 0.0); },
               {"warmup_cosine: start_factor: got 0, expected a value in (0, 1]"});
}

TEST(LrSchedulerArguments, ResumeAndAGroupAddedLater) {
  Sgd s;
  shampoo::CosineAnnealingLr scheduler(s.optimizer, 10);
  expect_error([&] { scheduler.resume(-1); },
               {"CosineAnnealingLr::resume: steps_taken: got -1, expected >= 0"});
  s.optimizer.add_param_group(torch::optim::OptimizerParamGroup({at::zeros({2}).requires_grad_()}));
  expect_error([&] { scheduler.step(); },
               {"CosineAnnealingLr: the optimizer has 2 param groups, the scheduler was made "
                "for 1"});
  expect_error([&] { scheduler.resume(3); }, {"the optimizer has 2 param groups"});
}

}  // namespace
