// A step that throws changes nothing (parameters, step counts, every state tensor) and a later
// step works, for one process and for two ranks, merged and unmerged groups, at every phase of
// the step; and a group whose parameters had no gradient is not stepped (torch::optim's rule),
// with equal step counts on every rank.
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <shampoo/shampoo.h>
#include <torch/serialize.h>

#include <atomic>
#include <sstream>
#include <string>
#include <variant>
#include <vector>

#include "support/test_support.h"

namespace {

using shampoo::DistributedOptions;
using shampoo::DistributedShampoo;
using shampoo::FaultPoint;
using shampoo::ShampooOptions;
using shampoo::testing::bit_equal;
using shampoo::testing::run_ranks;
using shampoo::testing::snapshot;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

// Every kind of state: filter, grafting (Adam), momentum, factors, roots recomputed every other
// step.
ShampooOptions base_options(bool eigenvalue_corrected) {
  auto options = ShampooOptions::reference_defaults(0.02)
                     .betas({0.9, 0.99})
                     .epsilon(1e-8)
                     .momentum(0.5)
                     .weight_decay(1e-3)
                     .precondition_frequency(2)
                     .start_preconditioning_step(2)
                     .use_merge_dims(false)  // keep 2-D and 3-D blocks
                     .grafting(shampoo::AdamGraftingConfig{0.999, 1e-8});
  if (eigenvalue_corrected) options.preconditioner(shampoo::EigenvalueCorrectedShampooConfig{});
  return options;
}

std::vector<at::Tensor> make_params() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  std::vector<at::Tensor> params;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{6, 5}, {7}, {3, 4, 2}, {5, 5}}) {
    params.push_back(at::randn(shape, gen).requires_grad_());
  }
  return params;
}

// Three groups: the first two differ only in lr (one virtual group when merged), the third in a
// structural option (its own virtual group).
std::vector<torch::optim::OptimizerParamGroup> make_groups(const std::vector<at::Tensor>& params,
                                                           const ShampooOptions& base) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{params[0]}, std::make_unique<ShampooOptions>(base));
  groups.emplace_back(std::vector<at::Tensor>{params[1], params[2]},
                      std::make_unique<ShampooOptions>(ShampooOptions(base).lr(0.01)));
  groups.emplace_back(std::vector<at::Tensor>{params[3]},
                      std::make_unique<ShampooOptions>(ShampooOptions(base).use_nesterov(true)));
  return groups;
}

void set_grads(const std::vector<at::Tensor>& params, int step) {
  shampoo::testing::set_random_grads(params, 700 + step);
}

/// Everything a step may change: parameters, step counts, every state tensor (the checkpoint).
struct Observed {
  std::vector<at::Tensor> params;
  std::vector<int64_t> steps;
  std::string checkpoint;
  int64_t computations = 0;
  int64_t failures = 0;
};

Observed observe(const DistributedShampoo& opt, const std::vector<at::Tensor>& params) {
  Observed o;
  o.params = snapshot(params);
  for (size_t g = 0; g < opt.param_groups().size(); ++g) o.steps.push_back(opt.group_step(g));
  std::ostringstream stream;
  torch::save(opt, stream);
  o.checkpoint = stream.str();
  o.computations = opt.stats().amortized_computations;
  o.failures = opt.stats().failed_amortized_computations;
  return o;
}

::testing::AssertionResult unchanged(const Observed& before, const Observed& after) {
  auto params = bit_equal(after.params, before.params);
  if (!params) return params << " (parameters changed)";
  if (after.steps != before.steps) return ::testing::AssertionFailure() << "step counts changed";
  if (after.checkpoint != before.checkpoint) {
    return ::testing::AssertionFailure() << "optimizer state changed";
  }
  if (after.computations != before.computations || after.failures != before.failures) {
    return ::testing::AssertionFailure() << "amortized counters changed";
  }
  return ::testing::AssertionSuccess();
}

