#include "examples/trainer_config.h"

#include <stdexcept>

#include "examples/command_line.h"

namespace shampoo::examples {

namespace {

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(message);
}

OptimizerKind parse_optimizer(const std::string& name) {
  if (name == "sgd") return OptimizerKind::kSgd;
  if (name == "adam") return OptimizerKind::kAdam;
  if (name == "adamw") return OptimizerKind::kAdamW;
  return OptimizerKind::kShampoo;  // the parser admits only the four choices
}

GraftingKind parse_grafting(const std::string& name) {
  if (name == "none") return GraftingKind::kNone;
  if (name == "sgd") return GraftingKind::kSgd;
  if (name == "adagrad") return GraftingKind::kAdaGrad;
  if (name == "rmsprop") return GraftingKind::kRmsProp;
  return GraftingKind::kAdam;
}

c10::ScalarType parse_communication_dtype(const std::string& name) {
  if (name == "bf16") return c10::ScalarType::BFloat16;
  if (name == "fp16") return c10::ScalarType::Half;
  return c10::ScalarType::Float;
}

std::string quote_if_needed(const std::string& arg) {
  if (!arg.empty() && arg.find_first_of(" \t'\"$\\") == std::string::npos) return arg;
  std::string quoted = "'";
  for (const char c : arg) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

}  // namespace

std::string optimizer_name(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSgd:
      return "sgd";
    case OptimizerKind::kAdam:
      return "adam";
    case OptimizerKind::kAdamW:
      return "adamw";
    case OptimizerKind::kShampoo:
      return "shampoo";
  }
  return "?";
}

std::string grafting_name(GraftingKind kind) {
  switch (kind) {
    case GraftingKind::kNone:
      return "none";
    case GraftingKind::kSgd:
      return "sgd";
    case GraftingKind::kAdaGrad:
      return "adagrad";
    case GraftingKind::kRmsProp:
      return "rmsprop";
    case GraftingKind::kAdam:
      return "adam";
  }
  return "?";
}

