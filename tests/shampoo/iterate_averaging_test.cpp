// Iterate averaging (Generalized Primal Averaging and Schedule-Free; docs/math.md, "Iterate
// averaging") through DistributedShampoo:
// - GPA ≡ torch::optim::SGD with heavy-ball and Nesterov momentum (float32 tolerance);
// - Schedule-Free against an independent float64 reference of whole steps with a changing lr and
//   decoupled weight decay, eval() and train() against the reference's x and y (and, without
//   weight decay, against the averaging recursion of the paper's x, z, y form);
// - merged ≡ unmerged, world 2 ≡ one process (eval()/train() included), resumed ≡ uninterrupted
//   (torch::save/load in train and in eval mode, the checkpoint directory), in backward ≡ ordinary
//   step, a failed step ≡ no step, bit for bit; Z starts from weights loaded after construction;
// - options: validation messages, merging, archives (also without the new entries), step() in
//   eval mode; CUDA ≡ CPU (skipped without a GPU).
#include <shampoo/option_fields.h>
#include <shampoo/shampoo.h>
#include <torch/cuda.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <cmath>
#include <filesystem>
#include <sstream>

#include "support/test_support.h"

namespace {

using shampoo::DistributedOptions;
using shampoo::DistributedShampoo;
using shampoo::GeneralizedPrimalAveragingConfig;
using shampoo::ScheduleFreeConfig;
using shampoo::ShampooOptions;
using shampoo::testing::all_close;
using shampoo::testing::bit_equal;
using shampoo::testing::clone_params;
using shampoo::testing::expect_error;
using shampoo::testing::snapshot;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

constexpr int64_t kMaxDim = 6;

/// A blocked matrix (6×10 → 6×6 and 6×4), a vector in two blocks, a 3-D weight merged to 4×6.
std::vector<at::Tensor> make_params(uint64_t seed, at::ScalarType dtype = at::kFloat) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<at::Tensor> params;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{6, 10}, {7}, {4, 3, 2}}) {
    params.push_back(at::randn(shape, gen).to(dtype).requires_grad_());
  }
  return params;
}

void set_grads(const std::vector<at::Tensor>& params, int step) {
  shampoo::testing::set_random_grads(params, 900 + step);
}

/// Shampoo with roots every step, β1 filtering, Adam grafting and decoupled weight decay: every
/// part of the step runs before averaging.
ShampooOptions shampoo_options(shampoo::IterateAveragingConfig averaging) {
  return ShampooOptions::reference_defaults(0.05)
      .betas({0.9, 0.99})
      .epsilon(1e-3)
      .weight_decay(0.1)
      .max_preconditioner_dim(kMaxDim)
      .grafting(shampoo::AdamGraftingConfig{0.99, 1e-6})
      .iterate_averaging(averaging);
}

std::vector<shampoo::IterateAveragingConfig> averaging_configs() {
  return {GeneralizedPrimalAveragingConfig{0.7, 0.6}, ScheduleFreeConfig{0.75, 2.0}};
}

/// Two groups of different lr (merged into one virtual group unless told otherwise).
std::vector<torch::optim::OptimizerParamGroup> two_groups(const std::vector<at::Tensor>& params,
                                                          const ShampooOptions& base) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{params[0]}, std::make_unique<ShampooOptions>(base));
  groups.emplace_back(std::vector<at::Tensor>{params[1], params[2]},
                      std::make_unique<ShampooOptions>(ShampooOptions(base).lr(base.lr() * 0.5)));
  return groups;
}

/// lr of step t: changes every step (Schedule-Free's μx depends on the history).
double lr_at(int t) { return 0.05 * (1.0 + 0.3 * std::sin(static_cast<double>(t))); }

void set_lr(DistributedShampoo& opt, int t) {
  for (size_t g = 0; g < opt.param_groups().size(); ++g) {
    opt.group_options(g).lr(lr_at(t) * (g == 0 ? 1.0 : 0.5));
  }
}

