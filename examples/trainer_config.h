#pragma once
/// The flags of the image classification trainer (cifar10_trainer), parsed and checked.
/// Names and defaults follow the reference's trainer_utils.py (facebookresearch/optimizers,
/// distributed_shampoo/examples) where it has the flag, except the Shampoo settings, which are the
/// library's defaults (--precondition-frequency 50, --grafting adam); `cifar10_trainer --help`
/// explains each.

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "examples/image_dataset.h"

namespace shampoo::examples {

enum class OptimizerKind { kSgd, kAdam, kAdamW, kShampoo };
enum class GraftingKind { kNone, kSgd, kAdaGrad, kRmsProp, kAdam };
enum class LrSchedule { kConstant, kCosine };
enum class ProgressMode { kAuto, kOn, kOff };
/// --device: auto = CUDA when torch::cuda::is_available(), else CPU (examples/trainer_device.h).
enum class DeviceChoice { kAuto, kCpu, kCuda };
/// --amp: the forward pass under autocast in bf16 or fp16 (fp16 with a GradScaler).
enum class AmpMode { kOff, kBf16, kFp16 };
/// --sharding, the library's names: none (gradients all-reduced, every rank holds all of them),
/// state (state sharding, ZeRO-1: each parameter's optimizer state on the rank that steps it),
/// gradients (gradient sharding, ZeRO-2: state sharding, and each gradient reduced to that rank)
/// full (full sharding, ZeRO-3: shampoo::FullyShardedDataParallel, parameters, gradients and
/// state split across the ranks) or hybrid (full sharding within shard groups of
/// --shard-group-size ranks, replicated across them: shampoo::make_hybrid_groups). Shampoo's
/// Distributor keeps each block's state on its owner in every mode, so for Shampoo state equals
/// none.
enum class ShardingMode { kNone, kState, kGradients, kFull, kHybrid };
/// shampoo::CompactState (--compact-state).
enum class CompactChoice { kNone, kBf16, kInt8 };
/// shampoo::WeightDecayType (--weight-decay-type).
enum class WeightDecayChoice { kL2, kDecoupled, kCorrected, kIndependent };

struct TrainerConfig {
  // Data and model.
  DatasetKind dataset = DatasetKind::kCifar10;
  std::filesystem::path data_dir;
  int64_t limit_train = 0;  // 0 = every training example (ptb: every training sequence)
  /// "convnet", "resnet", "smallcnn", "autoencoder" for the images; "lm" for ptb (its default).
  std::string model = "convnet";
  // The language model (--model lm, examples/language_model.h).
  int64_t bptt = 35;        // tokens per sequence (inputs; targets are shifted by one)
  int64_t lm_dim = 128;     // embedding width = LSTM hidden size
  double lm_dropout = 0.0;  // dropout after the embedding and before the output projection

  // Training loop.
  int64_t epochs = 1;
  int64_t stop_after_epoch = 0;      // 0 = run to --epochs
  int64_t stop_after_iteration = 0;  // 0 = run to --epochs
  int64_t local_batch_size = 128;
  bool local_batch_size_given = false;  // --local-batch-size on the command line
  int64_t global_batch_size = 0;        // 0 = --local-batch-size x ranks
  /// Each rank's batch split into this many equal micro-batches, their gradients accumulated
  /// (each loss divided by it, so the gradient is the whole batch's mean), one step per batch.
  int64_t micro_batches = 1;
  /// After training, rank 0 writes the model's named parameters here (save_named_parameters);
  /// empty = not written.
  std::filesystem::path save_params;
  uint64_t seed = 2022;
  int64_t window_size = 1;
  int64_t log_every = 1;
  LrSchedule lr_schedule = LrSchedule::kConstant;
  int64_t eval_batch_size = 500;
  int64_t threads = 1;  // 0 = LibTorch's default
  ProgressMode progress = ProgressMode::kAuto;
  std::filesystem::path checkpoint_dir;  // empty = no checkpoints
  int64_t checkpoint_every = 0;          // iterations; 0 = after every epoch only
  std::filesystem::path metrics_dir;     // empty = no CSV files
  DeviceChoice device = DeviceChoice::kAuto;
  AmpMode amp = AmpMode::kOff;
  ShardingMode sharding = ShardingMode::kNone;
  /// --shard-group-size (hybrid): ranks per shard group; 0 = torchrun's LOCAL_WORLD_SIZE (the
  /// ranks of a node).
  int64_t shard_group_size = 0;
  /// Full or hybrid sharding: the model runs in shampoo::FullyShardedDataParallel.
  bool fully_sharded() const {
    return sharding == ShardingMode::kFull || sharding == ShardingMode::kHybrid;
  }