std::optional<TrainerConfig> parse_trainer_config(int argc, const char* const* argv) {
  CommandLine cli(
      "cifar10_trainer",
      "Trains an image classifier on CIFAR-10 (or Fashion-MNIST) with SGD, Adam, AdamW or\n"
      "Distributed Shampoo, in one process or data-parallel under\n"
      "  torchrun --no-python --standalone --nproc-per-node N cifar10_trainer [flags]\n"
      "(each rank trains on its slice of every global batch; gradients are averaged across "
      "ranks).\n"
      "Prints the local losses of every rank, the global losses on rank 0, and the test accuracy\n"
      "after every epoch.");
  // Data and model.
  cli.add_choice("dataset", {"cifar10", "fashion-mnist"}, "cifar10",
                 "data set: cifar10 (the official binary files data_batch_1.bin ... "
                 "data_batch_5.bin, test_batch.bin) or fashion-mnist (IDX files, .gz or plain)")
      .add("data-dir", "",
           "folder with the data set's files (none: data/cifar-10-batches-bin for cifar10, "
           "/usr/share/datasets/fashion-mnist for fashion-mnist)")
      .add("limit-train", "0", "train on the first this many training examples (0 = all)")
      .add_choice("model", {"convnet", "resnet", "smallcnn"}, "convnet",
                  "convnet: the reference's ConvNet (conv 3x3 to 64 channels, no bias, ReLU, "
                  "linear to 10 classes); resnet: ResNet-8 (CIFAR ResNet, one basic block per "
                  "stage, batch norm); smallcnn: two conv + max-pool layers and a linear layer");
  // Training loop.
  cli.add("epochs", "1", "passes over the training set")
      .add("stop-after-epoch", "0",
           "end this run after that epoch as if interrupted (the lr schedule still spans "
           "--epochs); with --checkpoint-dir, the same command without this flag resumes (0 = "
           "run all epochs)")
      .add("local-batch-size", "128",
           "examples per rank per iteration (global batch = this x number of ranks)")
      .add("seed", "2022", "seed of the weight initialization and of the shuffling")
      .add("window-size", "1", "iterations averaged in the window loss")
      .add("log-every", "1",
           "print the loss lines every this many iterations (and at the end of each epoch)")
      .add_choice("lr-schedule", {"constant", "cosine"}, "constant",
                  "constant, or cosine annealing of every group's lr to 0 over the whole run "
                  "(per iteration)")
      .add("eval-batch-size", "500", "examples per forward pass when evaluating on the test set")
      .add("threads", "1",
           "intra-op CPU threads per rank (0 = LibTorch's default, one per core; 1 avoids "
           "oversubscription when several ranks share the cores)")
      .add_choice("progress", {"auto", "on", "off"}, "auto",
                  "progress bar with rate and ETA on rank 0 (stderr); auto = only when stderr "
                  "is a terminal")
      .add("checkpoint-dir", "",
           "save model, optimizer and trainer state of every rank here after every epoch, and "
           "resume from the latest checkpoint found there (none: no checkpoints)")
      .add("metrics-dir", "",
           "write train.csv (losses of every iteration) and eval.csv (test loss and accuracy of "
           "every epoch) here on rank 0; plot them with examples/plot_metrics.py (none: no "
           "files)");
  // Optimizers.
  cli.add_choice("optimizer", {"sgd", "adam", "adamw", "shampoo"}, "shampoo",
                 "sgd, adam, adamw (torch::optim, on gradients averaged across ranks) or shampoo "
                 "(shampoo::DistributedShampoo, blocks distributed across ranks)")
      .add("lr", "1e-3", "learning rate")
      .add("lrs", "",
           "comma-separated learning rates, e.g. 0.1,0.05: every parameter gets a param group of "
           "its own and the rates are assigned to the parameters round-robin in model order "
           "(overrides --lr; none: one group)")
      .add("betas", "0.9,0.999",
           "beta1,beta2: Adam's moment coefficients; for Shampoo beta1 filters the gradient and "
           "beta2 the Kronecker factors")
      .add("beta3", "-1", "Shampoo: filter coefficient of the gradient in the step (-1 = beta1)")
      .add("epsilon", "1e-12", "Adam's epsilon; Shampoo's epsilon added to the factors")
      .add("weight-decay", "0", "weight decay")
      .add("bias-weight-decay", "",
           "weight decay of 1-D parameters (biases, batch-norm scales and shifts); gives every "
           "parameter a group of its own (none: --weight-decay)")
      .add("momentum", "0", "momentum (sgd, shampoo)")
      .add("dampening", "0", "dampening of the momentum (sgd, shampoo)")
      .add_bool("use-nesterov", false, "Nesterov momentum (sgd, shampoo)")
      .add_bool("use-decoupled-weight-decay", true,
                "shampoo: decoupled (AdamW-style) weight decay; false: L2 added to the gradient. "
                "adam always uses L2, adamw always decoupled");
  cli.add("max-preconditioner-dim", "1024",
          "shampoo: largest block size along any dim; larger dims are split into blocks")
      .add("precondition-frequency", "50",
           "shampoo: recompute the inverse roots every this many steps")
      .add("start-preconditioning-step", "-1",
           "shampoo: first step that preconditions; before it the grafting method runs alone "
           "(-1 = --precondition-frequency)")
      .add_choice("grafting", {"none", "sgd", "adagrad", "rmsprop", "adam"}, "adam",
                  "shampoo: grafting method, whose per-block step size the Shampoo direction "
                  "takes")
      .add("grafting-beta2", "0.999", "shampoo: beta2 of rmsprop and adam grafting")
      .add("grafting-epsilon", "1e-8", "shampoo: epsilon of adagrad, rmsprop and adam grafting")
      .add_bool("use-bias-correction", true,
                "shampoo: bias-correct the filtered gradient and factors")
      .add_bool("use-merge-dims", true,
                "shampoo: merge small trailing dims while their product stays <= "
                "--max-preconditioner-dim")
      .add_choice("communication-dtype", {"fp32", "bf16", "fp16"}, "fp32",
                  "shampoo: dtype of the one AllGather per step")
      .add("num-trainers-per-group", "-1",
           "shampoo: ranks that share the blocks of one model copy (-1 = all ranks)")
      .add_bool("communicate-params", false,
                "shampoo: AllGather the updated parameters instead of the updates")
      .add_bool("no-merge-groups", false,
                "shampoo: keep every param group as a group of its own instead of merging groups "
                "that differ only in float hyperparameters into virtual groups");
  if (!cli.parse(argc, argv)) return std::nullopt;

  TrainerConfig config;
  config.dataset = parse_dataset_kind(cli.get_string("dataset"));
  config.data_dir = cli.get_string("data-dir").empty()
                        ? default_data_dir(config.dataset)
                        : std::filesystem::path(cli.get_string("data-dir"));
  config.limit_train = cli.get_int("limit-train");
  config.model = cli.get_string("model");
  config.epochs = cli.get_int("epochs");
  config.stop_after_epoch = cli.get_int("stop-after-epoch");
  config.local_batch_size = cli.get_int("local-batch-size");
  const int64_t seed = cli.get_int("seed");
  config.window_size = cli.get_int("window-size");
  config.log_every = cli.get_int("log-every");
  config.lr_schedule =
      cli.get_string("lr-schedule") == "cosine" ? LrSchedule::kCosine : LrSchedule::kConstant;
  config.eval_batch_size = cli.get_int("eval-batch-size");
  config.threads = cli.get_int("threads");
  const std::string& progress = cli.get_string("progress");
  config.progress = progress == "on"    ? ProgressMode::kOn
                    : progress == "off" ? ProgressMode::kOff
                                        : ProgressMode::kAuto;
  config.checkpoint_dir = cli.get_string("checkpoint-dir");
  config.metrics_dir = cli.get_string("metrics-dir");

  config.optimizer = parse_optimizer(cli.get_string("optimizer"));
  config.lr = cli.get_double("lr");
  config.lrs = cli.get_doubles("lrs");
  const auto betas = cli.get_doubles("betas");
  require(betas.size() == 2,
          "--betas: got '" + cli.get_string("betas") + "', expected two numbers beta1,beta2");
  config.beta1 = betas[0];
  config.beta2 = betas[1];
  config.beta3 = cli.get_double("beta3");
  config.epsilon = cli.get_double("epsilon");
  config.weight_decay = cli.get_double("weight-decay");
  if (!cli.get_string("bias-weight-decay").empty()) {
    config.bias_weight_decay = cli.get_double("bias-weight-decay");
  }
  config.momentum = cli.get_double("momentum");
  config.dampening = cli.get_double("dampening");
  config.use_nesterov = cli.get_bool("use-nesterov");
  config.use_decoupled_weight_decay = cli.get_bool("use-decoupled-weight-decay");
  config.max_preconditioner_dim = cli.get_int("max-preconditioner-dim");
  config.precondition_frequency = cli.get_int("precondition-frequency");
  config.start_preconditioning_step = cli.get_int("start-preconditioning-step");
  config.grafting = parse_grafting(cli.get_string("grafting"));
  config.grafting_beta2 = cli.get_double("grafting-beta2");
  config.grafting_epsilon = cli.get_double("grafting-epsilon");
  config.use_bias_correction = cli.get_bool("use-bias-correction");
  config.use_merge_dims = cli.get_bool("use-merge-dims");
  config.communication_dtype = parse_communication_dtype(cli.get_string("communication-dtype"));
  config.num_trainers_per_group = cli.get_int("num-trainers-per-group");
  config.communicate_params = cli.get_bool("communicate-params");
  config.merge_groups = !cli.get_bool("no-merge-groups");

  // Checks of the trainer's own flags; the optimizers check theirs (TORCH_CHECK naming the
  // option) when they are built.
  require(config.limit_train >= 0,
          "--limit-train: got " + std::to_string(config.limit_train) + ", expected >= 0");
  require(config.epochs >= 1, "--epochs: got " + std::to_string(config.epochs) + ", expected >= 1");
  require(config.stop_after_epoch >= 0,
          "--stop-after-epoch: got " + std::to_string(config.stop_after_epoch) + ", expected >= 0");
  require(config.local_batch_size >= 1,
          "--local-batch-size: got " + std::to_string(config.local_batch_size) + ", expected >= 1");
  require(seed >= 0, "--seed: got " + std::to_string(seed) + ", expected >= 0");
  config.seed = static_cast<uint64_t>(seed);
  require(config.window_size >= 1,
          "--window-size: got " + std::to_string(config.window_size) + ", expected >= 1");
  require(config.log_every >= 1,
          "--log-every: got " + std::to_string(config.log_every) + ", expected >= 1");
  require(config.eval_batch_size >= 1,
          "--eval-batch-size: got " + std::to_string(config.eval_batch_size) + ", expected >= 1");
  require(config.threads >= 0,
          "--threads: got " + std::to_string(config.threads) + ", expected >= 0");
  require(config.lr >= 0, "--lr: got " + cli.get_string("lr") + ", expected >= 0");
  for (const double lr : config.lrs) {
    require(lr >= 0, "--lrs: got " + cli.get_string("lrs") + ", expected rates >= 0");
  }

  for (int i = 0; i < argc; ++i) {
    if (i > 0) config.command_line += ' ';
    config.command_line += quote_if_needed(argv[i]);
  }
  return config;
}

}  // namespace shampoo::examples
