/// Demo: train a small CNN on the real Fashion-MNIST data set (Debian's dataset-fashion-mnist)
/// with shampoo::DistributedShampoo in one process, on the CPU.
///
/// The parameters are split into three param groups to show the API: convolution weights,
/// classifier weights (half the learning rate) and biases (no weight decay). They differ only in
/// float hyperparameters, so DistributedShampoo runs them as one virtual group. A cosine schedule
/// (a torch::optim::LRScheduler) anneals every group's lr to zero over the run.
///
///   fashion_mnist_demo [--epochs 5] [--batch-size 64] [--lr 2e-3] [--data-dir DIR] ...

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/nn/functional/loss.h>
#include <torch/utils.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "examples/command_line.h"
#include "examples/cosine_annealing_lr.h"
#include "examples/fashion_mnist.h"
#include "examples/models.h"
#include "shampoo/shampoo.h"

namespace {

using shampoo::examples::CosineAnnealingLr;
using shampoo::examples::FashionMnistSplit;
using shampoo::examples::LabeledImages;
using shampoo::examples::SmallCnn;

/// The classifier takes half the base learning rate (an example of per-layer learning rates).
constexpr double kClassifierLrScale = 0.5;
constexpr double kWeightDecay = 1e-4;
/// Amortized root inverses every this many steps: enough to track the Kronecker factors on this
/// small model while keeping the eigendecompositions a small share of the step time on a CPU.
constexpr int64_t kPreconditionFrequency = 50;
constexpr int64_t kEvalBatchSize = 1000;
/// Progress lines per epoch (besides the epoch summary).
constexpr int64_t kProgressLinesPerEpoch = 4;

struct DemoConfig {
  std::filesystem::path data_dir;
  int64_t epochs = 0;
  int64_t batch_size = 0;
  double lr = 0;
  uint64_t seed = 0;
  int64_t limit_train = 0;  // 0 = all
  // One thread by default: this model's tensors are too small for intra-op parallelism to pay
  // for OpenMP's synchronization, and on a busy machine its spinning threads cost 2-3x.
  int64_t threads = 1;  // 0 = LibTorch's default
};

/// Returns false when --help was asked for.
bool parse_config(int argc, const char* const* argv, DemoConfig& config) {
  shampoo::examples::CommandLine cli(
      "fashion_mnist_demo",
      "Trains a small CNN on Fashion-MNIST with Distributed Shampoo (one process, CPU).");
  cli.add("data-dir", std::string(shampoo::examples::kFashionMnistDefaultDir),
          "folder with the Fashion-MNIST IDX files (.gz or plain)")
      .add("epochs", "5", "passes over the training set")
      .add("batch-size", "64", "training examples per step")
      .add("lr", "2e-3", "base learning rate (the classifier uses half)")
      .add("seed", "0", "seed of the weight initialization and the shuffling")
      .add("limit-train", "0", "train on a random subset of this many examples (0 = all 60000)")
      .add("threads", "1", "intra-op CPU threads (0 = LibTorch's default: one per core)");
  if (!cli.parse(argc, argv)) return false;

  config.data_dir = cli.get_string("data-dir");
  config.epochs = cli.get_int("epochs");
  config.batch_size = cli.get_int("batch-size");
  config.lr = cli.get_double("lr");
  const int64_t seed = cli.get_int("seed");
  config.limit_train = cli.get_int("limit-train");
  config.threads = cli.get_int("threads");

  auto require = [](bool ok, const std::string& message) {
    if (!ok) throw std::invalid_argument(message);
  };
  require(config.epochs >= 1, "--epochs: got " + std::to_string(config.epochs) + ", expected >= 1");
  require(config.batch_size >= 1,
          "--batch-size: got " + std::to_string(config.batch_size) + ", expected >= 1");
  require(config.lr > 0, "--lr: got " + cli.get_string("lr") + ", expected > 0");
  require(seed >= 0, "--seed: got " + std::to_string(seed) + ", expected >= 0");
  require(config.limit_train >= 0,
          "--limit-train: got " + std::to_string(config.limit_train) + ", expected >= 0");
  require(config.threads >= 0,
          "--threads: got " + std::to_string(config.threads) + ", expected >= 0");
  config.seed = static_cast<uint64_t>(seed);
  return true;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

/// Conv weights, classifier weights and biases as three groups with their own ShampooOptions.
std::vector<torch::optim::OptimizerParamGroup> make_param_groups(
    SmallCnn& model, const shampoo::ShampooOptions& base) {
  std::vector<torch::Tensor> conv_weights;
  std::vector<torch::Tensor> classifier_weights;
  std::vector<torch::Tensor> biases;
  for (const auto& p : model->parameters()) {
    if (p.dim() == 1) {
      biases.push_back(p);
    } else if (p.dim() == 4) {
      conv_weights.push_back(p);
    } else {
      classifier_weights.push_back(p);
    }
  }
  auto options = [&](double lr, double weight_decay) {
    auto o = std::make_unique<shampoo::ShampooOptions>(base);
    o->lr(lr).weight_decay(weight_decay);
    return o;
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(conv_weights, options(base.lr(), kWeightDecay));
  groups.emplace_back(classifier_weights, options(base.lr() * kClassifierLrScale, kWeightDecay));
  groups.emplace_back(biases, options(base.lr(), 0.0));
  return groups;
}

/// Fraction of `data` that `model` classifies correctly.
double evaluate_accuracy(SmallCnn& model, const LabeledImages& data) {
  torch::NoGradGuard no_grad;
  model->eval();
  int64_t correct = 0;
  for (int64_t begin = 0; begin < data.size(); begin += kEvalBatchSize) {
    const int64_t end = std::min(begin + kEvalBatchSize, data.size());
    const auto predictions = model->forward(data.images.slice(0, begin, end)).argmax(1);
    correct += predictions.eq(data.labels.slice(0, begin, end)).sum().item<int64_t>();
  }
  return data.size() == 0 ? 0.0 : static_cast<double>(correct) / static_cast<double>(data.size());
}

/// One pass over `data` in a fresh random order; returns the mean training loss.
double train_one_epoch(SmallCnn& model, torch::optim::Optimizer& optimizer,
                       torch::optim::LRScheduler& scheduler, const LabeledImages& data,
                       int64_t batch_size, int64_t epoch,
                       std::chrono::steady_clock::time_point epoch_start) {
  model->train();
  const int64_t n = data.size();
  const int64_t steps = (n + batch_size - 1) / batch_size;
  const int64_t progress_every =
      std::max<int64_t>(1, (steps + kProgressLinesPerEpoch) / (kProgressLinesPerEpoch + 1));
  const auto order = torch::randperm(n, torch::kLong);

  double loss_sum = 0;         // over the epoch, weighted by batch size
  double window_loss_sum = 0;  // since the last progress line
  int64_t window_examples = 0;
  for (int64_t step = 0; step < steps; ++step) {
    const auto index = order.slice(0, step * batch_size, std::min((step + 1) * batch_size, n));
    const auto images = data.images.index_select(0, index);
    const auto labels = data.labels.index_select(0, index);

    optimizer.zero_grad();
    const auto loss = torch::nn::functional::cross_entropy(model->forward(images), labels);
    loss.backward();
    optimizer.step();
    scheduler.step();

    const double batch_loss = loss.item<double>() * static_cast<double>(index.size(0));
    loss_sum += batch_loss;
    window_loss_sum += batch_loss;
    window_examples += index.size(0);
    if ((step + 1) % progress_every == 0 && step + 1 < steps) {
      std::printf("  epoch %" PRId64 " | step %" PRId64 "/%" PRId64 " | train loss %.4f | %.1f s\n",
                  epoch, step + 1, steps, window_loss_sum / static_cast<double>(window_examples),
                  seconds_since(epoch_start));
      std::fflush(stdout);
      window_loss_sum = 0;
      window_examples = 0;
    }
  }
  return loss_sum / static_cast<double>(n);
}

int run(int argc, const char* const* argv) {
  DemoConfig config;
  if (!parse_config(argc, argv, config)) return 0;
  const auto run_start = std::chrono::steady_clock::now();

  if (config.threads > 0) at::set_num_threads(static_cast<int>(config.threads));
  torch::manual_seed(config.seed);

  LabeledImages train =
      shampoo::examples::load_fashion_mnist(config.data_dir, FashionMnistSplit::kTrain);
  const LabeledImages test =
      shampoo::examples::load_fashion_mnist(config.data_dir, FashionMnistSplit::kTest);
  const int64_t full_train_size = train.size();
  if (config.limit_train > 0 && config.limit_train < train.size()) {
    const auto subset = torch::randperm(train.size(), torch::kLong).slice(0, 0, config.limit_train);
    train.images = train.images.index_select(0, subset);
    train.labels = train.labels.index_select(0, subset);
  }
  std::printf("Fashion-MNIST from %s: %" PRId64 " training examples (of %" PRId64 "), %" PRId64
              " test examples\n",
              config.data_dir.c_str(), train.size(), full_train_size, test.size());

  SmallCnn model(/*in_channels=*/1, shampoo::examples::kFashionMnistClasses, /*image_size=*/28);
  int64_t num_parameters = 0;
  for (const auto& p : model->parameters()) num_parameters += p.numel();

  const auto base = shampoo::ShampooOptions(config.lr)
                        .betas({0.9, 0.999})
                        .epsilon(1e-12)
                        .weight_decay_type(shampoo::WeightDecayType::kDecoupled)
                        .grafting(shampoo::AdamGraftingConfig{/*beta2=*/0.999, /*epsilon=*/1e-8})
                        .precondition_frequency(kPreconditionFrequency)
                        .start_preconditioning_step(kPreconditionFrequency)
                        .max_preconditioner_dim(1024);
  shampoo::DistributedShampoo optimizer(make_param_groups(model, base), base);
  const int64_t steps_per_epoch = (train.size() + config.batch_size - 1) / config.batch_size;
  CosineAnnealingLr scheduler(optimizer, steps_per_epoch * config.epochs);

  const auto stats = optimizer.stats();
  std::printf("Model: SmallCnn, %" PRId64 " parameters | Shampoo: %zu param groups -> %" PRId64
              " virtual group(s), %" PRId64 " blocks | batch %" PRId64
              ", lr %g (cosine), %d thread(s)\n",
              num_parameters, optimizer.param_groups().size(), stats.virtual_groups,
              stats.total_blocks, config.batch_size, config.lr, at::get_num_threads());
  std::fflush(stdout);

  double accuracy = 0;
  for (int64_t epoch = 1; epoch <= config.epochs; ++epoch) {
    const auto epoch_start = std::chrono::steady_clock::now();
    const double train_loss =
        train_one_epoch(model, optimizer, scheduler, train, config.batch_size, epoch, epoch_start);
    accuracy = evaluate_accuracy(model, test);
    std::printf("Epoch %" PRId64 " | train loss %.4f | test accuracy %.4f | time %.1f s\n", epoch,
                train_loss, accuracy, seconds_since(epoch_start));
    std::fflush(stdout);
  }

  const auto final_stats = optimizer.stats();
  std::printf("Shampoo: %" PRId64 " amortized root computations (%" PRId64 " failed)\n",
              final_stats.amortized_computations, final_stats.failed_amortized_computations);
  std::printf("Total time: %.1f s\n", seconds_since(run_start));
  std::printf("Final test accuracy: %.4f\n", accuracy);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::invalid_argument& e) {
    std::cerr << "fashion_mnist_demo: " << e.what() << " (see --help)\n";
    return 2;
  } catch (const c10::Error& e) {
    std::cerr << "fashion_mnist_demo: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "fashion_mnist_demo: " << e.what() << "\n";
    return 1;
  }
}