/// step() must throw and leave everything as it was.
void expect_failed_step_changes_nothing(DistributedShampoo& opt,
                                        const std::vector<at::Tensor>& params,
                                        const std::string& what) {
  const auto before = observe(opt, params);
  EXPECT_THROW(opt.step(), c10::Error) << what;
  EXPECT_TRUE(unchanged(before, observe(opt, params))) << what;
}

/// Throws once at `phase` when armed (on the ranks where it is armed), after letting `skip`
/// occurrences of the phase pass.
struct Fault {
  std::atomic<bool> armed{false};
  FaultPoint phase = FaultPoint::kExchange;
  int skip = 0;
  shampoo::StepFaultInjector injector() {
    return [this](FaultPoint p) {
      if (p != phase || !armed) return;
      if (skip > 0) {
        --skip;
        return;
      }
      armed = false;
      TORCH_CHECK(false, "injected fault");
    };
  }
};

struct Case {
  std::string name;
  bool merge;
  bool eigenvalue_corrected;
  FaultPoint phase;
  shampoo::CompactState compact = shampoo::CompactState::kNone;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

std::string phase_name(FaultPoint phase) {
  switch (phase) {
    case FaultPoint::kStatisticsUpdated:
      return "statistics_updated";
    case FaultPoint::kBeforeUpdate:
      return "before_update";
    case FaultPoint::kComputed:
      return "computed";
    case FaultPoint::kExchange:
      return "exchange";
  }
  return "unknown";
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const bool merge : {true, false}) {
    for (const bool soap : {false, true}) {
      for (const auto phase : {FaultPoint::kStatisticsUpdated, FaultPoint::kBeforeUpdate,
                               FaultPoint::kComputed, FaultPoint::kExchange}) {
        out.push_back({std::string(merge ? "merged" : "unmerged") + (soap ? "_soap_" : "_") +
                           phase_name(phase),
                       merge, soap, phase});
      }
    }
  }
  // compact_state: the undo journal holds decoded values, which encode back to the same bytes.
  for (const auto phase : {FaultPoint::kStatisticsUpdated, FaultPoint::kBeforeUpdate,
                           FaultPoint::kComputed, FaultPoint::kExchange}) {
    out.push_back({"merged_compact_int8_" + phase_name(phase), true, false, phase,
                   shampoo::CompactState::kInt8});
  }
  return out;
}

class FailedStep : public ::testing::TestWithParam<Case> {};

// Steps 1..3 succeed; step 4 is attempted with a fault at the phase (must change nothing), then
// retried; every step equals an optimizer that never failed, bit for bit.
TEST_P(FailedStep, SingleProcessChangesNothingAndRecovers) {
  const auto& c = GetParam();
  const auto options = base_options(c.eigenvalue_corrected).compact_state(c.compact);
  const auto distributed = DistributedOptions().merge_param_groups(c.merge);
  auto params = make_params();
  auto twin_params = shampoo::testing::clone_params(params);
  DistributedShampoo opt(make_groups(params, options), options, distributed);
  DistributedShampoo twin(make_groups(twin_params, options), options, distributed);
  Fault fault;
  fault.phase = c.phase;
  opt.set_fault_injector_for_testing(fault.injector());
  for (int step = 1; step <= 6; ++step) {
    set_grads(params, step);
    set_grads(twin_params, step);
    if (step == 4) {
      fault.armed = true;
      expect_failed_step_changes_nothing(opt, params, "the step with a fault");
      EXPECT_GT(opt.stats().rollback_bytes_last_step, 0);
    }
    opt.step();
    twin.step();
    ASSERT_TRUE(bit_equal(params, twin_params)) << "step " << step;
    ASSERT_EQ(opt.group_step(0), step);
  }
}