// ----------------------------------------------------------------------------------------------
// GPA ≡ SGD with momentum.
// ----------------------------------------------------------------------------------------------

struct SgdCase {
  std::string name;
  bool nesterov;
  bool main_preconditioner;  // SGDPreconditionerConfig, else SGD grafting never preconditioning
};

class GpaEqualsSgd : public ::testing::TestWithParam<SgdCase> {};

TEST_P(GpaEqualsSgd, EveryStep) {
  const auto& c = GetParam();
  constexpr double kMomentum = 0.8;
  constexpr double kLr = 0.03;
  auto sgd_params = make_params(1);
  auto gpa_params = clone_params(sgd_params);
  torch::optim::SGD sgd(sgd_params,
                        torch::optim::SGDOptions(kLr).momentum(kMomentum).nesterov(c.nesterov));
  // SGD(lr, μ) is GPA with μx = μ, μy = 1 (heavy ball) or μ (Nesterov), at lr / (1 − μ).
  auto options = ShampooOptions::reference_defaults(kLr / (1.0 - kMomentum))
                     .betas({0.0, 1.0})
                     .max_preconditioner_dim(kMaxDim)
                     .iterate_averaging(
                         GeneralizedPrimalAveragingConfig{kMomentum, c.nesterov ? kMomentum : 1.0});
  if (c.main_preconditioner) {
    options.preconditioner(shampoo::SGDPreconditionerConfig{});
  } else {
    options.grafting(shampoo::SGDGraftingConfig{})
        .start_preconditioning_step(shampoo::kNeverStartPreconditioning);
  }
  DistributedShampoo gpa(gpa_params, options);
  const auto start = snapshot(gpa_params);
  for (int t = 1; t <= 8; ++t) {
    set_grads(sgd_params, t);
    set_grads(gpa_params, t);
    sgd.step();
    gpa.step();
    for (size_t i = 0; i < gpa_params.size(); ++i) {
      ASSERT_TRUE(all_close(gpa_params[i].detach(), sgd_params[i].detach()))
          << c.name << " step " << t << " parameter " << i;
    }
  }
  EXPECT_FALSE(at::allclose(gpa_params[0].detach(), start[0], 0.0, 1e-3));
}

INSTANTIATE_TEST_SUITE_P(Momentum, GpaEqualsSgd,
                         ::testing::Values(SgdCase{"heavy_ball_grafting", false, false},
                                           SgdCase{"nesterov_grafting", true, false},
                                           SgdCase{"heavy_ball_sgd_preconditioner", false, true},
                                           SgdCase{"nesterov_sgd_preconditioner", true, true}),
                         [](const auto& info) { return info.param.name; });

// ----------------------------------------------------------------------------------------------
// Schedule-Free against a float64 reference.
// ----------------------------------------------------------------------------------------------

/// The reference of one parameter (one block: no dim exceeds kMaxDim): AdaGrad direction
/// P = G / (sqrt(V) + ε), then docs/math.md's averaging. `x` follows the paper's recursion
/// x ← μx·x + (1 − μx)·z (which the implementation's y and Z reproduce without weight decay).
struct Reference {
  at::Tensor y, z, v, x;
};

struct SfSettings {
  double mu_y = 0.75;
  double power = 2.0;
  double wd = 0.0;
  double eps = 1e-4;
};

void reference_step(Reference& r, const at::Tensor& g, double lr, double lr_sum,
                    const SfSettings& s) {
  r.v = r.v + g * g;
  const auto p = g / (r.v.sqrt() + s.eps);
  const double mu_x = 1.0 - std::pow(lr, s.power) / lr_sum;
  const auto u = -lr * p;
  const auto z_decayed = (1.0 - lr * s.wd) * r.z;
  r.y = r.y + (1.0 - mu_x * s.mu_y) * u + (1.0 - mu_x) * (z_decayed - r.y);
  r.z = z_decayed + u;
  r.x = mu_x * r.x + (1.0 - mu_x) * r.z;
}

