#pragma once
/// The image classification data sets the trainer knows (CIFAR-10, Fashion-MNIST), loaded into
/// one shape: uint8 images [N, C, H, W] kept as read (4x smaller than float), normalized per
/// batch with the data set's per-channel mean and standard deviation, on the device the data
/// set was moved to.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "examples/idx_dataset.h"

namespace shampoo::examples {

/// The trainer's data sets: two of images, and one text corpus (the Penn Treebank, read by
/// examples/text_corpus.h, not by load_image_dataset).
enum class DatasetKind { kCifar10, kFashionMnist, kPtb };

/// Whether `kind` is a text corpus (language modelling) rather than images.
inline bool is_text(DatasetKind kind) { return kind == DatasetKind::kPtb; }

/// "cifar10", "fashion-mnist" or "ptb" (the --dataset spellings).
DatasetKind parse_dataset_kind(const std::string& name);
std::string dataset_name(DatasetKind kind);
/// The folder a data set is read from when --data-dir is not given.
std::filesystem::path default_data_dir(DatasetKind kind);

struct ImageDataset {
  DatasetKind kind = DatasetKind::kCifar10;
  /// Images uint8 [N, C, H, W], labels int64 [N].
  LabeledImages train;
  LabeledImages test;
  int64_t num_classes = 0;
  /// Per-channel mean and standard deviation of pixels scaled to [0, 1].
  std::vector<double> mean;
  std::vector<double> std;

  int64_t channels() const { return train.images.size(1); }
  int64_t height() const { return train.images.size(2); }
  int64_t width() const { return train.images.size(3); }

  /// uint8 images [B, C, H, W] → float (x / 255 − mean_c) / std_c. Elementwise, so a batch gives
  /// the same values however the data set is split into batches or ranks.
  /// Computed on the images' device.
  at::Tensor normalize(const at::Tensor& images) const;

  /// Moves the images and labels of both splits to `device`, once, with the per-channel mean and
  /// std: batches are then selected and normalized there, so training on a GPU copies nothing
  /// from the host per batch.
  void move_to(c10::Device device);

 private:
  /// mean and std as float [1, C, 1, 1] on the device of move_to (undefined before).
  at::Tensor channel_mean_;
  at::Tensor channel_std_;
};

/// Loads both splits of `kind` (an image data set) from `dir`. Throws c10::Error naming the
/// missing or broken file.
ImageDataset load_image_dataset(DatasetKind kind, const std::filesystem::path& dir);

}  // namespace shampoo::examples
