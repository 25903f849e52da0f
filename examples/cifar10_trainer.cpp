/// Image classification trainer: the reference's CIFAR-10 examples (facebookresearch/optimizers,
/// distributed_shampoo/examples: default_cifar10_example.py, ddp_cifar10_example.py) in LibTorch;
/// also trains a word-level LSTM language model on the Penn Treebank (--dataset ptb --model lm).
///
///   cifar10_trainer --optimizer shampoo --data-dir data/cifar-10-batches-bin [flags]
///   torchrun --no-python --standalone --nproc-per-node 2 cifar10_trainer [flags]
///
/// On --device (auto: CUDA when present; one GPU per rank, GPU LOCAL_RANK of the node).
/// One process, or data-parallel under torchrun: every rank builds the same model (and the
/// GradientSynchronizer copies rank 0's weights to all), reads its slice of every global batch,
/// averages gradients with the GradientSynchronizer and steps a torch::optim optimizer, or
/// DistributedShampoo, whose blocks are owned by ranks and shared with one AllGather per step.
/// `--help` lists the flags; examples/README.md shows runs.

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/nn/functional/loss.h>
#include <torch/utils.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <vector>

#include "examples/cosine_annealing_lr.h"
#include "examples/distributed_batch_sampler.h"
#include "examples/image_dataset.h"
#include "examples/language_model.h"
#include "examples/loss_metrics.h"
#include "examples/metrics_csv.h"
#include "examples/models.h"
#include "examples/parameter_file.h"
#include "examples/progress_bar.h"
#include "examples/text_corpus.h"
#include "examples/trainer_config.h"
#include "examples/trainer_device.h"
#include "examples/trainer_optimizer.h"
#include "examples/training_checkpoint.h"
#include "shampoo/shampoo.h"

namespace {

using namespace shampoo::examples;

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
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
  double loss = 0;      // the language model: mean token cross-entropy (nats per token)
  double accuracy = 0;  // NaN for a model that reconstructs (no classes) and the language model
};

/// --dataset ptb as the trainer reads it: the training stream cut into sequences of bptt + 1
/// tokens (examples/text_corpus.h), and the validation stream, which evaluation reads whole.
struct TextData {
  int64_t vocabulary_size = 0;
  int64_t bptt = 0;
  at::Tensor train;          // int64 [sequences, bptt + 1]
  at::Tensor valid;          // int64 [tokens]
  int64_t train_tokens = 0;  // of the whole training stream

  void move_to(c10::Device device) {
    train = train.to(device);
    valid = valid.to(device);
  }
};

/// What the trainer trains on: images, or (--dataset ptb) a text corpus.
struct TrainingData {
  ImageDataset images;  // empty for a text corpus
  TextData text;        // empty for images
  bool is_text = false;
  int64_t full_train_size = 0;  // examples (sequences) before --limit-train

  int64_t train_size() const { return is_text ? text.train.size(0) : images.train.size(); }
  void move_to(c10::Device device) {
    if (is_text) {
      text.move_to(device);
    } else {
      images.move_to(device);
    }
  }
};

/// A batch's model input and what its output is trained against (labels, the input itself for
/// the autoencoder, the next tokens for the language model).
struct Batch {
  at::Tensor input;
  at::Tensor target;
};

/// The model's input for a batch of uint8 images: normalized per channel for the classifiers,
/// the pixel intensities in [0, 1] for the autoencoder (also its target).
at::Tensor model_input(const TrainerModel& model, const ImageDataset& data,
                       const at::Tensor& images) {
  return model.reconstructs() ? images.to(at::kFloat).div_(255.0) : data.normalize(images);
}

/// The loss of a batch, summed over it (`sum`) or its mean: the cross-entropy of the labels; for
/// a model that reconstructs, the binary cross-entropy of the pixels (targets: `input`) summed
/// over each image; for the language model, the cross-entropy of every next token (`labels`:
/// [N, T]), summed over the tokens or their mean.
at::Tensor batch_loss(const TrainerModel& model, const at::Tensor& output, const at::Tensor& input,
                      const at::Tensor& labels, bool sum) {
  namespace F = torch::nn::functional;
  if (model.objective() == Objective::kNextToken) {
    auto options = F::CrossEntropyFuncOptions();
    if (sum) {
      options.reduction(torch::kSum);
    } else {
      options.reduction(torch::kMean);
    }
    return F::cross_entropy(output.to(at::kFloat).flatten(0, 1), labels.flatten(), options);
  }
  if (model.reconstructs()) {
    const auto per_image = F::binary_cross_entropy_with_logits(
                               output.to(at::kFloat), input.flatten(1),
                               F::BinaryCrossEntropyWithLogitsFuncOptions().reduction(torch::kNone))
                               .sum(1);
    return sum ? per_image.sum() : per_image.mean();
  }
  auto options = F::CrossEntropyFuncOptions();
  if (sum) {
    options.reduction(torch::kSum);
  } else {
    options.reduction(torch::kMean);
  }
  return F::cross_entropy(output, labels, options);
}

/// The autocast dtype of --amp (Float when off).
at::ScalarType amp_dtype(AmpMode mode) {
  switch (mode) {
    case AmpMode::kBf16:
      return at::kBFloat16;
    case AmpMode::kFp16:
      return at::kHalf;
    case AmpMode::kOff:
      return at::kFloat;
  }
  return at::kFloat;
}

