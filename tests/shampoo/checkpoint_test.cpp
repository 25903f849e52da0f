// Checkpoints: torch::save / torch::load resume bit-identically; a checkpoint of another model
// or other structural options is refused with a clear error and leaves the optimizer untouched.
#include <shampoo/option_fields.h>
#include <shampoo/shampoo.h>
#include <torch/optim/adam.h>
#include <torch/serialize.h>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>

#include "support/test_support.h"

namespace {

using shampoo::DistributedShampoo;
using shampoo::ShampooOptions;
using shampoo::testing::bit_equal;

struct Run {
  std::vector<at::Tensor> params;
  std::unique_ptr<DistributedShampoo> optimizer;
};

/// Two groups (different lr, momentum) over a weight, a blocked weight, a 3-D weight and a bias.
Run make_run(const ShampooOptions& base, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Run run;
  run.params = {at::randn({6, 5}, gen).requires_grad_(), at::randn({9, 4}, gen).requires_grad_(),
                at::randn({3, 4, 2}, gen).requires_grad_(), at::randn({5}, gen).requires_grad_()};
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{run.params[0], run.params[1]},
                      std::make_unique<ShampooOptions>(ShampooOptions(base).lr(0.02)));
  groups.emplace_back(
      std::vector<at::Tensor>{run.params[2], run.params[3]},
      std::make_unique<ShampooOptions>(ShampooOptions(base).lr(0.01).momentum(0.5)));
  run.optimizer = std::make_unique<DistributedShampoo>(groups, base);
  return run;
}

void step(Run& run, int t) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + t);
  for (auto& p : run.params) p.mutable_grad() = at::randn(p.sizes(), gen);
  run.optimizer->step();
}

std::vector<at::Tensor> values(const Run& run) {
  std::vector<at::Tensor> out;
  for (const auto& p : run.params) out.push_back(p.detach().clone());
  return out;
}

ShampooOptions base_options() {
  return ShampooOptions::reference_defaults(0.01)
      .betas({0.9, 0.99})
      .epsilon(1e-8)
      .precondition_frequency(3)
      .start_preconditioning_step(2)
      .max_preconditioner_dim(6)
      .grafting(shampoo::AdamGraftingConfig{0.99, 1e-8});
}

class Resume : public ::testing::TestWithParam<int> {};

TEST_P(Resume, ResumedRunEqualsUninterruptedBitForBit) {
  auto options = base_options();
  if (GetParam() == 1) options.preconditioner(shampoo::EigenvalueCorrectedShampooConfig{});
  if (GetParam() == 3) {
    options.preconditioner(
        shampoo::RootInvShampooConfig{.solver = shampoo::RootSolver::kCoupledNewton});
  }
  if (GetParam() == 4) {
    options.preconditioner(shampoo::RootInvShampooConfig{.solver = shampoo::RootSolver::kNewtonDB});
  }
  if (GetParam() == 7) {
    // Newton–Schulz computes roots that are powers of two: the 3-D weight gets 1/8.
    options
        .preconditioner(shampoo::RootInvShampooConfig{.solver = shampoo::RootSolver::kNewtonSchulz})
        .inverse_exponent_override({{3, {{shampoo::kAllDims, 0.125}}}});
  }
  if (GetParam() == 5) {
    options.preconditioner(
        shampoo::EigendecomposedShampooConfig{.eigenbasis_method = shampoo::EigenbasisMethod::kQR});
  }
  if (GetParam() == 6) {
    options.epsilon(0.0).preconditioner(shampoo::EigendecomposedShampooConfig{
        .rank_deficient_stability = shampoo::PseudoInverseConfig{.rank_rtol = 1e-5}});
  }
  if (GetParam() == 2)
    options.weight_decay(1e-3)
        .weight_decay_type(shampoo::WeightDecayType::kL2)
        .use_nesterov(true)
        .momentum(0.9)
        .beta3(0.5);
  auto uninterrupted = make_run(options, 1);
  for (int t = 1; t <= 10; ++t) step(uninterrupted, t);

  auto first = make_run(options, 1);
  for (int t = 1; t <= 5; ++t) step(first, t);
  first.optimizer->group_options(1).lr(0.005);  // as a scheduler would
  const auto path = shampoo::testing::temp_path("opt.pt");
  torch::save(*first.optimizer, path);
  const auto params_at_save = values(first);

  // A fresh process would rebuild the model and optimizer, then restore both.
  auto resumed = make_run(options, 1);
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < resumed.params.size(); ++i) resumed.params[i].copy_(params_at_save[i]);
  }
  torch::load(*resumed.optimizer, path);
  EXPECT_EQ(resumed.optimizer->group_step(0), 5);
  EXPECT_EQ(resumed.optimizer->group_options(1).lr(), 0.005);
  resumed.optimizer->group_options(1).lr(0.01);  // back to the uninterrupted run's value
  for (int t = 6; t <= 10; ++t) step(resumed, t);
  EXPECT_TRUE(bit_equal(values(resumed), values(uninterrupted)));
  std::filesystem::remove(path);
}