class ScheduleFreeReference : public ::testing::TestWithParam<double> {};

TEST_P(ScheduleFreeReference, StepsEvalAndTrain) {
  SfSettings s;
  s.wd = GetParam();
  std::vector<at::Tensor> params;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  for (const auto& shape : std::vector<std::vector<int64_t>>{{5, 4}, {6}}) {
    params.push_back(at::randn(shape, gen).to(at::kDouble).requires_grad_());
  }
  std::vector<Reference> refs;
  for (const auto& p : params) {
    const auto w = p.detach().clone();
    refs.push_back({w.clone(), w.clone(), at::zeros_like(w), w.clone()});
  }
  DistributedShampoo opt(params, ShampooOptions::reference_defaults(lr_at(1))
                                     .betas({0.0, 1.0})
                                     .weight_decay(s.wd)
                                     .max_preconditioner_dim(kMaxDim)
                                     .preconditioner(shampoo::AdaGradPreconditionerConfig{s.eps})
                                     .iterate_averaging(ScheduleFreeConfig{s.mu_y, s.power}));
  double lr_sum = 0.0;
  for (int t = 1; t <= 6; ++t) {
    opt.group_options(0).lr(lr_at(t));
    lr_sum += std::pow(lr_at(t), s.power);
    set_grads(params, t);
    for (size_t i = 0; i < params.size(); ++i) {
      reference_step(refs[i], params[i].grad(), lr_at(t), lr_sum, s);
    }
    opt.step();
    for (size_t i = 0; i < params.size(); ++i) {
      ASSERT_TRUE(all_close(params[i].detach(), refs[i].y)) << "step " << t << " param " << i;
    }
    if (t % 3 != 0) continue;
    opt.eval();
    ASSERT_FALSE(opt.is_training());
    for (size_t i = 0; i < params.size(); ++i) {
      // x from y and Z (docs/math.md); without weight decay also the paper's average.
      const auto x = (refs[i].y - (1.0 - s.mu_y) * refs[i].z) / s.mu_y;
      ASSERT_TRUE(all_close(params[i].detach(), x)) << "eval after step " << t;
      if (s.wd == 0.0) {
        ASSERT_TRUE(all_close(params[i].detach(), refs[i].x)) << "paper's x";
      }
    }
    opt.train();
    for (size_t i = 0; i < params.size(); ++i) {
      ASSERT_TRUE(all_close(params[i].detach(), refs[i].y)) << "train after step " << t;
    }
  }
  EXPECT_FALSE(at::allclose(params[0].detach(), refs[0].z, 0.0, 1e-6));
}

INSTANTIATE_TEST_SUITE_P(WeightDecay, ScheduleFreeReference, ::testing::Values(0.0, 0.3),
                         [](const auto& info) { return info.param == 0.0 ? "none" : "decoupled"; });

// ----------------------------------------------------------------------------------------------
// Bit-for-bit equivalences.
// ----------------------------------------------------------------------------------------------

class AveragingEquivalence : public ::testing::TestWithParam<shampoo::IterateAveragingConfig> {};

std::string averaging_name(const shampoo::IterateAveragingConfig& c) {
  return std::holds_alternative<ScheduleFreeConfig>(c) ? "schedule_free" : "gpa";
}

/// Steps 1..n with a changing lr, eval() and train() after step 2; the parameters after every
/// step and in eval mode.
std::vector<std::vector<at::Tensor>> run(DistributedShampoo& opt, std::vector<at::Tensor>& params,
                                         int first, int last) {
  std::vector<std::vector<at::Tensor>> out;
  for (int t = first; t <= last; ++t) {
    set_lr(opt, t);
    set_grads(params, t);
    opt.step();
    out.push_back(snapshot(params));
    if (t == 2) {
      opt.eval();
      out.push_back(snapshot(params));
      opt.train();
    }
  }
  return out;
}

