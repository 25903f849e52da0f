#pragma once
/// Fashion-MNIST (Xiao et al., 2017): 28x28 grayscale images of clothing in 10 classes,
/// 60 000 for training and 10 000 for testing, in the IDX files Debian's dataset-fashion-mnist
/// package installs.

#include <cstdint>
#include <filesystem>
#include <string_view>

#include "examples/idx_dataset.h"

namespace shampoo::examples {

/// Where `apt-get install dataset-fashion-mnist` puts the files.
inline constexpr std::string_view kFashionMnistDefaultDir = "/usr/share/datasets/fashion-mnist";
inline constexpr int64_t kFashionMnistClasses = 10;
/// Pixel mean and standard deviation of the training images (in [0, 1]).
inline constexpr double kFashionMnistMean = 0.2860;
inline constexpr double kFashionMnistStd = 0.3530;

enum class FashionMnistSplit { kTrain, kTest };

/// Loads one split from `dir` (train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz,
/// t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz; the uncompressed names are accepted
/// too). Returns images as uint8 [N, 1, 28, 28] (normalize with the mean and std above, e.g.
/// through ImageDataset::normalize) and labels as int64 [N] in 0..9. Throws c10::Error naming
/// the file on any problem.
LabeledImages load_fashion_mnist(const std::filesystem::path& dir, FashionMnistSplit split);

}  // namespace shampoo::examples