INSTANTIATE_TEST_SUITE_P(Configs, Resume, ::testing::Values(0, 1, 2, 3, 4, 5, 6, 7));

TEST(Resume, WithoutStateTheRunDiverges) {
  // The resume test above could not pass by accident: skipping the load changes the result.
  auto uninterrupted = make_run(base_options(), 1);
  for (int t = 1; t <= 10; ++t) step(uninterrupted, t);
  auto first = make_run(base_options(), 1);
  for (int t = 1; t <= 5; ++t) step(first, t);
  auto fresh = make_run(base_options(), 1);
  {
    torch::NoGradGuard no_grad;
    const auto v = values(first);
    for (size_t i = 0; i < fresh.params.size(); ++i) fresh.params[i].copy_(v[i]);
  }
  for (int t = 6; t <= 10; ++t) step(fresh, t);
  EXPECT_FALSE(bit_equal(values(fresh), values(uninterrupted)));
}

void expect_load_error(DistributedShampoo& optimizer, const std::string& path,
                       const std::string& fragment) {
  try {
    torch::load(optimizer, path);
    ADD_FAILURE() << "expected load to fail with '" << fragment << "'";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find(fragment), std::string::npos) << message;
  }
}

// A checkpoint of an optimizer built with ShampooOptions() before the defaults changed (the
// reference's then) loads into one built with reference_defaults(); today's defaults refuse it,
// saying how to load it.
TEST(CheckpointErrors, CheckpointsOfTheFormerDefaultsLoadWithTheReferencePreset) {
  auto source = make_run(ShampooOptions::reference_defaults(), 1);
  for (int t = 1; t <= 3; ++t) step(source, t);
  const auto path = shampoo::testing::temp_path("former_defaults.pt");
  torch::save(*source.optimizer, path);
  auto today = make_run(ShampooOptions(), 1);
  expect_load_error(*today.optimizer, path, "ShampooOptions::reference_defaults(lr)");
  auto preset = make_run(ShampooOptions::reference_defaults(), 1);
  torch::load(*preset.optimizer, path);
  EXPECT_EQ(preset.optimizer->group_step(0), 3);
  std::remove(path.c_str());
}

TEST(CheckpointErrors, OtherModelOrStructureIsRefusedAndNothingChanges) {
  auto source = make_run(base_options(), 1);
  for (int t = 1; t <= 3; ++t) step(source, t);
  const auto path = shampoo::testing::temp_path("opt.pt");
  torch::save(*source.optimizer, path);

  // A model with another shape.
  auto other_params = std::vector<at::Tensor>{
      at::randn({6, 5}).requires_grad_(), at::randn({9, 3}).requires_grad_(),
      at::randn({3, 4, 2}).requires_grad_(), at::randn({5}).requires_grad_()};
  DistributedShampoo other(other_params, base_options());
  expect_load_error(other, path, "different model: parameter 1");

  // Fewer parameters.
  DistributedShampoo smaller({at::randn({6, 5}).requires_grad_()}, base_options());
  expect_load_error(smaller, path, "parameters");

  // Same model, other structural options.
  auto other_structure = make_run(base_options().max_preconditioner_dim(4), 1);
  expect_load_error(*other_structure.optimizer, path,
                    "param group 0: max_preconditioner_dim: got 6 in the checkpoint, expected 4");

  // Not a checkpoint of this optimizer.
  const auto junk = shampoo::testing::temp_path("junk.pt");
  torch::save(at::ones({3}), junk);
  auto target = make_run(base_options(), 1);
  for (int t = 1; t <= 3; ++t) step(target, t);
  auto twin = make_run(base_options(), 1);
  for (int t = 1; t <= 3; ++t) step(twin, t);
  expect_load_error(*target.optimizer, junk, "not a DistributedShampoo checkpoint");
  // The failed loads left the target as it was: it continues exactly like its twin.
  for (int t = 4; t <= 6; ++t) {
    step(target, t);
    step(twin, t);
  }
  EXPECT_TRUE(bit_equal(values(target), values(twin)));
  std::filesystem::remove(path);
  std::filesystem::remove(junk);
}