/// The forward passes of --amp: under autocast on the run's device (a no-op guard when off).
shampoo::AutocastGuard autocast_for(const TrainerConfig& config, c10::Device device) {
  return shampoo::AutocastGuard(device.type(),
                                config.amp == AmpMode::kOff ? at::kBFloat16 : amp_dtype(config.amp),
                                config.amp != AmpMode::kOff);
}

/// The language model's validation loss: the mean cross-entropy of every token of the
/// validation stream after its first (perplexity = its exp). The stream is cut into sequences
/// as in training (each from a zero state), plus the shorter tail; every rank evaluates a
/// contiguous share of the sequences (the last rank also the tail) and the sums of the losses
/// and of the tokens are all-reduced.
Evaluation evaluate_text(TrainerModel& model,
                         const std::function<at::Tensor(const at::Tensor&)>& forward,
                         const TextData& text, int64_t batch_size, const Distributed& d) {
  const auto sequences = cut_into_sequences(text.valid, text.bptt);
  const auto tail = sequence_tail(text.valid, text.bptt);
  const int64_t n = sequences.size(0);
  const int64_t begin = n * d.rank / d.world_size;
  const int64_t end = n * (d.rank + 1) / d.world_size;
  double loss_sum = 0;
  double tokens = 0;
  auto add = [&](const at::Tensor& batch) {
    const auto input = batch.slice(1, 0, batch.size(1) - 1);
    const auto target = batch.slice(1, 1);
    loss_sum += batch_loss(model, forward(input), input, target, /*sum=*/true).item<double>();
    tokens += static_cast<double>(target.numel());
  };
  for (int64_t b = begin; b < end; b += batch_size) {
    add(sequences.slice(0, b, std::min(b + batch_size, end)));
  }
  if (d.rank == d.world_size - 1 && tail.numel() > 1) add(tail.unsqueeze(0));
  if (d.group && d.world_size > 1) {
    std::vector<at::Tensor> sums{at::tensor({loss_sum, tokens}, at::kDouble)};
    d.group->allreduce(sums)->wait();
    loss_sum = sums[0][0].item<double>();
    tokens = sums[0][1].item<double>();
  }
  return Evaluation{loss_sum / std::max(tokens, 1.0), std::numeric_limits<double>::quiet_NaN()};
}

/// Test loss and accuracy (none for the autoencoder), or the language model's validation loss:
/// every rank evaluates its contiguous share of the test set and the sums are all-reduced. With
/// --amp the forward passes run under autocast, as in training.
Evaluation evaluate(TrainerModel& model,
                    const std::function<at::Tensor(const at::Tensor&)>& forward,
                    const TrainingData& training_data, int64_t batch_size, const Distributed& d,
                    const TrainerConfig& config, c10::Device device) {
  torch::NoGradGuard no_grad;
  const auto autocast = autocast_for(config, device);
  model.eval();
  if (training_data.is_text) {
    const auto evaluation = evaluate_text(model, forward, training_data.text, batch_size, d);
    model.train();
    return evaluation;
  }
  const ImageDataset& data = training_data.images;
  const int64_t n = data.test.size();
  const int64_t begin = n * d.rank / d.world_size;
  const int64_t end = n * (d.rank + 1) / d.world_size;
  double loss_sum = 0;
  double correct = 0;
  for (int64_t b = begin; b < end; b += batch_size) {
    const int64_t e = std::min(b + batch_size, end);
    const auto input = model_input(model, data, data.test.images.slice(0, b, e));
    const auto logits = forward(input);
    const auto labels = data.test.labels.slice(0, b, e);
    loss_sum += batch_loss(model, logits, input, labels, /*sum=*/true).item<double>();
    if (!model.reconstructs()) {
      correct += static_cast<double>(logits.argmax(1).eq(labels).sum().item<int64_t>());
    }
  }
  if (d.group && d.world_size > 1) {
    std::vector<at::Tensor> sums{at::tensor({loss_sum, correct}, at::kDouble)};
    d.group->allreduce(sums)->wait();
    loss_sum = sums[0][0].item<double>();
    correct = sums[0][1].item<double>();
  }
  model.train();
  const double count = static_cast<double>(std::max<int64_t>(n, 1));
  return Evaluation{loss_sum / count, model.reconstructs()
                                          ? std::numeric_limits<double>::quiet_NaN()
                                          : correct / count};
}