TEST_P(AveragingEquivalence, MergedEqualsUnmerged) {
  const auto options = shampoo_options(GetParam());
  auto merged_params = make_params(4);
  auto unmerged_params = make_params(4);
  DistributedShampoo merged(two_groups(merged_params, options), options);
  DistributedShampoo unmerged(two_groups(unmerged_params, options), options,
                              DistributedOptions().merge_param_groups(false));
  ASSERT_EQ(merged.stats().virtual_groups, 1);
  ASSERT_EQ(unmerged.stats().virtual_groups, 2);
  const auto a = run(merged, merged_params, 1, 5);
  const auto b = run(unmerged, unmerged_params, 1, 5);
  for (size_t i = 0; i < a.size(); ++i) ASSERT_TRUE(bit_equal(a[i], b[i])) << "snapshot " << i;
  EXPECT_FALSE(at::equal(a[2][0], a[1][0]));  // eval() moved the parameters
}

TEST_P(AveragingEquivalence, WorldTwoEqualsOneProcess) {
  const auto options = shampoo_options(GetParam());
  auto single_params = make_params(5);
  DistributedShampoo single(two_groups(single_params, options), options);
  const auto expected = run(single, single_params, 1, 4);
  for (const bool communicate_params : {false, true}) {
    shampoo::testing::run_ranks(2, [&](int rank, const Group& group) {
      auto params = make_params(5);
      DistributedShampoo opt(
          two_groups(params, options), options,
          DistributedOptions().process_group(group).communicate_params(communicate_params));
      ASSERT_LT(opt.stats().owned_blocks, opt.stats().total_blocks);
      const auto got = run(opt, params, 1, 4);
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_TRUE(bit_equal(got[i], expected[i]))
            << "rank " << rank << " snapshot " << i << " communicate_params " << communicate_params;
      }
    });
  }
}

/// Saves `before` after steps 1..3 (in eval mode when `in_eval`), loads into a fresh optimizer
/// and compares steps 4..7 with the uninterrupted run.
void expect_resume(const shampoo::IterateAveragingConfig& averaging, bool in_eval, bool directory) {
  const auto options = shampoo_options(averaging);
  auto straight_params = make_params(6);
  DistributedShampoo straight(two_groups(straight_params, options), options);
  auto first = make_params(6);
  DistributedShampoo before(two_groups(first, options), options);
  run(straight, straight_params, 1, 3);
  run(before, first, 1, 3);
  if (in_eval) {
    straight.eval();
    straight.train();
    before.eval();
  }
  auto resumed = clone_params(first);  // in eval mode: the model saved at x
  DistributedShampoo after(two_groups(resumed, options), options);
  const auto path = shampoo::testing::temp_path(directory ? "averaging_dir" : "averaging.pt");
  if (directory) {
    shampoo::save_distributed_checkpoint(before, path);
    shampoo::load_distributed_checkpoint(after, path);
    shampoo::testing::remove_tree(path);
  } else {
    torch::save(before, path);
    torch::load(after, path);
    std::filesystem::remove(path);
  }
  ASSERT_EQ(after.is_training(), !in_eval);
  after.train();
  const auto a = run(straight, straight_params, 4, 7);
  const auto b = run(after, resumed, 4, 7);
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(bit_equal(b[i], a[i])) << "snapshot " << i << (in_eval ? " saved in eval" : "")
                                       << (directory ? " directory" : " torch::save");
  }
}

TEST_P(AveragingEquivalence, ResumedEqualsUninterrupted) {
  for (const bool in_eval : {false, true}) {
    for (const bool directory : {false, true}) expect_resume(GetParam(), in_eval, directory);
  }
}

/// Everything a step may change, as in failed_step_test: parameters, steps, the checkpoint.
std::string checkpoint_of(const DistributedShampoo& opt) {
  std::ostringstream stream;
  torch::save(opt, stream);
  return stream.str();
}

