// The trainer's defaults are the settings README.md recommends (its first snippet): lr 1e-3,
// betas (0.9, 0.999), epsilon 1e-12, roots every 50 steps, Adam grafting (0.999, 1e-8); flags and
// TrainerConfig's own initializers agree, and they reach the optimizer's options.
#include "examples/trainer_config.h"

#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/nn.h>
#include <torch/types.h>

#include <stdexcept>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "examples/trainer_device.h"
#include "examples/trainer_optimizer.h"
#include "shampoo/shampoo.h"

namespace {

using shampoo::examples::CudaInfo;
using shampoo::examples::DeviceChoice;
using shampoo::examples::GraftingKind;
using shampoo::examples::OptimizerKind;
using shampoo::examples::TrainerConfig;

std::optional<TrainerConfig> parse(std::vector<const char*> args) {
  args.insert(args.begin(), "cifar10_trainer");
  return shampoo::examples::parse_trainer_config(static_cast<int>(args.size()), args.data());
}

TrainerConfig parse_no_flags() {
  const auto config = parse({});
  EXPECT_TRUE(config.has_value());
  return *config;
}

void expect_recommended(const TrainerConfig& config) {
  EXPECT_EQ(config.optimizer, OptimizerKind::kShampoo);
  EXPECT_EQ(config.lr, 1e-3);
  EXPECT_EQ(config.beta1, 0.9);
  EXPECT_EQ(config.beta2, 0.999);
  EXPECT_EQ(config.epsilon, 1e-12);
  EXPECT_EQ(config.precondition_frequency, 50);
  EXPECT_EQ(config.start_preconditioning_step, -1);
  EXPECT_EQ(config.grafting, GraftingKind::kAdam);
  EXPECT_EQ(config.grafting_beta2, 0.999);
  EXPECT_EQ(config.grafting_epsilon, 1e-8);
}

TEST(TrainerDefaults, FlagsAreTheReadmeRecommendedSettings) {
  expect_recommended(parse_no_flags());
}

TEST(TrainerDefaults, ConfigInitializersAgreeWithTheFlags) { expect_recommended(TrainerConfig{}); }

TEST(TrainerDefaults, ReachTheOptimizer) {
  const auto config = parse_no_flags();
  torch::nn::Linear model(8, 4);
  const auto plans = shampoo::examples::plan_param_groups(model->named_parameters(), config);
  const auto optimizer = shampoo::examples::make_optimizer(config, plans, nullptr);
  auto* shampoo_optimizer = dynamic_cast<shampoo::DistributedShampoo*>(optimizer.get());
  ASSERT_NE(shampoo_optimizer, nullptr);
  const auto& options = shampoo_optimizer->group_options(0);
  EXPECT_EQ(options.lr(), 1e-3);
  EXPECT_EQ(options.betas(), std::make_tuple(0.9, 0.999));
  EXPECT_EQ(options.epsilon(), 1e-12);
  EXPECT_EQ(options.precondition_frequency(), 50);
  EXPECT_EQ(options.resolved_start_preconditioning_step(), 50);
  ASSERT_TRUE(std::holds_alternative<shampoo::AdamGraftingConfig>(options.grafting()));
  EXPECT_EQ(std::get<shampoo::AdamGraftingConfig>(options.grafting()),
            (shampoo::AdamGraftingConfig{0.999, 1e-8}));
  // The trainer's Shampoo settings are the library's defaults (not the reference's).
  const shampoo::ShampooOptions library;
  EXPECT_EQ(options.precondition_frequency(), library.precondition_frequency());
  EXPECT_EQ(options.grafting(), library.grafting());
  EXPECT_EQ(options.betas(), library.betas());
  EXPECT_EQ(options.factor_matrix_dtype(), library.factor_matrix_dtype());
  EXPECT_EQ(options.relative_epsilon(), library.relative_epsilon());
  EXPECT_EQ(options.precondition_1d(), library.precondition_1d());
  EXPECT_EQ(options.max_factored_dim(), library.max_factored_dim());
  EXPECT_EQ(options.factored_grafting(), library.factored_grafting());
}

TEST(TrainerFlags, ReachTheConfig) {
  const auto config = parse({"--dataset",
                             "fashion-mnist",
                             "--optimizer=adamw",
                             "--betas",
                             "0.8,0.99",
                             "--seed",
                             "7",
                             "--no-merge-groups",
                             "--communication-dtype",
                             "bf16",
                             "--bias-weight-decay",
                             "0.01",
                             "--lrs",
                             "0.1,0.05",
                             "--use-bias-correction=false",
                             "--lr-schedule",
                             "cosine",
                             "--grafting",
                             "rmsprop",
                             "--checkpoint-dir",
                             "ckpt",
                             "--device",
                             "cuda",
                             "--factor-dtype",
                             "fp32",
                             "--factored-grafting=false"});
  ASSERT_TRUE(config.has_value());
  EXPECT_EQ(config->dataset, shampoo::examples::DatasetKind::kFashionMnist);
  EXPECT_EQ(config->data_dir, shampoo::examples::default_data_dir(config->dataset));
  EXPECT_EQ(config->optimizer, OptimizerKind::kAdamW);
  EXPECT_EQ(config->beta1, 0.8);
  EXPECT_EQ(config->beta2, 0.99);
  EXPECT_EQ(config->seed, 7u);
  EXPECT_FALSE(config->merge_groups);
  EXPECT_EQ(config->communication_dtype, c10::ScalarType::BFloat16);
  EXPECT_EQ(config->bias_weight_decay, 0.01);
  EXPECT_EQ(config->lrs, (std::vector<double>{0.1, 0.05}));
  EXPECT_FALSE(config->use_bias_correction);
  EXPECT_EQ(config->lr_schedule, shampoo::examples::LrSchedule::kCosine);
  EXPECT_EQ(config->grafting, GraftingKind::kRmsProp);
  EXPECT_EQ(config->checkpoint_dir, "ckpt");
  EXPECT_EQ(config->device, DeviceChoice::kCuda);
  EXPECT_EQ(config->factor_dtype, c10::ScalarType::Float);
  EXPECT_FALSE(config->factored_grafting);
  EXPECT_NE(config->command_line.find("--betas 0.8,0.99"), std::string::npos);
}

TEST(TrainerFlags, BadValuesAreErrorsNamingTheFlagTheValueAndWhatIsAllowed) {
  const std::vector<std::pair<std::vector<const char*>, std::string>> cases{
      {{"--epochs", "0"}, "--epochs: got '0', expected an integer >= 1"},
      {{"--seed", "-1"}, "--seed: got '-1', expected an integer >= 0"},
      {{"--threads", "two"}, "--threads: got 'two', expected an integer"},
      {{"--lr", "-0.1"}, "--lr: got '-0.1', expected a number >= 0"},
      {{"--lrs", "0.1,-1"}, "--lrs: got '0.1,-1', expected numbers >= 0"},
      {{"--betas", "0.9"}, "--betas: got '0.9', expected 2 numbers beta1,beta2"},
      {{"--device", "gpu"}, "--device: got 'gpu', expected one of auto, cpu, cuda"},
      {{"--factor-dtype", "bf16"}, "--factor-dtype: got 'bf16', expected one of fp32, fp64"},
      {{"--optimizer", "lamb"},
       "--optimizer: got 'lamb', expected one of sgd, adam, adamw, shampoo"},
      {{"--communicate-params=perhaps"}, "--communicate-params: got 'perhaps', expected true or"},
      {{"--epoch", "2"}, "unknown flag --epoch"},
      {{"--sharding", "hybrid", "--amp", "fp16"},
       "--sharding hybrid: --amp fp16 needs a GradScaler"},
      {{"--sharding", "full", "--shard-group-size", "2"},
       "--shard-group-size: got 2 with --sharding full; it sets the shard groups of --sharding "
       "hybrid"},
      {{"--sharding", "hybrid", "--shard-group-size", "-1"},
       "--shard-group-size: got '-1', expected an integer >= 0"},
      {{"--micro-batches", "0"}, "--micro-batches: got '0', expected an integer >= 1"},
      {{"--dataset", "cifar10", "--model", "lm"},
       "--model: got lm with --dataset cifar10; --model lm needs a text corpus (--dataset ptb)"},
      {{"--dataset", "ptb", "--model", "convnet"},
       "--model: got convnet with --dataset ptb; a text corpus needs --model lm"},
      {{"--model", "autoencoder", "--bptt", "20"},
       "--bptt: given with --model autoencoder; it sets the language model (--model lm)"},
      {{"--lm-dim", "64"}, "--lm-dim: given with --model convnet"},
      {{"--dataset", "ptb", "--lm-dropout", "1"},
       "--lm-dropout: got 1, expected a probability in [0, 1)"},
      {{"--dataset", "ptb", "--bptt", "0"}, "--bptt: got '0', expected an integer >= 1"},
      {{"--dataset", "imagenet"},
       "--dataset: got 'imagenet', expected one of cifar10, "
       "fashion-mnist, ptb"},
  };
  for (const auto& [args, expected] : cases) {
    try {
      parse(args);
      ADD_FAILURE() << "no error; expected " << expected;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos)
          << "message '" << e.what() << "' lacks '" << expected << "'";
    }
  }
}