// The same with two ranks (threads): the fault on rank 1 only; both ranks throw, neither changes
// anything, and later steps equal the single-process optimizer bit for bit.
TEST_P(FailedStep, TwoRanksBothUndoAndRecover) {
  const auto& c = GetParam();
  const auto options = base_options(c.eigenvalue_corrected).compact_state(c.compact);
  // The single-process trajectory.
  std::vector<std::vector<at::Tensor>> expected;
  {
    auto params = make_params();
    DistributedShampoo opt(make_groups(params, options), options,
                           DistributedOptions().merge_param_groups(c.merge));
    for (int step = 1; step <= 6; ++step) {
      set_grads(params, step);
      opt.step();
      expected.push_back(snapshot(params));
    }
  }
  run_ranks(2, [&](int rank, const Group& group) {
    auto params = make_params();
    DistributedShampoo opt(make_groups(params, options), options,
                           DistributedOptions().process_group(group).merge_param_groups(c.merge));
    Fault fault;
    fault.phase = c.phase;
    opt.set_fault_injector_for_testing(fault.injector());
    for (int step = 1; step <= 6; ++step) {
      set_grads(params, step);
      if (step == 4) {
        const auto before = observe(opt, params);
        fault.armed = rank == 1;
        try {
          opt.step();
          ADD_FAILURE() << "rank " << rank << ": the step should have failed";
        } catch (const c10::Error& e) {
          const std::string message = e.what_without_backtrace();
          if (rank == 0) {
            EXPECT_NE(message.find("failed on rank(s) 1"), std::string::npos) << message;
          } else {
            EXPECT_NE(message.find("injected fault"), std::string::npos) << message;
          }
        }
        EXPECT_TRUE(unchanged(before, observe(opt, params))) << "rank " << rank;
      }
      opt.step();
      ASSERT_TRUE(bit_equal(params, expected[step - 1])) << "rank " << rank << " step " << step;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Phases, FailedStep, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

ShampooOptions failing_root_options() {
  return ShampooOptions::reference_defaults(0.05)
      .betas({0.9, 0.999})
      .epsilon(1e-6)
      .momentum(0.3)
      .precondition_frequency(2)
      .start_preconditioning_step(2)
      .num_tolerated_failed_amortized_computations(1);
}

// A root failure past the tolerance (the natural failure of the amortized computation): the
// step raises, changes nothing, and once the decomposition works again the steps go on.
TEST(FailedStepNatural, RootFailurePastTheToleranceChangesNothing) {
  auto params = make_params();
  DistributedShampoo opt(make_groups(params, failing_root_options()), failing_root_options());
  std::atomic<bool> fail{false};
  opt.set_failure_injector_for_testing([&](const std::string& block, int64_t) {
    return fail.load() && block == "parameter 0 block 0";
  });
  for (int step = 1; step <= 3; ++step) {  // roots at step 2
    set_grads(params, step);
    opt.step();
    EXPECT_EQ(opt.stats().rollback_bytes_last_step, 0) << "nothing to protect at step " << step;
  }
  fail = true;
  set_grads(params, 4);
  opt.step();  // first failure at step 4: tolerated (keeps the previous root)
  EXPECT_EQ(opt.stats().failed_amortized_computations, 1);
  set_grads(params, 5);
  opt.step();
  set_grads(params, 6);  // step 6 would be the second failure in a row: raises
  const auto before = observe(opt, params);
  try {
    opt.step();
    FAIL() << "expected the failure policy to raise";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("2 times in a row"), std::string::npos)
        << e.what_without_backtrace();
  }
  EXPECT_TRUE(unchanged(before, observe(opt, params)));
  EXPECT_GT(opt.stats().rollback_bytes_last_step, 0);
  fail = false;
  opt.step();
  EXPECT_EQ(opt.group_step(0), 6);
  EXPECT_EQ(opt.stats().failed_amortized_computations, 1);
}

at::Tensor one_entry(const std::vector<int64_t>& shape, int64_t index, double value) {
  auto t = at::randn(shape);
  t.view({-1})[index].fill_(value);
  return t;
}

// A gradient of the wrong shape, a non-finite gradient and an overflowing factor update: errors
// before or after state changed; nothing changes, the next step works.
TEST(FailedStepNatural, BadGradientsChangeNothing) {
  auto params = make_params();
  const auto options = base_options(false);
  DistributedShampoo opt(make_groups(params, options), options);
  set_grads(params, 1);
  opt.step();
  const auto good = params[2].grad().clone();
  const auto bad_grads = std::vector<at::Tensor>{
      at::zeros({3, 8}),                  // wrong shape
      at::full({3, 4, 2}, NAN),           // non-finite
      at::full({3, 4, 2}, 1e30),          // finite, but G·Gᵀ overflows float32 (factor check)
      at::full({3, 4, 2}, -1e30),         // the same from below (max |G| bounds the update)
      at::zeros({3, 4, 2}, at::kDouble),  // wrong dtype
      one_entry({3, 4, 2}, 5, NAN),       // one NaN among finite entries
      one_entry({3, 4, 2}, 17, -INFINITY)};
  for (size_t i = 0; i < bad_grads.size(); ++i) {
    set_grads(params, 2);
    params[2].mutable_grad() = bad_grads[i];
    expect_failed_step_changes_nothing(opt, params, "bad gradient " + std::to_string(i));
  }
  set_grads(params, 2);
  opt.step();
  EXPECT_EQ(opt.group_step(1), 2);
}

struct HugeGradientCase {
  std::string name;
  ShampooOptions options;
};

std::vector<HugeGradientCase> huge_gradient_cases() {
  using shampoo::AdamPreconditionerConfig;
  const auto plain = [](auto preconditioner) {
    return ShampooOptions(0.01).grafting(std::monostate{}).preconditioner(preconditioner);
  };
  return {
      // The library's defaults: float64 factors, Adam grafting in float32, roots at step 50.
      {"defaults", ShampooOptions(0.01)},
      {"float32_factors_roots_every_step",
       ShampooOptions(0.01).factor_matrix_dtype(at::kFloat).precondition_frequency(1)},
      {"eigenvalue_corrected",
       ShampooOptions(0.01).preconditioner(shampoo::EigenvalueCorrectedShampooConfig{})},
      {"eigendecomposed",
       ShampooOptions(0.01).preconditioner(shampoo::EigendecomposedShampooConfig{})},
      {"kl_shampoo", ShampooOptions(0.01).preconditioner(shampoo::RootInvKLShampooConfig{})},
      {"adagrad", plain(shampoo::AdaGradPreconditionerConfig{})},
      {"rmsprop", plain(shampoo::RMSpropPreconditionerConfig{})},
      {"adam", plain(AdamPreconditionerConfig{})},
      {"sign_descent_adagrad_grafting", ShampooOptions(0.01)
                                            .grafting(shampoo::AdaGradGraftingConfig{1e-10})
                                            .preconditioner(shampoo::SignDescentConfig{})},
      {"reference_defaults", ShampooOptions::reference_defaults(0.01)},
  };
}

// Issue 58: a finite gradient whose squares overflow a state (every entry 1e25 on a 16x16 weight)
// left the Adam-grafting second moment at inf under the defaults, and the parameter never moved
// again, with no error. Now it is an error before anything changes, in every family that keeps
// squares, and the next step equals that of a twin that never saw it.
TEST(FailedStepNatural, GradientOverflowingTheStateIsAnErrorThatChangesNothing) {
  for (const auto& c : huge_gradient_cases()) {
    SCOPED_TRACE(c.name);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
    const auto w0 = at::randn({16, 16}, gen);
    const auto b0 = at::randn({16}, gen);
    std::vector<at::Tensor> params{w0.clone().requires_grad_(), b0.clone().requires_grad_()};
    std::vector<at::Tensor> twin{w0.clone().requires_grad_(), b0.clone().requires_grad_()};
    DistributedShampoo opt(params, c.options);
    DistributedShampoo twin_opt(twin, c.options);
    for (int step = 1; step <= 3; ++step) {
      set_grads(params, step);
      set_grads(twin, step);
      if (step == 2) {
        params[0].mutable_grad() = at::full({16, 16}, 1e25);
        const auto before = observe(opt, params);
        try {
          opt.step();
          ADD_FAILURE() << "a gradient of 1e25 entries was accepted";
        } catch (const c10::Error& e) {
          const std::string message = e.what_without_backtrace();
          EXPECT_NE(message.find("would overflow the optimizer state"), std::string::npos)
              << message;
          EXPECT_NE(message.find("the step was not applied"), std::string::npos) << message;
        }
        EXPECT_TRUE(unchanged(before, observe(opt, params)));
        set_grads(params, step);
      }
      opt.step();
      twin_opt.step();
      EXPECT_TRUE(bit_equal(params, twin)) << "after step " << step;
    }
    for (const auto& p : params) EXPECT_TRUE(at::isfinite(p).all().item<bool>());
  }
}

// The check bounds the squares, not the gradient: a family without squares (SGD, sign descent)
// takes the same gradient, and float64 statistics take gradients whose squares fit float64.
TEST(FailedStepNatural, GradientsWhoseSquaresFitTheStateAreTaken) {
  for (const auto& options : {ShampooOptions(0.01)
                                  .grafting(std::monostate{})
                                  .preconditioner(shampoo::SGDPreconditionerConfig{}),
                              ShampooOptions(0.01)
                                  .grafting(std::monostate{})
                                  .preconditioner(shampoo::SignDescentConfig{})}) {
    auto w = at::zeros({16, 16}).requires_grad_();
    DistributedShampoo opt(std::vector<at::Tensor>{w}, options);
    w.mutable_grad() = at::full({16, 16}, 1e25);
    opt.step();
    EXPECT_TRUE(at::isfinite(w).all().item<bool>());
  }
  auto w = at::zeros({16, 16}, at::kDouble).requires_grad_();
  DistributedShampoo opt(std::vector<at::Tensor>{w}, ShampooOptions(0.01));
  w.mutable_grad() = at::full({16, 16}, 1e25, at::kDouble);
  opt.step();
  EXPECT_TRUE(at::isfinite(w).all().item<bool>());
  EXPECT_NE(w.abs().max().item<double>(), 0.0);
}

/// World 2: after a first step, the second with `spoil(rank, params)` applied to the gradients
/// fails on both ranks and changes nothing there; `after_failure(opt, rank)` checks more; the
/// second step then works with good gradients.
template <typename Spoil, typename AfterFailure>
void expect_spoiled_second_step_fails_on_both_ranks(Spoil spoil, AfterFailure after_failure) {
  const auto options = base_options(false);
  run_ranks(2, [&](int rank, const Group& group) {
    auto params = make_params();
    DistributedShampoo opt(make_groups(params, options), options,
                           DistributedOptions().process_group(group));
    set_grads(params, 1);
    opt.step();
    set_grads(params, 2);
    spoil(rank, params);
    expect_failed_step_changes_nothing(opt, params, "rank " + std::to_string(rank));
    after_failure(opt, rank);
    set_grads(params, 2);
    opt.step();
    EXPECT_EQ(opt.group_step(0), 2);
    EXPECT_EQ(opt.group_step(1), 2);
  });
}

// A bad gradient on one rank only (the ranks' gradients disagree): both ranks raise instead of
// one waiting forever in the AllGather, and both keep their state.
TEST(FailedStepNatural, BadGradientOnOneRankFailsBothRanks) {
  expect_spoiled_second_step_fails_on_both_ranks(
      [](int rank, std::vector<at::Tensor>& params) {
        if (rank == 0) params[1].mutable_grad() = at::full({7}, INFINITY);
      },
      [](const DistributedShampoo& /*opt*/, int /*rank*/) {});
}

/// An MLP whose DistributedShampoo steps in backward, with a fault injector the test arms (the
/// block work of the fourth parameter fails: three are applied already), beside a twin stepped
/// by ordinary steps on the same data.
struct InBackwardTwins {
  InBackwardTwins(const DistributedOptions& distributed, bool fault_journals)
      : model(shampoo::testing::make_mlp(6, 10, 3, 4)),
        twin(shampoo::testing::make_mlp(6, 10, 3, 4)),
        ordinary(twin->parameters(), options) {
    fault.phase = FaultPoint::kComputed;
    fault.skip = 3;
    in_backward = shampoo::apply_optimizer_in_backward(
        model->parameters(), [this, distributed, fault_journals](std::vector<torch::Tensor> p) {
          auto opt = std::make_unique<DistributedShampoo>(p, options, distributed);
          opt->set_fault_injector_for_testing(fault.injector(), fault_journals);
          stepping = opt.get();
          return opt;
        });
  }
  static shampoo::testing::Dataset data(int step) {
    return shampoo::testing::make_blobs(16, 6, 3, 90 + step);
  }
  /// A backward pass of the model; the gradients of a failed one are dropped.
  void backward(int step) {
    shampoo::testing::classification_loss(model, data(step), /*backward=*/true);
  }
  void drop_gradients() {
    for (auto& p : model->parameters()) p.mutable_grad().reset();
  }
  /// The model's backward (its steps) and the twin's ordinary step; equal parameters after.
  ::testing::AssertionResult step_both(int step) {
    backward(step);
    ordinary.zero_grad();
    shampoo::testing::classification_loss(twin, data(step), /*backward=*/true);
    ordinary.step();
    return bit_equal(snapshot(model->parameters()), snapshot(twin->parameters()));
  }

  ShampooOptions options = base_options(false);
  torch::nn::Sequential model;
  torch::nn::Sequential twin;
  DistributedShampoo ordinary;
  Fault fault;
  DistributedShampoo* stepping = nullptr;  // the in-backward set's optimizer
  shampoo::InBackwardOptimizer in_backward;
};

// Optimizer-in-backward: an error inside backward (a fault during the block work of a later
// parameter) undoes the open step; the next backward works and equals ordinary steps.
TEST(FailedStepNatural, InBackwardErrorUndoesTheStep) {
  InBackwardTwins t(DistributedOptions(), /*fault_journals=*/true);
  for (int step = 1; step <= 5; ++step) {
    if (step == 3) {
      const auto before = observe(*t.stepping, t.model->parameters());
      t.fault.armed = true;
      EXPECT_THROW(t.backward(step), c10::Error);
      EXPECT_TRUE(unchanged(before, observe(*t.stepping, t.model->parameters())));
      t.drop_gradients();
    }
    ASSERT_TRUE(t.step_both(step)) << "step " << step;
  }
  EXPECT_EQ(t.in_backward.steps_taken(), 5);
}

// torch::optim's rule: a parameter without a gradient is not stepped, and a group none of whose
// parameters had a gradient keeps its step count.
TEST(GroupStep, AdvancesOnlyForGroupsWithAGradient) {
  auto params = make_params();
  const auto options = base_options(false);
  DistributedShampoo opt(make_groups(params, options), options);
  for (int step = 1; step <= 3; ++step) {
    set_grads(params, step);
    opt.step();
  }
  const auto untouched = snapshot({params[1], params[2], params[3]});
  opt.zero_grad();
  params[0].mutable_grad() = at::ones_like(params[0]);  // only group 0 has a gradient
  opt.step();
  EXPECT_EQ(opt.group_step(0), 4);
  EXPECT_EQ(opt.group_step(1), 3);
  EXPECT_EQ(opt.group_step(2), 3);
  EXPECT_TRUE(bit_equal(snapshot({params[1], params[2], params[3]}), untouched));
  opt.zero_grad();
  opt.step();  // no gradient at all: nothing advances
  EXPECT_EQ(opt.group_step(0), 4);
  EXPECT_EQ(opt.group_step(1), 3);
}

// Distributed: the step counts stay equal on every rank also when the ranks disagree about which
// parameters have gradients (the owner's view decides, and every rank sees the owners' flags).
TEST(GroupStep, RanksAgreeWhenGradientsDiffer) {
  const auto options = base_options(false);
  run_ranks(2, [&](int rank, const Group& group) {
    auto params = make_params();
    DistributedShampoo opt(make_groups(params, options), options,
                           DistributedOptions().process_group(group));
    set_grads(params, 1);
    opt.step();
    opt.zero_grad();
    if (rank == 0) params[0].mutable_grad() = at::ones_like(params[0]);
    if (rank == 1) params[3].mutable_grad() = at::ones_like(params[3]);
    opt.step();
    std::vector<int64_t> steps;
    for (size_t g = 0; g < 3; ++g) steps.push_back(opt.group_step(g));
    auto mine = at::tensor(steps, at::kLong);
    auto all = at::empty({2 * 3}, at::kLong);
    group->getBackend(c10::DeviceType::CPU)->_allgather_base(all, mine)->wait();
    EXPECT_TRUE(at::equal(all.narrow(0, 0, 3), all.narrow(0, 3, 3))) << "rank " << rank;
    EXPECT_EQ(opt.group_step(1), 1) << "rank " << rank;  // no rank had a gradient for group 1
  });
}

/// `call` throws the error that refuses steps until a checkpoint is loaded.
template <typename Call>
void expect_refused_until_a_load(Call call, const std::string& what) {
  try {
    call();
    ADD_FAILURE() << what << " should be refused";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("load a checkpoint"), std::string::npos) << what << ": " << message;
  }
}

void copy_into(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& values) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(values[i]);
}

// DistributedOptions::agree_before_update (the default): the ranks agree before any state
// changes, so an ordinary distributed step keeps no copy of the state, and the results are those
// of the journaling protocol (and of one process) bit for bit.
TEST(AgreeBeforeUpdate, NoJournalAtWorldTwoAndTheSameResults) {
  const auto options = base_options(false);
  std::vector<std::vector<at::Tensor>> expected;
  {
    auto params = make_params();
    DistributedShampoo opt(make_groups(params, options), options);
    for (int step = 1; step <= 5; ++step) {
      set_grads(params, step);
      opt.step();
      expected.push_back(snapshot(params));
    }
  }
  for (const bool agree : {true, false}) {
    run_ranks(2, [&](int rank, const Group& group) {
      auto params = make_params();
      DistributedShampoo opt(make_groups(params, options), options,
                             DistributedOptions().process_group(group).agree_before_update(agree));
      for (int step = 1; step <= 5; ++step) {
        set_grads(params, step);
        opt.step();
        ASSERT_TRUE(bit_equal(params, expected[step - 1]))
            << "agree " << agree << " rank " << rank << " step " << step;
        ASSERT_EQ(opt.stats().collectives_last_step, 1);  // AllGathers; the agreement apart
        if (agree) {
          EXPECT_EQ(opt.stats().rollback_bytes_last_step, 0) << "rank " << rank;
        } else {
          EXPECT_GT(opt.stats().rollback_bytes_last_step, 0) << "rank " << rank;
        }
      }
    });
  }
}

// A step that one rank foresees may raise after changing state (the owner of a block at the limit
// of its tolerated root failures): that rank asks for the journal in the agreement, every rank
// keeps it, and when the owner then fails, both ranks undo the step. (This used a gradient of
// 1e30 entries, whose factor update would overflow; such a gradient is now refused before the
// agreement: GradientOverflowingTheStateIsAnErrorThatChangesNothing.)
TEST(AgreeBeforeUpdate, AStepThatMayRaiseJournalsOnEveryRank) {
  run_ranks(2, [&](int rank, const Group& group) {
    auto params = make_params();
    DistributedShampoo opt(make_groups(params, failing_root_options()), failing_root_options(),
                           DistributedOptions().process_group(group));
    std::atomic<bool> fail{false};
    opt.set_failure_injector_for_testing([&](const std::string& block, int64_t) {
      return fail.load() && block == "parameter 0 block 0";
    });
    for (int step = 1; step <= 5; ++step) {  // roots at steps 2 and 4; 4 fails, tolerated
      fail = step == 4;
      set_grads(params, step);
      opt.step();
      EXPECT_EQ(opt.stats().rollback_bytes_last_step, 0) << "rank " << rank << " step " << step;
    }
    fail = true;
    set_grads(params, 6);
    expect_failed_step_changes_nothing(opt, params, "rank " + std::to_string(rank));
    EXPECT_GT(opt.stats().rollback_bytes_last_step, 0) << "rank " << rank;
    fail = false;
    opt.step();
    EXPECT_EQ(opt.group_step(0), 6);
  });
}

// A failure no check foresaw, after a step changed state without a copy: the step raises, and
// the optimizer refuses further steps (its state no longer matches the parameters) until a
// checkpoint is loaded; then it goes on as if the failed step had not been tried.
TEST(AgreeBeforeUpdate, AnUnforeseenFailureRefusesStepsUntilALoad) {
  const auto options = base_options(false);
  auto params = make_params();
  auto twin_params = make_params();
  DistributedShampoo opt(make_groups(params, options), options);
  DistributedShampoo twin(make_groups(twin_params, options), options);
  Fault fault;
  fault.phase = FaultPoint::kComputed;
  opt.set_fault_injector_for_testing(fault.injector(), /*journal=*/false);
  for (int step = 1; step <= 5; ++step) {
    set_grads(params, step);
    set_grads(twin_params, step);
    if (step == 3) {
      std::ostringstream saved;
      torch::save(opt, saved);
      const auto params_before = snapshot(params);
      fault.armed = true;
      EXPECT_THROW(opt.step(), c10::Error);
      expect_refused_until_a_load([&] { opt.step(); }, "a step after the unforeseen failure");
      std::istringstream in(saved.str());
      torch::load(opt, in);
      copy_into(params, params_before);
    }
    opt.step();
    twin.step();
    ASSERT_TRUE(bit_equal(params, twin_params)) << "step " << step;
  }
}

// The same at world 2: the fault on rank 1 after the agreement; both ranks raise, and both refuse
// the next step.
TEST(AgreeBeforeUpdate, AnUnforeseenFailureOnOneRankRefusesStepsOnBoth) {
  const auto options = base_options(false);
  run_ranks(2, [&](int rank, const Group& group) {
    auto params = make_params();
    DistributedShampoo opt(make_groups(params, options), options,
                           DistributedOptions().process_group(group));
    Fault fault;
    fault.phase = FaultPoint::kExchange;
    opt.set_fault_injector_for_testing(fault.injector(), /*journal=*/false);
    set_grads(params, 1);
    opt.step();
    EXPECT_EQ(opt.stats().rollback_bytes_last_step, 0);
    fault.armed = rank == 1;
    set_grads(params, 2);
    EXPECT_THROW(opt.step(), c10::Error) << "rank " << rank;
    expect_refused_until_a_load([&] { opt.step(); },
                                "rank " + std::to_string(rank) + ": the next step");
  });
}

// DistributedOptions::undo_in_backward(false): a step in backward keeps no copy of the state (it
// equals ordinary steps bit for bit); an error in a later parameter's block work then cannot be
// undone, so the next step is refused until a checkpoint is loaded.
TEST(UndoInBackward, OffKeepsNoCopyAndRefusesStepsAfterAFailure) {
  InBackwardTwins t(DistributedOptions().undo_in_backward(false), /*fault_journals=*/false);
  for (int step = 1; step <= 5; ++step) {
    if (step == 3) {
      std::ostringstream saved;
      torch::save(*t.stepping, saved);
      const auto params_before = snapshot(t.model->parameters());
      t.fault.armed = true;
      EXPECT_THROW(t.backward(step), c10::Error);
      t.drop_gradients();
      expect_refused_until_a_load([&] { t.backward(step); }, "the backward after the failure");
      t.drop_gradients();
      std::istringstream in(saved.str());
      torch::load(*t.stepping, in);
      copy_into(t.model->parameters(), params_before);
    }
    ASSERT_TRUE(t.step_both(step)) << "step " << step;
    EXPECT_EQ(t.stepping->stats().rollback_bytes_last_step, 0) << "step " << step;
  }
}

}  // namespace