/// What a checkpoint must agree on to be resumed: not the number of ranks, which may change.
RunSignature run_signature(const TrainerConfig& config, int64_t global_batch_size,
                           int64_t train_examples) {
  RunSignature signature{{"dataset", dataset_name(config.dataset)},
                         {"model", config.model},
                         {"optimizer", optimizer_name(config.optimizer)},
                         {"global_batch_size", std::to_string(global_batch_size)},
                         {"train_examples", std::to_string(train_examples)},
                         {"seed", std::to_string(config.seed)}};
  if (is_text(config.dataset)) {
    signature.emplace_back("bptt", std::to_string(config.bptt));
    signature.emplace_back("lm_dim", std::to_string(config.lm_dim));
  }
  return signature;
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

/// Log lines: every rank's (with a "[rank r] " prefix when there are several) or rank 0's,
/// printed through the progress bar so that it is not garbled.
class Log {
 public:
  Log(ProgressBar& bar, const Distributed& d)
      : bar_(bar),
        lead_(d.rank == 0),
        rank_prefix_(d.world_size > 1 ? fmt::format("[rank {}] ", d.rank) : "") {}
  void every_rank(const std::string& line) { bar_.print_line(rank_prefix_ + line); }
  void lead(const std::string& line) {
    if (lead_) bar_.print_line(line);
  }

 private:
  ProgressBar& bar_;
  bool lead_;
  std::string rank_prefix_;
};

ProgressBar make_progress_bar(const TrainerConfig& config, const Distributed& d) {
  const bool show =
      d.rank == 0 && (config.progress == ProgressMode::kOn ||
                      (config.progress == ProgressMode::kAuto && ProgressBar::is_terminal(stderr)));
  return ProgressBar(stderr, show);
}

/// Everything a training run holds, built in the order the steps below need it.
struct Trainer {
  Trainer(const TrainerConfig& config_, const Distributed& d_, c10::Device device_,
          TrainingData data_)
      : config(config_),
        d(d_),
        device(device_),
        progress_bar(make_progress_bar(config_, d_)),
        log(progress_bar, d_),
        data(std::move(data_)),
        batch(resolve_batch_sizes(config_, d_.world_size)),
        sampler(data.train_size(), batch.local, d_.world_size, d_.rank, config_.seed),
        metrics(config_.window_size) {}

  const TrainerConfig& config;
  Distributed d;
  c10::Device device;
  ProgressBar progress_bar;
  Log log;
  TrainingData data;
  BatchSizes batch;
  DistributedBatchSampler sampler;
  std::shared_ptr<TrainerModel> model;
  std::optional<TrainingCheckpoint> checkpoint;
  int64_t resumed_from_world_size = 0;  // 0: not resumed
  std::unique_ptr<shampoo::GradientSynchronizer> synchronizer;
  std::vector<ParamGroupPlan> plans;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::unique_ptr<shampoo::GradScaler> scaler;  // --amp fp16
  std::unique_ptr<CosineAnnealingLr> scheduler;
  // --sharding full: the fully sharded model (its optimizer() stands for `optimizer`).
  std::unique_ptr<shampoo::FullyShardedDataParallel> fsdp;
  bool whole_model_unit = false;  // the model has no units of its own: it is one
  int64_t num_parameters = 0;
  LossMetrics metrics;
  TrainingProgress progress;
  std::optional<MetricsCsv> csv;
};

/// Every rank holds the (uint8) data set, or the corpus, and reads its slices of the global
/// batches. --limit-train keeps the first training examples (sequences).
TrainingData load_data(const TrainerConfig& config) {
  TrainingData data;
  data.is_text = is_text(config.dataset);
  if (data.is_text) {
    const TextCorpus corpus = load_text_corpus(config.data_dir);
    data.text.vocabulary_size = corpus.vocabulary.size();
    data.text.bptt = config.bptt;
    data.text.train = cut_into_sequences(corpus.train, config.bptt);
    data.text.valid = corpus.valid;
    data.text.train_tokens = corpus.train.numel();
    data.full_train_size = data.text.train.size(0);
    if (config.limit_train > 0 && config.limit_train < data.full_train_size) {
      data.text.train = data.text.train.slice(0, 0, config.limit_train);
    }
    return data;
  }
  data.images = load_image_dataset(config.dataset, config.data_dir);
  ImageDataset& images = data.images;
  data.full_train_size = images.train.size();
  if (config.limit_train > 0 && config.limit_train < images.train.size()) {
    images.train.images = images.train.images.slice(0, 0, config.limit_train);
    images.train.labels = images.train.labels.slice(0, 0, config.limit_train);
  }
  return data;
}

/// Loads the checkpoint in --checkpoint-dir when there is one (collective).
void resume(Trainer& t) {
  const auto& config = t.config;
  t.checkpoint.emplace(
      config.checkpoint_dir, t.d.group,
      run_signature(config, t.batch.global, t.data.train_size()),
      TrainingCheckpoint::State{t.model.get(), t.fsdp ? &t.fsdp->optimizer() : t.optimizer.get(),
                                &t.metrics, &t.progress, t.scaler.get()},
      t.device);
  if (!t.checkpoint->exists()) return;
  t.resumed_from_world_size = t.checkpoint->load();
  // Where the next iteration is in its epoch: the epochs have the same batches at any number
  // of ranks (the same global batch size and training set, which the signature checks).
  const int64_t batches = t.sampler.batches_per_epoch();
  TORCH_CHECK(t.progress.iteration >= t.progress.epoch * batches &&
                  t.progress.iteration < (t.progress.epoch + 1) * batches,
              "--checkpoint-dir ", config.checkpoint_dir.string(), ": ", t.progress.epoch,
              " epoch(s) and ", t.progress.iteration, " iterations do not fit epochs of ", batches,
              " iterations");
  if (t.scheduler) t.scheduler->resume(t.progress.iteration);
}

/// Data parallelism: the synchronizer (sharding gradients with --sharding gradients), the
/// optimizer and its schedule.
void build_data_parallel(Trainer& t) {
  const auto& config = t.config;
  if (t.d.group && t.d.world_size > 1) {
    t.synchronizer =
        std::make_unique<shampoo::GradientSynchronizer>(t.model->parameters(), t.d.group);
  }
  t.optimizer = make_optimizer(config, t.plans, t.d.group);
  if (t.synchronizer && config.sharding == ShardingMode::kGradients) {
    // ZeRO-2: each gradient goes to the rank that steps its parameter.
    t.synchronizer->shard_gradients(*t.optimizer);
  }
  if (config.lr_schedule == LrSchedule::kCosine) {
    // Made before a checkpoint is loaded: its base rates are the configured ones.
    t.scheduler = std::make_unique<CosineAnnealingLr>(
        *t.optimizer, t.sampler.batches_per_epoch() * config.epochs);
  }
}

/// --sharding hybrid: the shard group size (--shard-group-size, or the ranks of a node), checked
/// against the number of ranks.
int64_t hybrid_shard_group_size(const TrainerConfig& config, int world) {
  int64_t size = config.shard_group_size;
  if (size == 0) {
    const char* local = std::getenv("LOCAL_WORLD_SIZE");
    size = local != nullptr && *local != '\0' ? std::atoll(local) : world;
  }
  if (size < 1 || world % size != 0) {
    throw std::invalid_argument(
        fmt::format("--shard-group-size: got {}{}, expected a divisor of the number of ranks "
                    "({}): shard groups of consecutive ranks, replicated across the rest",
                    size, config.shard_group_size == 0 ? " (LOCAL_WORLD_SIZE)" : "", world));
  }
  return size;
}

/// --sharding full: the model's units (or the whole model as one unit) sharded over the ranks,
/// with the plans as optimizer()'s param groups (each rank's one optimizer holds the parameters
/// it owns, in their groups), and one cosine schedule on optimizer(). --sharding hybrid: the same
/// within shard groups, replicated across them.
void build_fully_sharded(Trainer& t) {
  const auto& config = t.config;
  auto named = t.model->sharding_units();
  t.whole_model_unit = named.empty();
  if (named.empty()) named.emplace_back("model", t.model->parameters());
  std::vector<shampoo::ShardedUnit> units;
  for (auto& [name, params] : named) units.push_back({name, params});
  // This rank's share of the first param group, with that group's options (the other groups
  // join the optimizer with theirs).
  const shampoo::GroupOptimizerFactory factory = [&config](torch::optim::OptimizerParamGroup group) {
    ParamGroupPlan plan{{"parameter"}, group.params(), config.lr, config.weight_decay};
    auto optimizer = make_optimizer(config, {plan}, nullptr);
    if (group.has_options()) optimizer->param_groups()[0].set_options(group.options().clone());
    return optimizer;
  };
  // One process without torchrun: a group of one rank (the units are gathered from it alone).
  auto group = t.d.group ? t.d.group
                         : shampoo::detail::make_process_group(
                               c10::make_intrusive<c10d::HashStore>(), 0, 1,
                               shampoo::kDefaultProcessGroupTimeout, t.device.is_cuda());
  // --micro-batches: the reduced gradients of the micro-batches are summed, one step per batch.
  auto options = shampoo::FullyShardedOptions().accumulation_steps(config.micro_batches);
  if (config.sharding == ShardingMode::kHybrid) {
    const auto hybrid =
        shampoo::make_hybrid_groups(group, hybrid_shard_group_size(config, group->getSize()));
    group = hybrid.shard;
    options.replica_group(hybrid.replica);
  }
  t.fsdp = std::make_unique<shampoo::FullyShardedDataParallel>(
      units, make_param_groups(config, t.plans), factory, group, options);
  if (!t.whole_model_unit) {
    auto* fsdp = t.fsdp.get();
    t.model->set_unit_runner(
        [fsdp](const std::string& unit, const std::function<at::Tensor()>& forward) {
          return fsdp->forward(fsdp->unit_index(unit), forward);
        });
  }
  if (config.lr_schedule == LrSchedule::kCosine) {
    t.scheduler = std::make_unique<CosineAnnealingLr>(
        t.fsdp->optimizer(), t.sampler.batches_per_epoch() * config.epochs);
  }
}

/// Model, synchronizer or full sharding, optimizer, scheduler; resumes from the checkpoint.
void build_model_and_optimizer(Trainer& t) {
  const auto& config = t.config;
  // The same seed on every rank (the synchronizer also broadcasts rank 0's weights).
  torch::manual_seed(config.seed);
  if (t.data.is_text) {
    t.model = LstmLanguageModel(LanguageModelOptions{t.data.text.vocabulary_size, config.lm_dim,
                                                     config.lm_dropout})
                  .ptr();
  } else {
    const ImageDataset& images = t.data.images;
    t.model = make_image_classifier(config.model, images.channels(), images.num_classes,
                                    images.height(), images.width());
  }
  // Initialized on the CPU, then moved: the same initial weights on every device.
  t.model->to(t.device);
  for (const auto& p : t.model->parameters()) t.num_parameters += p.numel();
  t.plans = plan_param_groups(t.model->named_parameters(), config);
  if (config.fully_sharded()) {
    build_fully_sharded(t);
  } else {
    build_data_parallel(t);
  }
  if (config.amp == AmpMode::kFp16) {
    // fp16's narrow range needs loss scaling; bf16 has float32's exponent range and needs none.
    t.scaler = std::make_unique<shampoo::GradScaler>(
        shampoo::GradScalerOptions().process_group(t.d.group));
  }
  // The model's tensors are loaded in place, after the synchronizer and the optimizer took them.
  if (!config.checkpoint_dir.empty()) resume(t);
  if (t.d.rank == 0 && !config.metrics_dir.empty()) {
    t.csv.emplace(config.metrics_dir, t.progress.epoch, t.progress.iteration,
                  device_name(t.device));
  }
}

/// The model's forward: a model without units of its own runs as one fully sharded unit with
/// --sharding full (a model with units runs each through the fully sharded model itself).
at::Tensor model_forward(Trainer& t, const at::Tensor& input) {
  if (t.fsdp && t.whole_model_unit) {
    return t.fsdp->forward(0, [&] { return t.model->forward(input); });
  }
  return t.model->forward(input);
}

/// evaluate() with the trainer's forward; a fully sharded model is gathered whole for it.
Evaluation evaluate_model(Trainer& t) {
  if (t.fsdp) t.fsdp->gather_all();
  const auto evaluation = evaluate(
      *t.model, [&t](const at::Tensor& input) { return model_forward(t, input); }, t.data,
      t.config.eval_batch_size, t.d, t.config, t.device);
  if (t.fsdp) t.fsdp->release_all();
  return evaluation;
}

/// The learning rate of the first param group (for the metrics).
double current_lr(Trainer& t) {
  auto& optimizer = t.fsdp ? t.fsdp->optimizer() : *t.optimizer;
  return optimizer.param_groups()[0].options().get_lr();
}

/// The first output line: where this run trains.
std::string describe_device(DeviceChoice choice, c10::Device device, int world_size) {
  std::string line =
      fmt::format("Device: {} (--device {})", device_name(device), device_choice_name(choice));
  if (world_size > 1) {
    line += device.is_cuda() ? " | every rank on cuda:LOCAL_RANK, collectives over NCCL"
                             : " | every rank on the CPU, collectives over Gloo";
  }
  return line;
}

const shampoo::DistributedShampoo* as_shampoo(const torch::optim::Optimizer& optimizer) {
  return dynamic_cast<const shampoo::DistributedShampoo*>(&optimizer);
}

/// "Resumed from DIR: 1 epoch(s), 14 iterations done; saved at world size 2, now 1".
std::string describe_resume(const Trainer& t) {
  std::string line = fmt::format(
      "Resumed from {}: {} epoch(s), {} iterations done; saved at world size {}, now {}",
      t.checkpoint->dir().string(), t.progress.epoch, t.progress.iteration,
      t.resumed_from_world_size, t.d.world_size);
  // torchrun's count of the times it restarted this job's workers (elastic runs).
  const char* restarts = std::getenv("TORCHELASTIC_RESTART_COUNT");
  if (restarts != nullptr && std::string(restarts) != "0") {
    line += fmt::format(" (torchrun restart {})", restarts);
  }
  return line;
}

void print_setup(Trainer& t) {
  const auto& config = t.config;
  const int64_t num_parameters = t.num_parameters;
  t.log.lead(describe_device(config.device, t.device, t.d.world_size));
  t.log.lead(config.command_line);
  if (t.data.is_text) {
    const TextData& text = t.data.text;
    t.log.lead(fmt::format(
        "Data: {} from {}: {} training examples (of {}): sequences of {} tokens ({} inputs, the "
        "next {} targets) from {} training tokens; {} validation tokens; vocabulary {} words",
        dataset_name(config.dataset), config.data_dir.string(), t.data.train_size(),
        t.data.full_train_size, text.bptt + 1, text.bptt, text.bptt, text.train_tokens,
        text.valid.numel(), text.vocabulary_size));
  } else {
    const ImageDataset& images = t.data.images;
    t.log.lead(
        fmt::format("Data: {} from {}: {} training examples (of {}), {} test examples, "
                    "{}x{}x{}",
                    dataset_name(config.dataset), config.data_dir.string(), images.train.size(),
                    t.data.full_train_size, images.test.size(), images.channels(), images.height(),
                    images.width()));
  }
  t.log.lead(
      fmt::format("Model: {}, {} parameters | ranks: {} | global batch {} ({} per rank), "
                  "{} iterations per epoch | {} thread(s) per rank",
                  config.model, num_parameters, t.d.world_size, t.batch.global, t.batch.local,
                  t.sampler.batches_per_epoch(), at::get_num_threads()));
  std::string optimizer_line = fmt::format("Optimizer: {}, {} param group(s)",
                                           optimizer_name(config.optimizer), t.plans.size());
  if (const auto* shampoo_optimizer = t.optimizer ? as_shampoo(*t.optimizer) : nullptr) {
    const auto stats = shampoo_optimizer->stats();
    optimizer_line +=
        fmt::format(" -> {} virtual group(s), {} blocks ({} owned by rank 0), grafting {}",
                    stats.virtual_groups, stats.total_blocks, stats.owned_blocks,
                    grafting_name(config.grafting));
  }
  if (t.fsdp) {
    // One optimizer per rank over the parameters it owns (none on a rank that owns none).
    size_t owned = 0;
    std::string merged;
    for (auto* optimizer : t.fsdp->optimizers()) {
      for (const auto& group : optimizer->param_groups()) owned += group.params().size();
      if (const auto* rank_shampoo = dynamic_cast<const shampoo::DistributedShampoo*>(optimizer)) {
        merged = fmt::format(", {} virtual group(s)", rank_shampoo->stats().virtual_groups);
      }
    }
    optimizer_line += fmt::format(
        " -> one per rank over the parameters it owns (rank {}: {} parameter(s){}), stepped "
        "during backward",
        t.d.rank, owned, merged);
  }
  t.log.lead(optimizer_line);
  if (const auto* shampoo_optimizer = t.optimizer ? as_shampoo(*t.optimizer) : nullptr) {
    // What each parameter gets (shampoo/factor_choice.h): factors on which dims, or the grafting
    // update.
    std::string params = shampoo_optimizer->memory_summary().params_to_string();
    if (!params.empty() && params.back() == '\n') params.pop_back();
    t.log.lead("Shampoo per parameter:\n" + params);
  }
  t.log.lead(fmt::format(
      "Mixed precision: {} | sharding: {}",
      config.amp == AmpMode::kOff    ? "off (float32)"
      : config.amp == AmpMode::kBf16 ? "bf16 autocast"
                                     : "fp16 autocast with a GradScaler",
      t.fsdp && config.sharding == ShardingMode::kHybrid
          ? fmt::format("hybrid: full sharding within shard groups of {} rank(s), {} replica(s); "
                        "{} unit(s), each parameter's rows split over its shard group, each "
                        "whole parameter stepped by its owner there",
                        t.fsdp->process_group()->getSize(),
                        t.fsdp->options().replica_group()
                            ? t.fsdp->options().replica_group()->getSize()
                            : 1,
                        t.fsdp->num_units())
      : t.fsdp ? fmt::format("full (ZeRO-3): {} unit(s), each parameter's rows split over {} "
                             "rank(s), each whole parameter stepped by its owner",
                             t.fsdp->num_units(), t.d.world_size)
      : t.synchronizer && t.synchronizer->sharded()
          ? std::string("each gradient reduced to its owner (ZeRO-2)")
      : config.sharding != ShardingMode::kNone && t.d.world_size == 1
          ? std::string("none needed (one process)")
      : dynamic_cast<const shampoo::ShardedOptimizer*>(t.optimizer.get()) != nullptr
          ? std::string("state (ZeRO-1): each parameter's state on the rank that steps it, "
                        "gradients all-reduced")
      : config.sharding == ShardingMode::kState
          ? std::string("state (ZeRO-1): Shampoo's Distributor keeps each block's state on its "
                        "owner, gradients all-reduced")
          : std::string("off (gradients all-reduced)")));
  std::string groups = describe_param_groups(t.plans);
  if (!groups.empty() && groups.back() == '\n') groups.pop_back();
  t.log.lead(groups);
  if (t.resumed_from_world_size > 0) t.log.lead(describe_resume(t));
}

/// The training examples `index` (on the data's device) as the model's input and target.
Batch training_batch(const Trainer& t, const at::Tensor& index) {
  if (t.data.is_text) {
    const auto sequences = t.data.text.train.index_select(0, index);
    const int64_t length = sequences.size(1);
    return {sequences.slice(1, 0, length - 1), sequences.slice(1, 1, length)};
  }
  const ImageDataset& images = t.data.images;
  return {model_input(*t.model, images, images.train.images.index_select(0, index)),
          images.train.labels.index_select(0, index)};
}

/// One optimizer step on batch `batch` of the epoch's order; returns the local loss (the mean
/// over the rank's batch). With --micro-batches n the batch runs as n equal micro-batches, each
/// loss divided by n, so the accumulated gradient is the batch's mean; the synchronizer (or the
/// fully sharded model) communicates once, after the last.
double train_step(Trainer& t, const at::Tensor& order, int64_t batch) {
  const auto index = t.sampler.local_batch(order, batch);
  const int64_t micro_batches = t.config.micro_batches;
  if (t.optimizer) t.optimizer->zero_grad();
  double loss_sum = 0;
  const auto parts =
      micro_batches > 1 ? index.chunk(micro_batches) : std::vector<at::Tensor>{index};
  for (size_t m = 0; m < parts.size(); ++m) {
    const Batch b = training_batch(t, parts[m]);
    at::Tensor loss;
    {
      // The forward pass under --amp's autocast (the loss itself comes out in float32).
      const auto autocast = autocast_for(t.config, t.device);
      loss = batch_loss(*t.model, model_forward(t, b.input), b.input, b.target, /*sum=*/false);
    }
    const auto scaled = micro_batches > 1 ? loss / static_cast<double>(micro_batches) : loss;
    {
      // Only the last micro-batch's backward synchronizes the accumulated gradients.
      std::optional<shampoo::GradientSynchronizer::NoSync> no_sync;
      if (t.synchronizer && m + 1 < parts.size()) no_sync.emplace(*t.synchronizer);
      if (t.scaler) {
        t.scaler->scale(scaled).backward();
      } else {
        scaled.backward();
      }
    }
    loss_sum += loss.item<double>();
  }
  if (t.synchronizer) t.synchronizer->synchronize();
  if (t.fsdp) {
    t.fsdp->optimizer().step();  // the steps ran during backward, unit by unit
  } else if (t.scaler) {
    t.scaler->step(*t.optimizer);  // skipped on every rank when a gradient overflowed
    t.scaler->update();
  } else {
    t.optimizer->step();
  }
  if (t.scheduler) t.scheduler->step();
  return micro_batches > 1 ? loss_sum / static_cast<double>(micro_batches) : loss_sum;
}

/// The loss lines of an iteration: every rank's local losses, rank 0's global ones.
void log_losses(Trainer& t, int64_t epoch, const IterationLosses& local,
                const IterationLosses& global) {
  t.log.every_rank(fmt::format(
      "Epoch: {} | Iteration: {} | Local Lifetime Loss: {:.6f} | Local Window Loss: {:.6f}", epoch,
      t.progress.iteration, local.lifetime_loss, local.window_loss));
  if (t.d.world_size > 1) {
    t.log.lead(fmt::format(
        "Epoch: {} | Iteration: {} | Global Lifetime Loss: {:.6f} | Global Window Loss: {:.6f}",
        epoch, t.progress.iteration, global.lifetime_loss, global.window_loss));
  }
}

/// Whether --stop-after-iteration ends the run here.
bool stop_requested(const Trainer& t) {
  return t.config.stop_after_iteration > 0 && t.progress.iteration >= t.config.stop_after_iteration;
}

/// Saves a checkpoint (collective) when the run has --checkpoint-dir. Within an epoch every rank
/// still holds the batch-norm statistics of its own batches: the checkpoint takes their mean.
void save_checkpoint(Trainer& t, bool within_epoch) {
  if (!t.checkpoint) return;
  if (t.csv) t.csv->flush();  // the rows up to the checkpoint, for a run resumed from it
  const auto start = Clock::now();
  t.checkpoint->save(/*average_buffers=*/within_epoch);
  t.log.lead(fmt::format("Checkpoint saved in {}: {} epoch(s), {} iterations done ({:.2f} s)",
                         t.checkpoint->dir().string(), t.progress.epoch, t.progress.iteration,
                         seconds_since(start)));
}

/// The training iterations of one epoch, from where a checkpoint left it; returns the global
/// losses after its last one, or nullopt when --stop-after-iteration ended the run within it.
std::optional<IterationLosses> train_epoch(Trainer& t, int64_t epoch) {
  // Drawn on the CPU (the same order on every device), then one copy per epoch: the batches'
  // indices are sliced from it and the examples gathered on the device.
  const auto order = t.sampler.epoch_order(epoch).to(t.device);
  const int64_t batches = t.sampler.batches_per_epoch();
  const int64_t first_batch = t.progress.iteration - (epoch - 1) * batches;
  t.progress_bar.start(fmt::format("epoch {}/{}", epoch, t.config.epochs), batches);
  t.model->train();
  IterationLosses global;
  for (int64_t batch = first_batch; batch < batches; ++batch) {
    t.metrics.update(train_step(t, order, batch));
    ++t.progress.iteration;
    const IterationLosses local = t.metrics.local();
    global = t.metrics.global(t.d.group);
    if (t.csv) {
      t.csv->add_iteration(epoch, t.progress.iteration, local, global, current_lr(t));
    }
    t.progress_bar.update(batch + 1, fmt::format("loss {:.4f}", global.window_loss));
    const bool last = batch + 1 == batches;
    if (t.progress.iteration % t.config.log_every == 0 || last) {
      log_losses(t, epoch, local, global);
    }
    // The epoch's last iteration is checkpointed after the evaluation.
    if (last) continue;
    const bool stop = stop_requested(t);
    if (stop ||
        (t.config.checkpoint_every > 0 && t.progress.iteration % t.config.checkpoint_every == 0)) {
      save_checkpoint(t, /*within_epoch=*/true);
    }
    if (stop) {
      t.progress_bar.finish();
      return std::nullopt;
    }
  }
  t.progress_bar.finish();
  return global;
}

/// Trains the epochs of this run, evaluating and checkpointing after each; returns the last
/// evaluation (nullopt when no epoch ended in this run).
std::optional<Evaluation> train(Trainer& t, int64_t last_epoch) {
  std::optional<Evaluation> evaluation;
  for (int64_t epoch = t.progress.epoch + 1; epoch <= last_epoch && !stop_requested(t); ++epoch) {
    const auto epoch_start = Clock::now();
    const int64_t first_iteration = t.progress.iteration;
    const auto global = train_epoch(t, epoch);
    if (!global) break;
    const double train_seconds = seconds_since(epoch_start);
    average_buffers(*t.model, t.d);
    evaluation = evaluate_model(t);
    t.progress.epoch = epoch;
    const double epoch_seconds = seconds_since(epoch_start);
    const bool text = t.data.is_text;
    const auto accuracy =
        text ? fmt::format(" | Validation Perplexity: {:.2f}", std::exp(evaluation->loss))
        : t.model->reconstructs() ? std::string()
                                  : fmt::format(" | Test Accuracy: {:.4f}", evaluation->accuracy);
    t.log.lead(
        fmt::format("Epoch: {} | {} Loss: {:.4f}{} | Global "
                    "Lifetime Loss: {:.4f} | Time: {:.1f} s (train {:.1f} s, {:.1f} it/s)",
                    epoch, text ? "Validation" : "Test", evaluation->loss, accuracy,
                    global->lifetime_loss, epoch_seconds, train_seconds,
                    static_cast<double>(t.progress.iteration - first_iteration) / train_seconds));
    if (t.csv) {
      t.csv->add_epoch(epoch, t.progress.iteration, evaluation->loss, evaluation->accuracy,
                       global->lifetime_loss, epoch_seconds);
    }
    save_checkpoint(t, /*within_epoch=*/false);
  }
  return evaluation;
}

/// --save-params: rank 0 writes the model's parameters by name (collective with full sharding,
/// whose parameters every rank gathers whole first).
void save_parameters(Trainer& t) {
  if (t.config.save_params.empty()) return;
  if (t.fsdp) t.fsdp->gather_all();
  if (t.d.rank == 0) {
    NamedTensors params;
    for (const auto& item : t.model->named_parameters()) {
      params.emplace_back(item.key(), item.value());
    }
    write_parameter_file(t.config.save_params, params);
    t.log.lead(
        fmt::format("Parameters: {} ({} tensors)", t.config.save_params.string(), params.size()));
  }
  if (t.fsdp) t.fsdp->release_all();
}

void print_summary(Trainer& t, const Evaluation& evaluation, Clock::time_point run_start) {
  if (const auto* shampoo_optimizer = t.optimizer ? as_shampoo(*t.optimizer) : nullptr) {
    const auto stats = shampoo_optimizer->stats();
    t.log.lead(
        fmt::format("Shampoo on rank 0: {} amortized root computations ({} failed), {} "
                    "collective(s) per step",
                    stats.amortized_computations, stats.failed_amortized_computations,
                    stats.collectives_last_step));
    t.log.lead("Shampoo state on rank 0: " + shampoo_optimizer->memory_summary().to_line());
  }
  if (t.scaler) {
    t.log.lead(fmt::format("GradScaler: scale {:g}, {} step(s) skipped for inf/NaN gradients",
                           t.scaler->get_scale(), t.scaler->skipped_steps()));
  }
  if (t.csv) {
    t.log.lead(
        fmt::format("Metrics: {}, {}", t.csv->train_path().string(), t.csv->eval_path().string()));
  }
  t.log.lead(fmt::format("Total time: {:.1f} s", seconds_since(run_start)));
  if (t.data.is_text) {
    t.log.lead(fmt::format("Final validation perplexity: {:.2f} (loss {:.4f} nats per token)",
                           std::exp(evaluation.loss), evaluation.loss));
  } else if (t.model->reconstructs()) {
    t.log.lead(
        fmt::format("Final test loss: {:.4f} (reconstruction, nats per image)", evaluation.loss));
  } else {
    t.log.lead(fmt::format("Final test accuracy: {:.4f}", evaluation.accuracy));
  }
}

/// Says why the run ended before --epochs, if it did.
void report_stop(Trainer& t, int64_t last_epoch, int64_t first_iteration) {
  if (t.progress.iteration == first_iteration) {
    t.log.lead(
        fmt::format("Nothing to train: the checkpoint has {} epoch(s) and {} iterations, "
                    "this run ends after epoch {}{}",
                    t.progress.epoch, t.progress.iteration, last_epoch,
                    t.config.stop_after_iteration > 0
                        ? fmt::format(" or iteration {}", t.config.stop_after_iteration)
                        : ""));
  } else if (stop_requested(t)) {
    t.log.lead(
        fmt::format("Stopped after iteration {} (--stop-after-iteration)", t.progress.iteration));
  } else if (last_epoch < t.config.epochs && t.progress.epoch == last_epoch) {
    t.log.lead(fmt::format("Stopped after epoch {} of {} (--stop-after-epoch)", last_epoch,
                           t.config.epochs));
  }
}

int run(int argc, const char* const* argv) {
  keep_large_allocations_on_the_heap();
  const auto config_or_help = parse_trainer_config(argc, argv);
  if (!config_or_help) return 0;
  const TrainerConfig& config = *config_or_help;
  const auto run_start = Clock::now();
  if (config.threads > 0) at::set_num_threads(static_cast<int>(config.threads));

  // Before the process group: NCCL's communicators go to the current device.
  const c10::Device device =
      resolve_device(config.device, shampoo::local_rank_from_env(), query_cuda());
  make_current(device);
  // float32 as on the CPU: cuDNN would run convolutions in TF32 (10-bit mantissa, ~1e-3
  // relative) by default. Lower precision is asked for explicitly, with --amp.
  if (device.is_cuda()) at::globalContext().setAllowTF32CuDNN(false);
  if (is_text(config.dataset) && config.amp == AmpMode::kFp16 && !device.is_cuda()) {
    // LibTorch's CPU LSTM (oneDNN) has no fp16 kernel: it fails at the first forward.
    throw std::invalid_argument(
        "--amp fp16: the language model's LSTM has no fp16 kernel on the CPU; use --amp bf16, "
        "--amp off or --device cuda");
  }
  const Distributed d = join_process_group();
  TrainingData data = load_data(config);
  data.move_to(device);
  Trainer t(config, d, device, std::move(data));
  build_model_and_optimizer(t);
  print_setup(t);

  const int64_t last_epoch = config.stop_after_epoch > 0
                                 ? std::min(config.stop_after_epoch, config.epochs)
                                 : config.epochs;
  const int64_t first_iteration = t.progress.iteration;
  auto evaluation = train(t, last_epoch);
  report_stop(t, last_epoch, first_iteration);
  if (!evaluation) {
    evaluation = evaluate_model(t);
  }
  save_parameters(t);
  print_summary(t, *evaluation, run_start);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::invalid_argument& e) {
    fmt::print(stderr, "cifar10_trainer: {} (see --help)\n", e.what());
    return 2;
  } catch (const c10::Error& e) {
    fmt::print(stderr, "cifar10_trainer: {}\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "cifar10_trainer: {}\n", e.what());
    return 1;
  }
}