/// Every field of ShampooOptions away from its default (structural ones included).
ShampooOptions every_field_changed() {
  return ShampooOptions::reference_defaults(0.125)
      .betas({0.5, 0.75})
      .beta3(0.25)
      .epsilon(1e-7)
      .weight_decay(0.0625)
      .weight_decay_type(shampoo::WeightDecayType::kL2)
      .peak_lr(0.5)
      .momentum(0.375)
      .dampening(0.125)
      .use_nesterov(true)
      .max_preconditioner_dim(7)
      .use_merge_dims(false)
      .precondition_frequency(5)
      .start_preconditioning_step(11)
      .use_bias_correction(false)
      .grafting(shampoo::RMSpropGraftingConfig{0.875, 1e-9})
      .factor_matrix_dtype(at::kFloat)
      .use_symmetric_packing(false)
      .compact_state(shampoo::CompactState::kInt8)
      .preconditioner(
          shampoo::EigenvalueCorrectedShampooConfig{shampoo::EigenbasisMethod::kQR, false})
      .inverse_exponent_override({{2, {{shampoo::kAllDims, 0.25}, {1, 0.0}}}, {1, {{0, 0.5}}}})
      .num_tolerated_failed_amortized_computations(9)
      .use_trace_scaling(true)
      .trace_scaling_exponent(0.75)
      .iterate_averaging(shampoo::GeneralizedPrimalAveragingConfig{0.25, 0.625});
}

TEST(OptionsArchive, EveryFieldRoundTripsThroughAFile) {
  const auto written = every_field_changed();
  const auto read = shampoo::testing::options_round_trip(written);
  EXPECT_EQ(read.lr(), written.lr());
  EXPECT_EQ(read.betas(), written.betas());
  EXPECT_EQ(read.beta3(), written.beta3());
  EXPECT_EQ(read.epsilon(), written.epsilon());
  EXPECT_EQ(read.weight_decay(), written.weight_decay());
  EXPECT_EQ(read.weight_decay_type(), written.weight_decay_type());
  EXPECT_EQ(read.peak_lr(), written.peak_lr());
  EXPECT_EQ(read.use_trace_scaling(), written.use_trace_scaling());
  EXPECT_EQ(read.trace_scaling_exponent(), written.trace_scaling_exponent());
  EXPECT_EQ(read.momentum(), written.momentum());
  EXPECT_EQ(read.dampening(), written.dampening());
  EXPECT_EQ(read.use_nesterov(), written.use_nesterov());
  EXPECT_EQ(read.max_preconditioner_dim(), written.max_preconditioner_dim());
  EXPECT_EQ(read.use_merge_dims(), written.use_merge_dims());
  EXPECT_EQ(read.precondition_frequency(), written.precondition_frequency());
  EXPECT_EQ(read.start_preconditioning_step(), written.start_preconditioning_step());
  EXPECT_EQ(read.use_bias_correction(), written.use_bias_correction());
  EXPECT_TRUE(read.grafting() == written.grafting());
  EXPECT_EQ(read.factor_matrix_dtype(), written.factor_matrix_dtype());
  EXPECT_EQ(read.use_symmetric_packing(), written.use_symmetric_packing());
  EXPECT_EQ(read.compact_state(), written.compact_state());
  EXPECT_TRUE(read.preconditioner() == written.preconditioner());
  EXPECT_EQ(read.inverse_exponent_override(), written.inverse_exponent_override());
  EXPECT_EQ(read.num_tolerated_failed_amortized_computations(),
            written.num_tolerated_failed_amortized_computations());
  EXPECT_TRUE(read.iterate_averaging() == written.iterate_averaging());
}