TEST(TrainerFlags, PtbDefaultsToTheLanguageModelAndItsSettings) {
  const auto config = parse({"--dataset", "ptb"});
  ASSERT_TRUE(config.has_value());
  EXPECT_EQ(config->dataset, shampoo::examples::DatasetKind::kPtb);
  EXPECT_EQ(config->model, "lm");
  EXPECT_EQ(config->bptt, 35);
  EXPECT_EQ(config->lm_dim, 128);
  EXPECT_EQ(config->lm_dropout, 0.0);
  EXPECT_EQ(config->eval_batch_size, 64);  // sequences, not 500 images
  EXPECT_EQ(config->data_dir,
            shampoo::examples::default_data_dir(shampoo::examples::DatasetKind::kPtb));
  EXPECT_EQ(config->micro_batches, 1);
  EXPECT_TRUE(config->save_params.empty());
  const auto set =
      parse({"--dataset", "ptb", "--model", "lm", "--bptt", "20", "--lm-dim", "64", "--lm-dropout",
             "0.25", "--eval-batch-size", "10", "--micro-batches", "4", "--save-params", "p.pt"});
  ASSERT_TRUE(set.has_value());
  EXPECT_EQ(set->bptt, 20);
  EXPECT_EQ(set->lm_dim, 64);
  EXPECT_EQ(set->lm_dropout, 0.25);
  EXPECT_EQ(set->eval_batch_size, 10);
  EXPECT_EQ(set->micro_batches, 4);
  EXPECT_EQ(set->save_params, "p.pt");
  // The image models keep 500 images per evaluation pass.
  EXPECT_EQ(parse({"--dataset", "fashion-mnist"})->eval_batch_size, 500);
}

