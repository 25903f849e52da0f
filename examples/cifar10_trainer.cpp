/// Image classification trainer: the reference's CIFAR-10 examples (facebookresearch/optimizers,
/// distributed_shampoo/examples: default_cifar10_example.py, ddp_cifar10_example.py) in LibTorch.
///
///   cifar10_trainer --optimizer shampoo --data-dir data/cifar-10-batches-bin [flags]
///   torchrun --no-python --standalone --nproc-per-node 2 cifar10_trainer [flags]
///
/// One process, or data-parallel under torchrun: every rank builds the same model (and the
/// GradientSynchronizer copies rank 0's weights to all), reads its slice of every global batch,
/// averages gradients with the GradientSynchronizer and steps a torch::optim optimizer, or
/// DistributedShampoo, whose blocks are owned by ranks and shared with one AllGather per step.
/// `--help` lists the flags; examples/README.md shows runs.

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/nn/functional/loss.h>
#include <torch/utils.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "examples/cosine_annealing_lr.h"
#include "examples/distributed_batch_sampler.h"
#include "examples/image_dataset.h"
#include "examples/loss_metrics.h"
#include "examples/metrics_csv.h"
#include "examples/models.h"
#include "examples/progress_bar.h"
#include "examples/trainer_config.h"
#include "examples/trainer_optimizer.h"
#include "examples/training_checkpoint.h"
#include "shampoo/shampoo.h"

namespace {

using namespace shampoo::examples;

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string format(const char* pattern, auto... args) {
  char text[512];
  std::snprintf(text, sizeof(text), pattern, args...);
  return text;
}

/// Rank and world size, and the process group when launched by torchrun (WORLD_SIZE set).
struct Distributed {
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  int rank = 0;
  int world_size = 1;
};

Distributed join_process_group() {
  Distributed d;
  if (std::getenv("WORLD_SIZE") == nullptr) return d;
  d.group = shampoo::init_process_group_from_env();
  d.rank = d.group->getRank();
  d.world_size = d.group->getSize();
  return d;
}

/// Averages the floating-point buffers (batch-norm running statistics) over the ranks: each rank
/// normalized its own batches, so their running statistics differ slightly.
void average_buffers(torch::nn::Module& model, const Distributed& d) {
  if (!d.group || d.world_size == 1) return;
  torch::NoGradGuard no_grad;
  for (auto& buffer : model.buffers()) {
    if (!buffer.is_floating_point()) continue;
    std::vector<at::Tensor> tensors{buffer};
    d.group->allreduce(tensors)->wait();
    buffer.div_(d.world_size);
  }
}

struct Evaluation {
  double loss = 0;
  double accuracy = 0;
};

/// Test loss and accuracy: every rank evaluates its contiguous share of the test set and the
/// sums are all-reduced.
Evaluation evaluate(ImageClassifier& model, const ImageDataset& data, int64_t batch_size,
                    const Distributed& d) {
  torch::NoGradGuard no_grad;
  model.eval();
  const int64_t n = data.test.size();
  const int64_t begin = n * d.rank / d.world_size;
  const int64_t end = n * (d.rank + 1) / d.world_size;
  double loss_sum = 0;
  double correct = 0;
  for (int64_t b = begin; b < end; b += batch_size) {
    const int64_t e = std::min(b + batch_size, end);
    const auto logits = model.forward(data.normalize(data.test.images.slice(0, b, e)));
    const auto labels = data.test.labels.slice(0, b, e);
    loss_sum +=
        torch::nn::functional::cross_entropy(
            logits, labels, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum))
            .item<double>();
    correct += static_cast<double>(logits.argmax(1).eq(labels).sum().item<int64_t>());
  }
  if (d.group && d.world_size > 1) {
    std::vector<at::Tensor> sums{at::tensor({loss_sum, correct}, at::kDouble)};
    d.group->allreduce(sums)->wait();
    loss_sum = sums[0][0].item<double>();
    correct = sums[0][1].item<double>();
  }
  model.train();
  const double count = static_cast<double>(std::max<int64_t>(n, 1));
  return Evaluation{loss_sum / count, correct / count};
}

std::string run_signature(const TrainerConfig& config, int world_size, int64_t train_examples) {
  return "dataset=" + dataset_name(config.dataset) + " model=" + config.model +
         " optimizer=" + optimizer_name(config.optimizer) +
         " world_size=" + std::to_string(world_size) +
         " local_batch_size=" + std::to_string(config.local_batch_size) +
         " train_examples=" + std::to_string(train_examples) +
         " seed=" + std::to_string(config.seed);
}

/// LibTorch's CPU allocator takes every tensor from malloc. glibc serves blocks above its mmap
/// threshold (adaptive, up to 32 MiB) with fresh pages from mmap and unmaps them on free, so
/// every large activation is page-faulted in again: measured 1.5 million page faults and 3x the
/// time for evaluating Fashion-MNIST in batches of 128, and 25% slower training steps. Keeping
/// large blocks on the heap (and the heap from being trimmed) reuses the pages.
void keep_large_allocations_on_the_heap() {
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
#endif
}