TEST_P(AveragingEquivalence, FailedStepChangesNothing) {
  // Failing at step 1 (Z does not exist yet) and at step 3 (it does), at both fault points.
  const auto options = shampoo_options(GetParam());
  for (const auto phase : {shampoo::FaultPoint::kBeforeUpdate, shampoo::FaultPoint::kComputed}) {
    auto straight_params = make_params(7);
    DistributedShampoo straight(two_groups(straight_params, options), options);
    auto params = make_params(7);
    DistributedShampoo opt(two_groups(params, options), options);
    bool armed = false;
    opt.set_fault_injector_for_testing([&](shampoo::FaultPoint p) {
      if (armed && p == phase) TORCH_CHECK(false, "injected fault");
    });
    for (int t = 1; t <= 5; ++t) {
      set_lr(straight, t);
      set_lr(opt, t);
      set_grads(straight_params, t);
      set_grads(params, t);
      straight.step();
      if (t == 1 || t == 3) {
        const auto before = checkpoint_of(opt);
        const auto values = snapshot(params);
        armed = true;
        EXPECT_THROW(opt.step(), c10::Error);
        armed = false;
        ASSERT_TRUE(bit_equal(snapshot(params), values)) << "step " << t;
        ASSERT_EQ(checkpoint_of(opt), before) << "state changed by failed step " << t;
      }
      opt.step();
      ASSERT_TRUE(bit_equal(snapshot(params), snapshot(straight_params))) << "step " << t;
    }
  }
}

TEST_P(AveragingEquivalence, AverageStartsFromWeightsLoadedAfterConstruction) {
  const auto options = shampoo_options(GetParam());
  auto params = make_params(8);
  DistributedShampoo opt(two_groups(params, options), options);
  auto loaded = make_params(9);
  {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(loaded[i]);
  }
  DistributedShampoo fresh(two_groups(loaded, options), options);
  const auto a = run(opt, params, 1, 3);
  const auto b = run(fresh, loaded, 1, 3);
  for (size_t i = 0; i < a.size(); ++i) ASSERT_TRUE(bit_equal(a[i], b[i])) << "snapshot " << i;
}

INSTANTIATE_TEST_SUITE_P(Averaging, AveragingEquivalence, ::testing::ValuesIn(averaging_configs()),
                         [](const auto& info) { return averaging_name(info.param); });

TEST(IterateAveraging, InBackwardEqualsOrdinaryStep) {
  auto factory = [](std::vector<at::Tensor> params) {
    return std::make_unique<DistributedShampoo>(
        params, ShampooOptions::reference_defaults(0.05).iterate_averaging(ScheduleFreeConfig{}));
  };
  auto ordinary_model = shampoo::testing::make_mlp(6, 12, 3, 1);
  auto model = shampoo::testing::make_mlp(6, 12, 3, 1);
  auto ordinary = factory(ordinary_model->parameters());
  auto in_backward = shampoo::apply_optimizer_in_backward(model->parameters(), factory);
  auto& inner = dynamic_cast<DistributedShampoo&>(in_backward.optimizer(0));
  for (int step = 1; step <= 4; ++step) {
    const auto data = shampoo::testing::make_blobs(32, 6, 3, 60 + step);
    ordinary->zero_grad();
    shampoo::testing::classification_loss(ordinary_model, data, true);
    ordinary->step();
    shampoo::testing::classification_loss(model, data, true);
    ASSERT_TRUE(bit_equal(snapshot(model->parameters()), snapshot(ordinary_model->parameters())))
        << "step " << step;
    ordinary->eval();
    inner.eval();
    ASSERT_TRUE(bit_equal(snapshot(model->parameters()), snapshot(ordinary_model->parameters())))
        << "eval after step " << step;
    ordinary->train();
    inner.train();
  }
}

// ----------------------------------------------------------------------------------------------
// Modes and options.
// ----------------------------------------------------------------------------------------------