TEST(TrainerFlags, HybridShardingTakesAShardGroupSize) {
  const auto config = parse({"--sharding", "hybrid", "--shard-group-size", "2"});
  ASSERT_TRUE(config.has_value());
  EXPECT_EQ(config->sharding, shampoo::examples::ShardingMode::kHybrid);
  EXPECT_EQ(config->shard_group_size, 2);
  EXPECT_TRUE(config->fully_sharded());
  EXPECT_EQ(parse({"--sharding", "hybrid"})->shard_group_size, 0);  // the ranks of a node
}

TEST(TrainerFlags, HelpPrintsEveryFlagAndReturnsNothing) {
  testing::internal::CaptureStdout();
  EXPECT_FALSE(parse({"--help"}).has_value());
  const std::string usage = testing::internal::GetCapturedStdout();
  for (const char* text :
       {"Usage: cifar10_trainer", "--optimizer {sgd,adam,adamw,shampoo}",
        "--precondition-frequency <value>", "(default: 50)", "--no-merge-groups[=true|false]",
        "--grafting {none,sgd,adagrad,rmsprop,adam}", "--device {auto,cpu,cuda}"}) {
    EXPECT_NE(usage.find(text), std::string::npos) << text << "\n" << usage;
  }
}

TEST(TrainerFlags, CheckpointEveryNeedsACheckpointDir) {
  EXPECT_THROW(
      {
        try {
          parse({"--checkpoint-every", "5"});
        } catch (const std::invalid_argument& e) {
          EXPECT_STREQ(e.what(),
                       "--checkpoint-every: got 5 without --checkpoint-dir (where would the "
                       "checkpoints go?)");
          throw;
        }
      },
      std::invalid_argument);
  EXPECT_EQ(parse({"--checkpoint-every", "5", "--checkpoint-dir", "c"})->checkpoint_every, 5);
}

// ---- batch sizes ------------------------------------------------------------------------------

using shampoo::examples::BatchSizes;
using shampoo::examples::resolve_batch_sizes;