TEST(OptionsArchive, RootSolverRoundTripsThroughAFile) {
  const auto written = ShampooOptions::reference_defaults().preconditioner(
      shampoo::RootInvShampooConfig{.retry_double_precision = false,
                                    .solver = shampoo::RootSolver::kNewtonDB,
                                    .max_iterations = 37,
                                    .tolerance = 3e-2,
                                    .tf32 = true});
  EXPECT_TRUE(shampoo::testing::options_round_trip(written).preconditioner() ==
              written.preconditioner());
}

TEST(OptionsArchive, EveryRowOfTheOptionTableRoundTrips) {
  // Table-driven: a row added to shampoo/option_fields.cpp is covered here once
  // every_field_changed() sets it (the first expectation fails until it does).
  const auto written = every_field_changed();
  const auto read = shampoo::testing::options_round_trip(written);
  std::set<std::string> keys;
  for (const auto& field : shampoo::detail::option_fields()) {
    EXPECT_NE(field.code(written), field.code(ShampooOptions{}))
        << field.name << " is not changed by every_field_changed()";
    EXPECT_EQ(field.code(read), field.code(written))
        << field.name << ": wrote " << field.describe(written) << ", read " << field.describe(read);
    for (const auto& key : field.archive_keys) {
      EXPECT_TRUE(keys.insert(key).second) << "archive key " << key << " used twice";
    }
  }
}

/// A structural option of the checkpoint's optimizer and a different value of it.
struct StructuralCase {
  std::string field;
  std::function<void(ShampooOptions&)> change;
};

void PrintTo(const StructuralCase& c, std::ostream* os) { *os << c.field; }

class StructuralMismatch : public ::testing::TestWithParam<StructuralCase> {};

TEST_P(StructuralMismatch, IsRefusedNamingTheField) {
  auto source = make_run(base_options(), 1);
  for (int t = 1; t <= 3; ++t) step(source, t);
  const auto path = shampoo::testing::temp_path("opt.pt");
  torch::save(*source.optimizer, path);
  auto options = base_options();
  GetParam().change(options);
  auto target = make_run(options, 1);
  expect_load_error(*target.optimizer, path, "param group 0: " + GetParam().field + ": got ");
  std::filesystem::remove(path);
}

INSTANTIATE_TEST_SUITE_P(
    Fields, StructuralMismatch,
    ::testing::Values(
        StructuralCase{"preconditioner",
                       [](ShampooOptions& o) {
                         o.preconditioner(shampoo::EigenvalueCorrectedShampooConfig{});
                       }},
        StructuralCase{
            "preconditioner",
            [](ShampooOptions& o) { o.preconditioner(shampoo::RootInvShampooConfig{false}); }},
        StructuralCase{"preconditioner",
                       [](ShampooOptions& o) {
                         o.preconditioner(shampoo::RootInvShampooConfig{
                             .solver = shampoo::RootSolver::kCoupledNewton});
                       }},
        StructuralCase{"inverse_exponent_override",
                       [](ShampooOptions& o) {
                         o.inverse_exponent_override({{2, {{shampoo::kAllDims, 0.5}}}});
                       }},
        StructuralCase{"grafting kind",
                       [](ShampooOptions& o) {
                         o.grafting(shampoo::RMSpropGraftingConfig{0.99, 1e-8});
                       }},
        StructuralCase{"use_nesterov", [](ShampooOptions& o) { o.use_nesterov(true); }},
        StructuralCase{"use_bias_correction",
                       [](ShampooOptions& o) { o.use_bias_correction(false); }},
        StructuralCase{"num_tolerated_failed_amortized_computations",
                       [](ShampooOptions& o) { o.num_tolerated_failed_amortized_computations(7); }},
        StructuralCase{"max_preconditioner_dim",
                       [](ShampooOptions& o) { o.max_preconditioner_dim(4); }},
        StructuralCase{"start_preconditioning_step",
                       [](ShampooOptions& o) { o.start_preconditioning_step(4); }},
        StructuralCase{
            "weight_decay_type",
            [](ShampooOptions& o) { o.weight_decay_type(shampoo::WeightDecayType::kL2); }}),
    [](const ::testing::TestParamInfo<StructuralCase>& info) {
      auto name = info.param.field + "_" + std::to_string(info.index);
      for (auto& c : name) {
        if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
      }
      return name;
    });