TEST(IterateAveraging, ModeSwitchesAndStepInEvalMode) {
  auto params = make_params(10);
  const auto options = shampoo_options(GeneralizedPrimalAveragingConfig{});
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{params[0], params[1]},
                      std::make_unique<ShampooOptions>(options));
  groups.emplace_back(std::vector<at::Tensor>{params[2]},
                      std::make_unique<ShampooOptions>(
                          ShampooOptions(options).iterate_averaging(std::monostate{})));
  DistributedShampoo opt(groups, options);
  opt.eval();  // before any step: Z = W, nothing moves
  EXPECT_TRUE(bit_equal(snapshot(params), snapshot(make_params(10))));
  opt.train();
  for (int t = 1; t <= 2; ++t) {
    set_grads(params, t);
    opt.step();
  }
  const auto y = snapshot(params);
  opt.train();  // already training: nothing
  EXPECT_TRUE(bit_equal(snapshot(params), y));
  opt.eval();
  const auto x = snapshot(params);
  EXPECT_FALSE(at::equal(x[0], y[0]));
  EXPECT_TRUE(bit_equal(x[2], y[2]));  // the group without averaging is not moved
  opt.eval();                          // already evaluating: nothing
  EXPECT_TRUE(bit_equal(snapshot(params), x));
  set_grads(params, 3);
  expect_error([&] { opt.step(); }, {"eval mode", "call train() before step()"});
  EXPECT_TRUE(bit_equal(snapshot(params), x));
  EXPECT_EQ(opt.group_step(0), 2);
  opt.train();
  EXPECT_TRUE(all_close(params[0].detach(), y[0]));  // back to y, up to rounding
  opt.step();
  EXPECT_EQ(opt.group_step(0), 3);
}

TEST(IterateAveraging, ValidationMessages) {
  const auto check = [](shampoo::IterateAveragingConfig averaging,
                        const std::vector<std::string>& fragments, double momentum = 0.0) {
    expect_error(
        [&] { ShampooOptions::reference_defaults().momentum(momentum).iterate_averaging(averaging).validate(); },
        fragments);
  };
  check(GeneralizedPrimalAveragingConfig{1.0, 0.5},
        {"iterate_averaging.eval_interp_coeff", "got 1", "[0, 1)"});
  check(GeneralizedPrimalAveragingConfig{-0.1, 0.5}, {"eval_interp_coeff", "got -0.1"});
  check(GeneralizedPrimalAveragingConfig{0.5, 0.0},
        {"iterate_averaging.train_interp_coeff", "got 0", "(0, 1]"});
  check(ScheduleFreeConfig{1.5, 2.0}, {"train_interp_coeff", "got 1.5", "ScheduleFreeConfig"});
  check(ScheduleFreeConfig{0.8, -1.0}, {"eval_coeff_lr_power", "got -1", ">= 0"});
  check(GeneralizedPrimalAveragingConfig{}, {"ShampooOptions.momentum", "got 0.5", "expected 0"},
        0.5);
  EXPECT_NO_THROW(
      ShampooOptions::reference_defaults().iterate_averaging(GeneralizedPrimalAveragingConfig{0.0, 1.0}).validate());
  EXPECT_NO_THROW(ShampooOptions::reference_defaults().iterate_averaging(ScheduleFreeConfig{}).validate());
}