int run(int argc, const char* const* argv) {
  keep_large_allocations_on_the_heap();
  const auto config_or_help = parse_trainer_config(argc, argv);
  if (!config_or_help) return 0;
  const TrainerConfig& config = *config_or_help;
  const auto run_start = Clock::now();
  if (config.threads > 0) at::set_num_threads(static_cast<int>(config.threads));

  const Distributed d = join_process_group();
  const bool lead = d.rank == 0;
  const std::string rank_prefix =
      d.world_size > 1 ? "[rank " + std::to_string(d.rank) + "] " : std::string();
  const bool show_progress =
      lead && (config.progress == ProgressMode::kOn ||
               (config.progress == ProgressMode::kAuto && ProgressBar::is_terminal(stderr)));
  ProgressBar progress_bar(stderr, show_progress);
  auto print = [&](const std::string& line) { progress_bar.print_line(line); };
  auto print_lead = [&](const std::string& line) {
    if (lead) print(line);
  };

  // Data: every rank holds the (uint8) data set and reads its slices of the global batches.
  ImageDataset data = load_image_dataset(config.dataset, config.data_dir);
  const int64_t full_train_size = data.train.size();
  if (config.limit_train > 0 && config.limit_train < data.train.size()) {
    data.train.images = data.train.images.slice(0, 0, config.limit_train);
    data.train.labels = data.train.labels.slice(0, 0, config.limit_train);
  }
  const DistributedBatchSampler sampler(data.train.size(), config.local_batch_size, d.world_size,
                                        d.rank, config.seed);

  print_lead(config.command_line);
  print_lead(format("Data: %s from %s: %" PRId64 " training examples (of %" PRId64 "), %" PRId64
                    " test examples, %" PRId64 "x%" PRId64 "x%" PRId64,
                    dataset_name(config.dataset).c_str(), config.data_dir.c_str(),
                    data.train.size(), full_train_size, data.test.size(), data.channels(),
                    data.height(), data.width()));

  // Model: the same seed on every rank (the synchronizer also broadcasts rank 0's weights).
  torch::manual_seed(config.seed);
  const auto model = make_image_classifier(config.model, data.channels(), data.num_classes,
                                           data.height(), data.width());
  int64_t num_parameters = 0;
  for (const auto& p : model->parameters()) num_parameters += p.numel();

  // Resume: the model is loaded before the synchronizer and optimizer take its parameters.
  std::optional<CheckpointDir> checkpoints;
  int64_t resume_epoch = 0;
  if (!config.checkpoint_dir.empty()) {
    checkpoints.emplace(config.checkpoint_dir, d.group,
                        run_signature(config, d.world_size, data.train.size()));
    resume_epoch = checkpoints->find_resume_epoch();
    if (resume_epoch > 0) checkpoints->load_model(resume_epoch, *model);
  }

  std::unique_ptr<shampoo::GradientSynchronizer> synchronizer;
  if (d.group && d.world_size > 1) {
    synchronizer = std::make_unique<shampoo::GradientSynchronizer>(model->parameters(), d.group);
  }
  const auto plans = plan_param_groups(model->named_parameters(), config);
  const auto optimizer = make_optimizer(config, plans, d.group);
  const int64_t total_iterations = sampler.batches_per_epoch() * config.epochs;
  std::unique_ptr<CosineAnnealingLr> scheduler;
  if (config.lr_schedule == LrSchedule::kCosine) {
    // Made before a checkpoint is loaded: its base rates are the configured ones.
    scheduler = std::make_unique<CosineAnnealingLr>(*optimizer, total_iterations);
  }

  LossMetrics metrics(config.window_size);
  TrainingProgress progress;
  if (resume_epoch > 0) {
    progress = checkpoints->load_training_state(resume_epoch, *optimizer, metrics);
    if (scheduler) scheduler->resume(progress.iteration);
  }

  print_lead(format("Model: %s, %" PRId64 " parameters | ranks: %d | global batch %" PRId64
                    " (%" PRId64 " per rank), %" PRId64 " iterations per epoch | %d thread(s) "
                    "per rank",
                    config.model.c_str(), num_parameters, d.world_size, sampler.global_batch_size(),
                    config.local_batch_size, sampler.batches_per_epoch(), at::get_num_threads()));
  std::string optimizer_line = "Optimizer: " + optimizer_name(config.optimizer) + ", " +
                               std::to_string(plans.size()) + " param group(s)";
  if (const auto* shampoo_optimizer =
          dynamic_cast<const shampoo::DistributedShampoo*>(optimizer.get())) {
    const auto stats = shampoo_optimizer->stats();
    optimizer_line += format(" -> %" PRId64 " virtual group(s), %" PRId64 " blocks (%" PRId64
                             " owned by rank 0), grafting %s",
                             stats.virtual_groups, stats.total_blocks, stats.owned_blocks,
                             grafting_name(config.grafting).c_str());
  }
  print_lead(optimizer_line);
  std::string groups = describe_param_groups(plans);
  if (!groups.empty() && groups.back() == '\n') groups.pop_back();
  print_lead(groups);
  if (resume_epoch > 0) {
    print_lead(format("Resumed from %s: %" PRId64 " epoch(s), %" PRId64 " iterations done",
                      checkpoints->file(resume_epoch).c_str(), progress.epoch, progress.iteration));
  }

  std::optional<MetricsCsv> csv;
  if (lead && !config.metrics_dir.empty()) {
    csv.emplace(config.metrics_dir, resume_epoch, progress.iteration);
  }

  Evaluation evaluation;
  bool evaluated = false;
  const int64_t last_epoch = config.stop_after_epoch > 0
                                 ? std::min(config.stop_after_epoch, config.epochs)
                                 : config.epochs;
  for (int64_t epoch = progress.epoch + 1; epoch <= last_epoch; ++epoch) {
    const auto epoch_start = Clock::now();
    const auto order = sampler.epoch_order(epoch);
    progress_bar.start(format("epoch %" PRId64 "/%" PRId64, epoch, config.epochs),
                       sampler.batches_per_epoch());
    model->train();
    IterationLosses global;
    for (int64_t batch = 0; batch < sampler.batches_per_epoch(); ++batch) {
      const auto index = sampler.local_batch(order, batch);
      const auto images = data.normalize(data.train.images.index_select(0, index));
      const auto labels = data.train.labels.index_select(0, index);

      optimizer->zero_grad();
      const auto loss = torch::nn::functional::cross_entropy(model->forward(images), labels);
      loss.backward();
      if (synchronizer) synchronizer->synchronize();
      optimizer->step();
      if (scheduler) scheduler->step();

      metrics.update(loss.item<double>());
      ++progress.iteration;
      const IterationLosses local = metrics.local();
      global = metrics.global(d.group);
      if (csv) {
        csv->add_iteration(epoch, progress.iteration, local, global,
                           optimizer->param_groups()[0].options().get_lr());
      }
      progress_bar.update(batch + 1, format("loss %.4f", global.window_loss));
      const bool last_batch = batch + 1 == sampler.batches_per_epoch();
      if (progress.iteration % config.log_every == 0 || last_batch) {
        print(rank_prefix + format("Epoch: %" PRId64 " | Iteration: %" PRId64
                                   " | Local Lifetime Loss: %.6f | Local Window Loss: %.6f",
                                   epoch, progress.iteration, local.lifetime_loss,
                                   local.window_loss));
        if (d.world_size > 1) {
          print_lead(format("Epoch: %" PRId64 " | Iteration: %" PRId64
                            " | Global Lifetime Loss: %.6f | Global Window Loss: %.6f",
                            epoch, progress.iteration, global.lifetime_loss, global.window_loss));
        }
      }
    }
    progress_bar.finish();
    const double train_seconds = seconds_since(epoch_start);

    average_buffers(*model, d);
    evaluation = evaluate(*model, data, config.eval_batch_size, d);
    evaluated = true;
    progress.epoch = epoch;
    const double epoch_seconds = seconds_since(epoch_start);
    print_lead(format("Epoch: %" PRId64 " | Test Loss: %.4f | Test Accuracy: %.4f | Global "
                      "Lifetime Loss: %.4f | Time: %.1f s (train %.1f s, %.1f it/s)",
                      epoch, evaluation.loss, evaluation.accuracy, global.lifetime_loss,
                      epoch_seconds, train_seconds,
                      static_cast<double>(sampler.batches_per_epoch()) / train_seconds));
    if (csv) {
      csv->add_epoch(epoch, progress.iteration, evaluation.loss, evaluation.accuracy,
                     global.lifetime_loss, epoch_seconds);
    }
    if (checkpoints) checkpoints->save(progress, *model, *optimizer, metrics);
  }
  if (last_epoch < config.epochs && progress.epoch == last_epoch) {
    print_lead(format("Stopped after epoch %" PRId64 " of %" PRId64 " (--stop-after-epoch)",
                      last_epoch, config.epochs));
  }

  if (!evaluated) {
    print_lead(format("Nothing to train: the checkpoint has %" PRId64 " epoch(s), last epoch of "
                      "this run %" PRId64,
                      progress.epoch, last_epoch));
    evaluation = evaluate(*model, data, config.eval_batch_size, d);
  }
  if (const auto* shampoo_optimizer =
          dynamic_cast<const shampoo::DistributedShampoo*>(optimizer.get())) {
    const auto stats = shampoo_optimizer->stats();
    print_lead(format("Shampoo on rank 0: %" PRId64 " amortized root computations (%" PRId64
                      " failed), %" PRId64 " collective(s) per step",
                      stats.amortized_computations, stats.failed_amortized_computations,
                      stats.collectives_last_step));
  }
  if (csv) {
    print_lead("Metrics: " + csv->train_path().string() + ", " + csv->eval_path().string());
  }
  print_lead(format("Total time: %.1f s", seconds_since(run_start)));
  print_lead(format("Final test accuracy: %.4f", evaluation.accuracy));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::invalid_argument& e) {
    std::cerr << "cifar10_trainer: " << e.what() << " (see --help)\n";
    return 2;
  } catch (const c10::Error& e) {
    std::cerr << "cifar10_trainer: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "cifar10_trainer: " << e.what() << "\n";
    return 1;
  }
}