TEST(CheckpointErrors, ArchiveOfAnotherOptimizerIsNamedAsSuch) {
  auto p = at::randn({3, 2}).requires_grad_();
  torch::optim::Adam adam({p}, torch::optim::AdamOptions(0.1));
  p.mutable_grad() = at::ones({3, 2});
  adam.step();
  const auto path = shampoo::testing::temp_path("adam.pt");
  torch::save(adam, path);
  DistributedShampoo shampoo_opt({at::randn({3, 2}).requires_grad_()});
  expect_load_error(shampoo_opt, path,
                    "this archive is not a DistributedShampoo checkpoint (it has no "
                    "'shampoo/format_version' entry; was it written by another optimizer?)");
  // The header of format 1 (before the option table): named as such.
  torch::serialize::OutputArchive format1;
  format1.write("format_version", c10::IValue(int64_t{1}));
  format1.save_to(path);
  expect_load_error(shampoo_opt, path, "earlier DistributedShampoo (format version 1");
  std::filesystem::remove(path);
}

TEST(CheckpointErrors, LoadCheckpointNamesTheFile) {
  auto run = make_run(base_options(), 1);
  step(run, 1);
  const auto path = shampoo::testing::temp_path("opt.pt");
  torch::save(*run.optimizer, path);
  auto resumed = make_run(base_options(), 1);
  shampoo::load_checkpoint(*resumed.optimizer, path);
  EXPECT_EQ(resumed.optimizer->group_step(0), 1);

  auto expect_error = [&](const std::string& file, const std::vector<std::string>& fragments) {
    try {
      shampoo::load_checkpoint(*resumed.optimizer, file);
      ADD_FAILURE() << "expected load_checkpoint(" << file << ") to fail";
    } catch (const c10::Error& e) {
      const std::string message = e.what_without_backtrace();
      for (const auto& f : fragments) EXPECT_NE(message.find(f), std::string::npos) << message;
    }
  };
  // Truncated, as by a full disk or a copy cut short.
  std::filesystem::resize_file(path, std::filesystem::file_size(path) / 2);
  expect_error(path, {path + ": not a readable checkpoint", "truncated, damaged",
                      "failed finding central directory"});
  {
    std::ofstream garbage(path, std::ios::binary | std::ios::trunc);
    garbage << "not a checkpoint";
  }
  expect_error(path, {path + ": not a readable checkpoint"});
  expect_error(path + ".missing", {path + ".missing: no such checkpoint file"});
  // A readable archive of something else: the optimizer's own message, after the path.
  torch::save(at::ones({3}), path);
  expect_error(path, {path + ": checkpoint: this archive is not a DistributedShampoo checkpoint"});
  std::filesystem::remove(path);
}

TEST(CheckpointErrors, ShampooCheckpointIntoAdamFailsInLibTorch) {
  // LibTorch's own Adam::load reads the archive: its message is not ours to improve. This pins
  // what docs/checkpoints.md ("Checkpoint errors") says about it.
  auto run = make_run(base_options(), 1);
  step(run, 1);
  const auto path = shampoo::testing::temp_path("opt.pt");
  torch::save(*run.optimizer, path);
  torch::optim::Adam adam(run.params);
  try {
    torch::load(adam, path);
    ADD_FAILURE() << "torch::optim::Adam loaded a DistributedShampoo checkpoint";
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("step_buffers"), std::string::npos) << message;
  }
  std::filesystem::remove(path);
}

}  // namespace
