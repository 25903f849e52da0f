#include "examples/trainer_config.h"

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "examples/command_line.h"

namespace shampoo::examples {

namespace {

template <typename T>
using Names = std::vector<std::pair<std::string, T>>;

const Names<DatasetKind> kDatasets{{"cifar10", DatasetKind::kCifar10},
                                   {"fashion-mnist", DatasetKind::kFashionMnist},
                                   {"ptb", DatasetKind::kPtb}};
const Names<LrSchedule> kLrSchedules{{"constant", LrSchedule::kConstant},
                                     {"cosine", LrSchedule::kCosine}};
const Names<ProgressMode> kProgressModes{
    {"auto", ProgressMode::kAuto}, {"on", ProgressMode::kOn}, {"off", ProgressMode::kOff}};
const Names<DeviceChoice> kDeviceChoices{
    {"auto", DeviceChoice::kAuto}, {"cpu", DeviceChoice::kCpu}, {"cuda", DeviceChoice::kCuda}};
const Names<AmpMode> kAmpModes{
    {"off", AmpMode::kOff}, {"bf16", AmpMode::kBf16}, {"fp16", AmpMode::kFp16}};
const Names<ShardingMode> kShardingModes{{"none", ShardingMode::kNone},
                                         {"state", ShardingMode::kState},
                                         {"gradients", ShardingMode::kGradients},
                                         {"full", ShardingMode::kFull},
                                         {"hybrid", ShardingMode::kHybrid}};
const Names<OptimizerKind> kOptimizers{{"sgd", OptimizerKind::kSgd},
                                       {"adam", OptimizerKind::kAdam},
                                       {"adamw", OptimizerKind::kAdamW},
                                       {"shampoo", OptimizerKind::kShampoo}};
const Names<GraftingKind> kGraftings{{"none", GraftingKind::kNone},
                                     {"sgd", GraftingKind::kSgd},
                                     {"adagrad", GraftingKind::kAdaGrad},
                                     {"rmsprop", GraftingKind::kRmsProp},
                                     {"adam", GraftingKind::kAdam}};
const Names<CompactChoice> kCompactChoices{
    {"none", CompactChoice::kNone}, {"bf16", CompactChoice::kBf16}, {"int8", CompactChoice::kInt8}};
const Names<WeightDecayChoice> kWeightDecayTypes{{"l2", WeightDecayChoice::kL2},
                                                 {"decoupled", WeightDecayChoice::kDecoupled},
                                                 {"corrected", WeightDecayChoice::kCorrected},
                                                 {"independent", WeightDecayChoice::kIndependent}};
const Names<c10::ScalarType> kFactorDtypes{{"fp32", c10::ScalarType::Float},
                                           {"fp64", c10::ScalarType::Double}};
const Names<c10::ScalarType> kCommunicationDtypes{{"fp32", c10::ScalarType::Float},
                                                  {"bf16", c10::ScalarType::BFloat16},
                                                  {"fp16", c10::ScalarType::Half}};

template <typename T>
std::string name_of(const Names<T>& names, T value) {
  for (const auto& [name, v] : names) {
    if (v == value) return name;
  }
  return "?";
}

/// Flags whose values are converted after parsing: the defaults of TrainerConfig, as text.
struct FlagValues {
  int64_t seed = 0;
  std::vector<double> betas;
  bool no_merge_groups = false;
};

constexpr const char* kSummary =
    "Trains an image classifier on CIFAR-10 (or Fashion-MNIST), or a word-level LSTM language\n"
    "model on the Penn Treebank (--dataset ptb), with SGD, Adam, AdamW or\n"
    "Distributed Shampoo, in one process or data-parallel under\n"
    "  torchrun --no-python --standalone --nproc-per-node N cifar10_trainer [flags]\n"
    "(each rank trains on its slice of every global batch; gradients are averaged across ranks).\n"
    "Prints the local losses of every rank, the global losses on rank 0, and the test accuracy\n"
    "after every epoch (the language model: the validation perplexity).";

void add_data_and_model_flags(CommandLine& cli, TrainerConfig& config) {
  cli.add_choice("dataset", config.dataset, kDatasets,
                 "data set: cifar10 (the official binary files data_batch_1.bin ... "
                 "data_batch_5.bin, test_batch.bin), fashion-mnist (IDX files, .gz or plain) or "
                 "ptb (the Penn Treebank, Mikolov's preprocessed 10k-word version: ptb.train.txt, "
                 "ptb.valid.txt, ptb.test.txt; for --model lm)")
      .add("data-dir", config.data_dir,
           "folder with the data set's files (none: data/cifar-10-batches-bin for cifar10, "
           "/usr/share/datasets/fashion-mnist for fashion-mnist, " +
               default_data_dir(DatasetKind::kPtb).string() +
               " for ptb, where scripts/install_deps.sh writes it)")
      .add("limit-train", config.limit_train,
           "train on the first this many training examples (ptb: sequences of --bptt + 1 "
           "tokens, the first N x bptt tokens of the corpus) (0 = all)",
           0)
      .add_choice("model", config.model, {"convnet", "resnet", "smallcnn", "autoencoder", "lm"},
                  "convnet: the reference's ConvNet (conv 3x3 to 64 channels, no bias, ReLU, "
                  "linear to 10 classes); resnet: ResNet-8 (CIFAR ResNet, one basic block per "
                  "stage, batch norm); smallcnn: two conv + max-pool layers and a linear layer; "
                  "autoencoder: the deep autoencoder (pixels-1000-500-250-30, mirrored, sigmoid "
                  "units) trained to reconstruct its input (loss: binary cross-entropy of the "
                  "pixels in [0, 1], summed over an image; no test accuracy); lm: the word-level "
                  "language model of --dataset ptb (its default there): tied embedding [V, "
                  "--lm-dim], a 1-layer LSTM, LayerNorm, loss the mean token cross-entropy, "
                  "metric the validation perplexity")
      .add("bptt", config.bptt,
           "--model lm: tokens per training sequence (the LSTM starts each from a zero state)", 1)
      .add("lm-dim", config.lm_dim, "--model lm: embedding width and LSTM hidden size", 1)
      .add("lm-dropout", config.lm_dropout,
           "--model lm: dropout after the embedding and before the output projection, in [0, 1) "
           "(0 = none)",
           0.0);
}

/// Where and how precisely the run computes, and what it shards across ranks.
void add_device_and_sharding_flags(CommandLine& cli, TrainerConfig& config) {
  cli.add_choice("device", config.device, kDeviceChoices,
                 "where the model, the data and the optimizer live: cuda (GPU LOCAL_RANK of "
                 "this node under torchrun, GPU 0 otherwise; collectives of CUDA tensors over "
                 "NCCL), cpu (collectives over Gloo), or auto = cuda when a CUDA device is "
                 "available, else cpu")
      .add_choice("amp", config.amp, kAmpModes,
                  "mixed precision: the forward pass under autocast (shampoo::AutocastGuard) in "
                  "bf16, or in fp16 with a shampoo::GradScaler (loss scaling, steps with an inf "
                  "or NaN gradient skipped on every rank); parameters, gradients and optimizer "
                  "state stay float32; off = float32 throughout")
      .add_choice("sharding", config.sharding, kShardingModes,
                  "what is sharded across ranks: none; state (state sharding, ZeRO-1: sgd/adam/"
                  "adamw run as shampoo::ShardedOptimizer, each parameter's state on the rank "
                  "that steps it, gradients all-reduced; shampoo's Distributor shards its blocks' "
                  "state in every mode, so for it this equals none); gradients (gradient "
                  "sharding, ZeRO-2: state sharding, and each gradient is reduced to the rank "
                  "that steps its parameter and released on the others; shampoo owns whole "
                  "parameters); or full (ZeRO-3, shampoo::FullyShardedDataParallel: every "
                  "parameter split by rows across the ranks and gathered per layer for forward "
                  "and backward, each whole parameter stepped by one owner during backward); or "
                  "hybrid (full sharding within shard groups of --shard-group-size ranks, "
                  "replicated across them: each gradient reduced within its shard group, then "
                  "all-reduced across the groups)")
      .add("shard-group-size", config.shard_group_size,
           "--sharding hybrid: ranks per shard group, consecutive ranks (a divisor of the number "
           "of ranks); 0 = the ranks of a node (torchrun's LOCAL_WORLD_SIZE)",
           0);
}

void add_training_loop_flags(CommandLine& cli, TrainerConfig& config, FlagValues& values) {
  cli.add("epochs", config.epochs, "passes over the training set", 1)
      .add("stop-after-epoch", config.stop_after_epoch,
           "end this run after that epoch as if interrupted (the lr schedule still spans "
           "--epochs); with --checkpoint-dir, the same command without this flag resumes (0 = "
           "run all epochs)",
           0)
      .add("stop-after-iteration", config.stop_after_iteration,
           "end this run after that iteration (counted from the start of training) as if "
           "interrupted, saving a checkpoint there with --checkpoint-dir (0 = run all epochs)",
           0)
      .add("local-batch-size", config.local_batch_size,
           "examples per rank per iteration (global batch = this x number of ranks), unless "
           "--global-batch-size is given",
           1)
      .add("micro-batches", config.micro_batches,
           "split each rank's batch into this many equal micro-batches and accumulate their "
           "gradients (each loss divided by it: the gradient of the whole batch's mean), one "
           "optimizer step per batch; it must divide the local batch",
           1)
      .add("save-params", config.save_params,
           "after training, rank 0 writes the model's parameters by name to this file "
           "(torch::jit::pickle_save of a dict name -> tensor; examples/param_distance compares "
           "two) "
           "(none: not written)")
      .add("global-batch-size", config.global_batch_size,
           "examples per iteration over all ranks; every rank takes this / number of ranks, which "
           "must divide it. Keeps the batches when a run resumes at another number of ranks "
           "(0 = --local-batch-size x number of ranks)",
           0)
      .add("seed", values.seed, "seed of the weight initialization and of the shuffling", 0)
      .add("window-size", config.window_size, "iterations averaged in the window loss", 1)
      .add("log-every", config.log_every,
           "print the loss lines every this many iterations (and at the end of each epoch)", 1)
      .add_choice("lr-schedule", config.lr_schedule, kLrSchedules,
                  "constant, or cosine annealing of every group's lr to 0 over the whole run "
                  "(per iteration)")
      .add("eval-batch-size", config.eval_batch_size,
           "examples per forward pass when evaluating on the test set (ptb: sequences of the "
           "validation set, default 64)",
           1)
      .add("threads", config.threads,
           "intra-op CPU threads per rank (0 = LibTorch's default, one per core; 1 avoids "
           "oversubscription when several ranks share the cores)",
           0)
      .add_choice("progress", config.progress, kProgressModes,
                  "progress bar with rate and ETA on rank 0 (stderr); auto = only when stderr "
                  "is a terminal")
      .add("checkpoint-dir", config.checkpoint_dir,
           "save the model, the optimizer and the trainer's state here after every epoch (one "
           "checkpoint that every rank writes together, loadable at any number of ranks; on a "
           "filesystem every node sees), and resume from it at start (none: no checkpoints)")
      .add("checkpoint-every", config.checkpoint_every,
           "with --checkpoint-dir, also save every this many iterations within an epoch (0 = "
           "after every epoch only)",
           0)
      .add("metrics-dir", config.metrics_dir,
           "write train.csv (losses of every iteration) and eval.csv (test loss and accuracy of "
           "every epoch) here on rank 0; plot them with examples/plot_metrics.py (none: no "
           "files)");
}

void add_optimizer_flags(CommandLine& cli, TrainerConfig& config, FlagValues& values) {
  cli.add_choice("optimizer", config.optimizer, kOptimizers,
                 "sgd, adam, adamw (torch::optim, on gradients averaged across ranks) or shampoo "
                 "(shampoo::DistributedShampoo, blocks distributed across ranks)")
      .add("lr", config.lr, "learning rate", 0.0)
      .add_list("lrs", config.lrs,
                "comma-separated learning rates, e.g. 0.1,0.05: every parameter gets a param "
                "group of its own and the rates are assigned to the parameters round-robin in "
                "model order (overrides --lr; none: one group)",
                std::nullopt, "", 0.0)
      .add_list("betas", values.betas,
                "beta1,beta2: Adam's moment coefficients; for Shampoo beta1 filters the gradient "
                "and beta2 the Kronecker factors",
                2, "beta1,beta2")
      .add("beta3", config.beta3,
           "Shampoo: filter coefficient of the gradient in the step (-1 = beta1)")
      .add("epsilon", config.epsilon, "Adam's epsilon; Shampoo's epsilon added to the factors")
      .add("weight-decay", config.weight_decay, "weight decay")
      .add("bias-weight-decay", config.bias_weight_decay,
           "weight decay of 1-D parameters (biases, batch-norm scales and shifts); gives every "
           "parameter a group of its own",
           "--weight-decay")
      .add("momentum", config.momentum, "momentum (sgd, shampoo)")
      .add("dampening", config.dampening, "dampening of the momentum (sgd, shampoo)")
      .add_bool("use-nesterov", config.use_nesterov, "Nesterov momentum (sgd, shampoo)")
      .add_bool("use-decoupled-weight-decay", config.use_decoupled_weight_decay,
                "shampoo: decoupled (AdamW-style) weight decay; false: L2 added to the gradient "
                "(= --weight-decay-type l2). adam always uses L2, adamw always decoupled")
      .add_choice("weight-decay-type", config.weight_decay_type, kWeightDecayTypes,
                  "shampoo: where weight decay enters: l2 (added to the gradient), decoupled "
                  "(AdamW's), corrected (decoupled x lr / peak lr, the reference's CORRECTED: "
                  "follows the schedule), independent (decoupled / peak lr); the peak lr is --lr");
}

void add_shampoo_flags(CommandLine& cli, TrainerConfig& config, FlagValues& values) {
  cli.add("max-preconditioner-dim", config.max_preconditioner_dim,
          "shampoo: largest block size along any dim; larger dims are split into blocks")
      .add("precondition-frequency", config.precondition_frequency,
           "shampoo: recompute the inverse roots every this many steps")
      .add("start-preconditioning-step", config.start_preconditioning_step,
           "shampoo: first step that preconditions; before it the grafting method runs alone "
           "(-1 = --precondition-frequency)")
      .add_choice("grafting", config.grafting, kGraftings,
                  "shampoo: grafting method, whose per-block step size the Shampoo direction "
                  "takes")
      .add("grafting-beta2", config.grafting_beta2, "shampoo: beta2 of rmsprop and adam grafting")
      .add("grafting-epsilon", config.grafting_epsilon,
           "shampoo: epsilon of adagrad, rmsprop and adam grafting")
      .add_bool("use-bias-correction", config.use_bias_correction,
                "shampoo: bias-correct the filtered gradient and factors")
      .add_bool("use-merge-dims", config.use_merge_dims,
                "shampoo: merge small trailing dims while their product stays <= "
                "--max-preconditioner-dim")
      .add_bool("precondition-1d", config.precondition_1d,
                "shampoo: Kronecker factors for 1-D parameters (biases, norm scales); false: "
                "they take the grafting update")
      .add_bool("factored-grafting", config.factored_grafting,
                "shampoo: the grafting second moment of 2-D blocks with a Kronecker factor as row "
                "and column sums (false: exact, the reference's)")
      .add("max-factored-dim", config.max_factored_dim,
           "shampoo: a parameter dim larger than this keeps no Kronecker factor (-1 = no limit)")
      .add("trace-scaling", config.trace_scaling,
           "shampoo: scale each Kronecker factor by its trace^-x before its root, x in (0, 1] "
           "(the reference's use_trace_scaling and trace_scaling_exponent; 0 = off)")
      .add("relative-epsilon", config.relative_epsilon,
           "shampoo: factors regularized with --epsilon + this x their trace (0 = --epsilon "
           "alone; for fp32 factors, whose rounding it damps)")
      .add_choice("factor-dtype", config.factor_dtype, kFactorDtypes,
                  "shampoo: dtype of the Kronecker factors and their inverse roots (fp32: the "
                  "reference's)")
      .add_choice("compact-state", config.compact_state, kCompactChoices,
                  "shampoo: keep the inverse roots (bf16 or int8) and the first-order state "
                  "(bf16, stochastic rounding) compact; changes the results")
      .add_choice("communication-dtype", config.communication_dtype, kCommunicationDtypes,
                  "shampoo: dtype of the one AllGather per step")
      .add("num-trainers-per-group", config.num_trainers_per_group,
           "shampoo: ranks that share the blocks of one model copy (-1 = all ranks)")
      .add_bool("communicate-params", config.communicate_params,
                "shampoo: AllGather the updated parameters instead of the updates")
      .add_bool("no-merge-groups", values.no_merge_groups,
                "shampoo: keep every param group as a group of its own instead of merging groups "
                "that differ only in float hyperparameters into virtual groups");
}

constexpr int64_t kTextEvalBatchSize = 64;

/// The language model goes with the text corpus and the image models with the images: --model
/// defaults to lm for ptb, and a model that cannot read the data set is an error, as are the
/// language model's flags without it.
void check_model_and_dataset(const CommandLine& cli, TrainerConfig& config) {
  const bool text = is_text(config.dataset);
  if (text && !cli.was_set("model")) config.model = "lm";
  // A sequence's logits are [T, V] floats (1.4 MB for PTB): 64 sequences per forward pass.
  if (text && !cli.was_set("eval-batch-size")) config.eval_batch_size = kTextEvalBatchSize;
  if (text != (config.model == "lm")) {
    throw std::invalid_argument(
        "--model: got " + config.model + " with --dataset " + dataset_name(config.dataset) +
        (text ? "; a text corpus needs --model lm"
              : "; --model lm needs a text corpus (--dataset ptb), the images need convnet, "
                "resnet, smallcnn or autoencoder"));
  }
  if (config.lm_dropout >= 1) {
    std::ostringstream value;
    value << config.lm_dropout;
    throw std::invalid_argument("--lm-dropout: got " + value.str() +
                                ", expected a probability in [0, 1)");
  }
  if (!text) {
    for (const char* flag : {"bptt", "lm-dim", "lm-dropout"}) {
      if (cli.was_set(flag)) {
        throw std::invalid_argument(std::string("--") + flag + ": given with --model " +
                                    config.model + "; it sets the language model (--model lm)");
      }
    }
  }
}

}  // namespace

std::string optimizer_name(OptimizerKind kind) { return name_of(kOptimizers, kind); }

std::string grafting_name(GraftingKind kind) { return name_of(kGraftings, kind); }

std::string device_choice_name(DeviceChoice choice) { return name_of(kDeviceChoices, choice); }

std::string amp_name(AmpMode mode) { return name_of(kAmpModes, mode); }

std::string sharding_name(ShardingMode mode) { return name_of(kShardingModes, mode); }

std::optional<TrainerConfig> parse_trainer_config(int argc, const char* const* argv) {
  TrainerConfig config;
  FlagValues values{
      static_cast<int64_t>(config.seed), {config.beta1, config.beta2}, !config.merge_groups};
  // The flags are bound to the config; their defaults are TrainerConfig's initializers. Range
  // checks of the trainer's own flags happen here; the optimizers check theirs (TORCH_CHECK
  // naming the option) when they are built.
  CommandLine cli("cifar10_trainer", kSummary);
  add_data_and_model_flags(cli, config);
  add_training_loop_flags(cli, config, values);
  add_device_and_sharding_flags(cli, config);
  add_optimizer_flags(cli, config, values);
  add_shampoo_flags(cli, config, values);
  if (!cli.parse(argc, argv)) return std::nullopt;

  if (config.data_dir.empty()) config.data_dir = default_data_dir(config.dataset);
  check_model_and_dataset(cli, config);
  config.seed = static_cast<uint64_t>(values.seed);
  config.beta1 = values.betas[0];
  config.beta2 = values.betas[1];
  config.merge_groups = !values.no_merge_groups;
  config.local_batch_size_given = cli.was_set("local-batch-size");
  if (!config.use_decoupled_weight_decay) {
    if (cli.was_set("weight-decay-type") && config.weight_decay_type != WeightDecayChoice::kL2) {
      throw std::invalid_argument(
          "--use-decoupled-weight-decay false says L2 weight decay, --weight-decay-type says " +
          name_of(kWeightDecayTypes, config.weight_decay_type) + "; give one of them");
    }
    config.weight_decay_type = WeightDecayChoice::kL2;
  }
  if (config.checkpoint_every > 0 && config.checkpoint_dir.empty()) {
    throw std::invalid_argument("--checkpoint-every: got " +
                                std::to_string(config.checkpoint_every) +
                                " without --checkpoint-dir (where would the checkpoints go?)");
  }
  if (config.fully_sharded() && config.amp == AmpMode::kFp16) {
    throw std::invalid_argument(
        "--sharding " + sharding_name(config.sharding) +
        ": --amp fp16 needs a GradScaler, which the trainer's full sharding (the step overlapped "
        "in backward) does not support; use --amp bf16 (no scaler needed) or --amp off");
  }
  if (cli.was_set("shard-group-size") && config.sharding != ShardingMode::kHybrid) {
    throw std::invalid_argument(
        "--shard-group-size: got " + std::to_string(config.shard_group_size) + " with --sharding " +
        sharding_name(config.sharding) + "; it sets the shard groups of --sharding hybrid");
  }
  config.command_line = quoted_command_line(argc, argv);
  return config;
}

namespace {

/// --micro-batches must split the local batch evenly (equal micro-batches, so that dividing each
/// micro-batch's mean loss by their number gives the batch's mean).
BatchSizes check_micro_batches(const TrainerConfig& config, BatchSizes sizes,
                               const std::string& ranks) {
  if (sizes.local % config.micro_batches != 0) {
    throw std::invalid_argument("--micro-batches: got " + std::to_string(config.micro_batches) +
                                ", which does not divide the local batch of " +
                                std::to_string(sizes.local) + " at " + ranks +
                                "; choose a divisor of " + std::to_string(sizes.local));
  }
  return sizes;
}

}  // namespace

BatchSizes resolve_batch_sizes(const TrainerConfig& config, int64_t world_size) {
  const auto ranks = std::to_string(world_size) + (world_size == 1 ? " rank" : " ranks");
  if (config.global_batch_size == 0) {
    return check_micro_batches(
        config, BatchSizes{config.local_batch_size * world_size, config.local_batch_size}, ranks);
  }
  const int64_t global = config.global_batch_size;
  if (global % world_size != 0) {
    throw std::invalid_argument("--global-batch-size: got " + std::to_string(global) + ", which " +
                                ranks + " (WORLD_SIZE) cannot share evenly; choose a multiple of " +
                                std::to_string(world_size) +
                                ", or a number of ranks that divides " + std::to_string(global));
  }
  const int64_t local = global / world_size;
  if (config.local_batch_size_given && config.local_batch_size != local) {
    throw std::invalid_argument("--local-batch-size " + std::to_string(config.local_batch_size) +
                                " and " + "--global-batch-size " + std::to_string(global) +
                                " disagree at " + ranks + " (" + std::to_string(global) + " / " +
                                std::to_string(world_size) + " = " + std::to_string(local) +
                                " per rank); give only --global-batch-size");
  }
  return check_micro_batches(config, BatchSizes{global, local}, ranks);
}

}  // namespace shampoo::examples
