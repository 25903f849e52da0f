#pragma once
/// Reader for the IDX format of MNIST and Fashion-MNIST (http://yann.lecun.com/exdb/mnist/):
/// a big-endian header (magic 0x0000 TT NN: element type TT, NN dims; then NN uint32 sizes)
/// followed by the elements. Files may be gzip-compressed or plain; zlib reads both.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>

namespace shampoo::examples {

/// Images and their class labels, one row per example.
struct LabeledImages {
  /// [N, rows, cols] uint8 as read from IDX, or [N, channels, rows, cols] uint8 as the data set
  /// loaders return them (normalized to float per batch).
  at::Tensor images;
  /// [N] int64.
  at::Tensor labels;

  int64_t size() const { return labels.defined() ? labels.size(0) : 0; }
};

/// Reads an IDX file of unsigned bytes (type 0x08) with `expected_dims` dims and returns a uint8
/// tensor of the shape its header gives. Throws c10::Error naming the file when it is missing,
/// not an IDX ubyte file of that rank (wrong magic), or shorter than its header promises.
at::Tensor read_idx_ubyte(const std::filesystem::path& path, int64_t expected_dims);

/// Reads an IDX image file ([N, rows, cols] uint8) and its label file ([N] uint8 → int64); checks
/// that both hold the same number of examples.
LabeledImages load_idx_dataset(const std::filesystem::path& images_path,
                               const std::filesystem::path& labels_path);

}  // namespace shampoo::examples