  // Optimizer (shared).
  OptimizerKind optimizer = OptimizerKind::kShampoo;
  double lr = 1e-3;
  std::vector<double> lrs;  // round-robin over per-parameter groups; empty = one lr
  double beta1 = 0.9;
  double beta2 = 0.999;
  double beta3 = -1.0;
  double epsilon = 1e-12;
  double weight_decay = 0.0;
  std::optional<double> bias_weight_decay;  // for 1-D parameters; unset = weight_decay
  double momentum = 0.0;
  double dampening = 0.0;
  bool use_nesterov = false;
  bool use_decoupled_weight_decay = true;  // false = --weight-decay-type l2
  WeightDecayChoice weight_decay_type = WeightDecayChoice::kDecoupled;

  // Shampoo: the library's defaults (roots every 50 steps, Adam grafting), not the reference's
  // (every step, no grafting: ShampooOptions::reference_defaults()).
  int64_t max_preconditioner_dim = 1024;
  int64_t precondition_frequency = 50;
  int64_t start_preconditioning_step = -1;
  GraftingKind grafting = GraftingKind::kAdam;
  double grafting_beta2 = 0.999;
  double grafting_epsilon = 1e-8;
  bool use_bias_correction = true;
  bool use_merge_dims = true;
  bool precondition_1d = false;
  bool factored_grafting = true;
  int64_t max_factored_dim = 4096;
  double relative_epsilon = 1e-7;
  double trace_scaling = 0.0;  // the trace scaling exponent; 0 = off
  c10::ScalarType factor_dtype = c10::ScalarType::Double;
  CompactChoice compact_state = CompactChoice::kNone;

  // Distributed Shampoo.
  c10::ScalarType communication_dtype = c10::ScalarType::Float;
  int64_t num_trainers_per_group = -1;
  bool communicate_params = false;
  bool merge_groups = true;

  /// The command line that reproduces this configuration (for logs and checkpoints).
  std::string command_line;
};

std::string optimizer_name(OptimizerKind kind);
std::string grafting_name(GraftingKind kind);
/// "auto", "cpu" or "cuda" (the --device spellings).
std::string device_choice_name(DeviceChoice choice);
/// "off", "bf16" or "fp16"; "none" or "gradients".
std::string amp_name(AmpMode mode);
std::string sharding_name(ShardingMode mode);

/// Examples per iteration: over all ranks (the global batch) and per rank.
struct BatchSizes {
  int64_t global = 0;
  int64_t local = 0;
};

/// The batch sizes of a run at `world_size` ranks. --global-batch-size G: every rank takes
/// G / world_size (std::invalid_argument naming the flags and numbers when world_size does not
/// divide G, or when --local-batch-size is given too and does not agree); otherwise every rank
/// takes --local-batch-size L, L x world_size in all. std::invalid_argument too when
/// --micro-batches does not divide the local batch.
BatchSizes resolve_batch_sizes(const TrainerConfig& config, int64_t world_size);

/// Parses and checks argv. Returns nullopt when --help was given (the usage is printed). Throws
/// std::invalid_argument naming the flag on a bad value.
std::optional<TrainerConfig> parse_trainer_config(int argc, const char* const* argv);

}  // namespace shampoo::examples