TEST(IterateAveraging, StructuralMerging) {
  const auto gpa = ShampooOptions::reference_defaults().iterate_averaging(GeneralizedPrimalAveragingConfig{});
  EXPECT_FALSE(shampoo::structurally_equal(gpa, ShampooOptions::reference_defaults()));
  EXPECT_FALSE(shampoo::structurally_equal(
      gpa, ShampooOptions::reference_defaults().iterate_averaging(GeneralizedPrimalAveragingConfig{0.9, 0.7})));
  EXPECT_FALSE(
      shampoo::structurally_equal(gpa, ShampooOptions::reference_defaults().iterate_averaging(ScheduleFreeConfig{})));
  EXPECT_TRUE(shampoo::structurally_equal(gpa, ShampooOptions(gpa).lr(0.5)));
  auto params = make_params(11);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{params[0]}, std::make_unique<ShampooOptions>(gpa));
  groups.emplace_back(std::vector<at::Tensor>{params[1]},
                      std::make_unique<ShampooOptions>(ShampooOptions(gpa).lr(0.5)));
  groups.emplace_back(std::vector<at::Tensor>{params[2]}, std::make_unique<ShampooOptions>());
  DistributedShampoo opt(groups);
  EXPECT_EQ(opt.stats().virtual_groups, 2);
  opt.group_options(0).iterate_averaging(ScheduleFreeConfig{});
  set_grads(params, 1);
  expect_error([&] { opt.step(); }, {"structural option iterate_averaging", "ScheduleFreeConfig"});
}

ShampooOptions through_archive(const ShampooOptions& written, bool drop_averaging) {
  torch::serialize::OutputArchive out;
  for (const auto& field : shampoo::detail::option_fields()) {
    if (!drop_averaging || field.name != "iterate_averaging") field.write(written, out);
  }
  return shampoo::testing::read_options(out,
                                        ShampooOptions::reference_defaults().iterate_averaging(ScheduleFreeConfig{}));
}

TEST(IterateAveraging, ArchivesRoundTripAndOldArchivesLoad) {
  for (const auto& config :
       {shampoo::IterateAveragingConfig{std::monostate{}},
        shampoo::IterateAveragingConfig{GeneralizedPrimalAveragingConfig{0.3, 0.4}},
        shampoo::IterateAveragingConfig{ScheduleFreeConfig{0.6, 1.5}}}) {
    const auto written = ShampooOptions::reference_defaults(0.2).iterate_averaging(config);
    EXPECT_TRUE(through_archive(written, false).iterate_averaging() == config);
  }
  // Written before iterate averaging existed: no averaging.
  const auto old = through_archive(ShampooOptions::reference_defaults(0.3), true);
  EXPECT_TRUE(std::holds_alternative<std::monostate>(old.iterate_averaging()));
  EXPECT_EQ(old.lr(), 0.3);
}

TEST(IterateAveraging, CheckpointWithAnotherAveragingIsRefused) {
  auto params = make_params(12);
  DistributedShampoo gpa(params, shampoo_options(GeneralizedPrimalAveragingConfig{}));
  std::stringstream stream;
  torch::save(gpa, stream);
  DistributedShampoo schedule_free(params, shampoo_options(ScheduleFreeConfig{}));
  expect_error([&] { torch::load(schedule_free, stream); },
               {"iterate_averaging", "GeneralizedPrimalAveragingConfig", "ScheduleFreeConfig"});
}

TEST(IterateAveraging, CudaEqualsCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  for (const auto& config : averaging_configs()) {
    const auto options = shampoo_options(config);
    auto cpu = make_params(13);
    std::vector<at::Tensor> gpu;
    for (const auto& p : cpu) gpu.push_back(p.detach().cuda().requires_grad_());
    DistributedShampoo on_cpu(cpu, options);
    DistributedShampoo on_gpu(gpu, options);
    for (int t = 1; t <= 4; ++t) {
      set_grads(cpu, t);
      for (size_t i = 0; i < gpu.size(); ++i) gpu[i].mutable_grad() = cpu[i].grad().cuda();
      on_cpu.step();
      on_gpu.step();
      if (t == 3) {
        on_cpu.eval();
        on_gpu.eval();
      }
      for (size_t i = 0; i < cpu.size(); ++i) {
        // float32 roots on cuSOLVER vs LAPACK (as tests/preconditioners/cuda_test.cpp).
        ASSERT_TRUE(all_close(gpu[i].detach().cpu(), cpu[i].detach(), {1e-4, 1e-5}))
            << averaging_name(config) << " step " << t << " param " << i;
      }
      if (t == 3) {
        on_cpu.train();
        on_gpu.train();
      }
    }
  }
}

}  // namespace