bool operator==(const BatchSizes& a, const BatchSizes& b) {
  return a.global == b.global && a.local == b.local;
}

/// The std::invalid_argument message of resolve_batch_sizes, or "" when it returns.
std::string batch_error(const TrainerConfig& config, int64_t world_size) {
  try {
    resolve_batch_sizes(config, world_size);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(TrainerBatch, LocalBatchSizeIsPerRank) {
  const auto config = *parse({"--local-batch-size", "16"});
  EXPECT_TRUE(resolve_batch_sizes(config, 1) == (BatchSizes{16, 16}));
  EXPECT_TRUE(resolve_batch_sizes(config, 4) == (BatchSizes{64, 16}));
  // The default: 128 per rank.
  EXPECT_TRUE(resolve_batch_sizes(parse_no_flags(), 2) == (BatchSizes{256, 128}));
}

TEST(TrainerBatch, GlobalBatchSizeIsSharedByTheRanks) {
  const auto config = *parse({"--global-batch-size", "32"});
  EXPECT_FALSE(config.local_batch_size_given);
  EXPECT_TRUE(resolve_batch_sizes(config, 1) == (BatchSizes{32, 32}));
  EXPECT_TRUE(resolve_batch_sizes(config, 2) == (BatchSizes{32, 16}));
  EXPECT_TRUE(resolve_batch_sizes(config, 4) == (BatchSizes{32, 8}));
  // Both flags, agreeing.
  const auto both = *parse({"--global-batch-size", "32", "--local-batch-size", "8"});
  EXPECT_TRUE(resolve_batch_sizes(both, 4) == (BatchSizes{32, 8}));
}

TEST(TrainerBatch, UnevenOrConflictingBatchesAreErrorsNamingFlagsAndNumbers) {
  EXPECT_EQ(batch_error(*parse({"--global-batch-size", "32"}), 3),
            "--global-batch-size: got 32, which 3 ranks (WORLD_SIZE) cannot share evenly; choose "
            "a multiple of 3, or a number of ranks that divides 32");
  EXPECT_EQ(batch_error(*parse({"--global-batch-size", "32", "--local-batch-size", "16"}), 4),
            "--local-batch-size 16 and --global-batch-size 32 disagree at 4 ranks (32 / 4 = 8 per "
            "rank); give only --global-batch-size");
}

TEST(TrainerBatch, MicroBatchesMustDivideTheLocalBatch) {
  const auto config = *parse({"--global-batch-size", "32", "--micro-batches", "4"});
  EXPECT_TRUE(resolve_batch_sizes(config, 2) == (BatchSizes{32, 16}));
  EXPECT_TRUE(resolve_batch_sizes(config, 8) == (BatchSizes{32, 4}));
  EXPECT_EQ(batch_error(config, 16),
            "--micro-batches: got 4, which does not divide the local batch of 2 at 16 ranks; "
            "choose a divisor of 2");
  EXPECT_EQ(batch_error(*parse({"--local-batch-size", "10", "--micro-batches", "3"}), 1),
            "--micro-batches: got 3, which does not divide the local batch of 10 at 1 rank; "
            "choose a divisor of 10");
}

// ---- --device ---------------------------------------------------------------------------------

constexpr const char* kNoCudaMessage =
    "--device cuda: no CUDA device is available (torch::cuda::is_available() is false); use "
    "--device cpu or auto";

/// The c10::Error message of resolve_device, or "" when it returns.
std::string resolve_error(DeviceChoice choice, int local_rank, const CudaInfo& cuda) {
  try {
    shampoo::examples::resolve_device(choice, local_rank, cuda);
  } catch (const c10::Error& e) {
    return e.msg();
  }
  return "";
}

TEST(TrainerDevice, DefaultIsAuto) {
  EXPECT_EQ(parse_no_flags().device, DeviceChoice::kAuto);
  EXPECT_EQ(TrainerConfig{}.device, DeviceChoice::kAuto);
}

TEST(TrainerDevice, WithoutCudaAutoIsCpuAndCudaIsAnError) {
  const CudaInfo none{false, 0};
  const c10::Device cpu(c10::kCPU);
  EXPECT_EQ(shampoo::examples::resolve_device(DeviceChoice::kAuto, 0, none), cpu);
  EXPECT_EQ(shampoo::examples::resolve_device(DeviceChoice::kAuto, 3, none), cpu);
  EXPECT_EQ(shampoo::examples::resolve_device(DeviceChoice::kCpu, 0, none), cpu);
  EXPECT_EQ(resolve_error(DeviceChoice::kCuda, 0, none), kNoCudaMessage);
}

TEST(TrainerDevice, WithCudaEveryRankTakesGpuLocalRank) {
  const CudaInfo two_gpus{true, 2};
  EXPECT_EQ(shampoo::examples::resolve_device(DeviceChoice::kAuto, 0, two_gpus),
            c10::Device(c10::kCUDA, 0));
  EXPECT_EQ(shampoo::examples::resolve_device(DeviceChoice::kCuda, 1, two_gpus),
            c10::Device(c10::kCUDA, 1));
  EXPECT_EQ(shampoo::examples::resolve_device(DeviceChoice::kCpu, 1, two_gpus),
            c10::Device(c10::kCPU));
}

TEST(TrainerDevice, MoreRanksThanGpusIsAnErrorNamingLocalRankAndTheCount) {
  const CudaInfo two_gpus{true, 2};
  for (const auto choice : {DeviceChoice::kAuto, DeviceChoice::kCuda}) {
    const std::string flag = "--device " + shampoo::examples::device_choice_name(choice);
    EXPECT_EQ(resolve_error(choice, 2, two_gpus),
              flag +
                  ": LOCAL_RANK 2 needs CUDA device 2, but this node has 2 (0..1); start at "
                  "most that many ranks per node (torchrun --nproc-per-node 2) or use --device "
                  "cpu");
  }
}

TEST(TrainerDevice, CudaOnThisMachine) {
  const CudaInfo cuda = shampoo::examples::query_cuda();
  EXPECT_EQ(cuda.available, torch::cuda::is_available());
  if (cuda.available) {
    EXPECT_GE(cuda.device_count, 1);
    EXPECT_EQ(shampoo::examples::resolve_device(DeviceChoice::kAuto, 0, cuda),
              c10::Device(c10::kCUDA, 0));
  } else {
    EXPECT_EQ(resolve_error(DeviceChoice::kCuda, 0, cuda), kNoCudaMessage);
    EXPECT_EQ(shampoo::examples::resolve_device(DeviceChoice::kAuto, 0, cuda),
              c10::Device(c10::kCPU));
  }
}

// The reference's newer settings as trainer flags (issue 58): --weight-decay-type and
// --trace-scaling reach the optimizer; the old boolean and the new flag cannot contradict.
TEST(TrainerFlags, WeightDecayTypeAndTraceScalingReachTheOptimizer) {
  const auto options_of = [](std::vector<const char*> args) {
    const auto config = parse(std::move(args));
    EXPECT_TRUE(config.has_value());
    torch::nn::Linear model(8, 4);
    const auto plans = shampoo::examples::plan_param_groups(model->named_parameters(), *config);
    const auto optimizer = shampoo::examples::make_optimizer(*config, plans, nullptr);
    auto* shampoo_optimizer = dynamic_cast<shampoo::DistributedShampoo*>(optimizer.get());
    EXPECT_NE(shampoo_optimizer, nullptr);
    return shampoo::ShampooOptions(shampoo_optimizer->group_options(0));
  };
  EXPECT_EQ(options_of({}).weight_decay_type(), shampoo::WeightDecayType::kDecoupled);
  EXPECT_FALSE(options_of({}).use_trace_scaling());
  EXPECT_EQ(options_of({"--weight-decay-type", "corrected"}).weight_decay_type(),
            shampoo::WeightDecayType::kCorrected);
  EXPECT_EQ(options_of({"--weight-decay-type", "independent"}).weight_decay_type(),
            shampoo::WeightDecayType::kIndependent);
  EXPECT_EQ(options_of({"--use-decoupled-weight-decay=false"}).weight_decay_type(),
            shampoo::WeightDecayType::kL2);
  const auto traced = options_of({"--trace-scaling", "0.25"});
  EXPECT_TRUE(traced.use_trace_scaling());
  EXPECT_EQ(traced.trace_scaling_exponent(), 0.25);
  try {
    parse({"--use-decoupled-weight-decay=false", "--weight-decay-type", "corrected"});
    ADD_FAILURE() << "contradicting flags were accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("give one of them"), std::string::npos) << e.what();
  }
}

}  // namespace
