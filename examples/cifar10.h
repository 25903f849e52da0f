#pragma once
/// CIFAR-10 (Krizhevsky, 2009): 32x32 colour images in 10 classes, 50 000 for training and
/// 10 000 for testing, read from the official binary version (cifar-10-binary.tar.gz from
/// https://www.cs.toronto.edu/~kriz/cifar.html, which unpacks to cifar-10-batches-bin/).
///
/// Files: data_batch_1.bin ... data_batch_5.bin (training) and test_batch.bin (test). Each is a
/// sequence of 3073-byte records: one label byte (0..9), then 3072 pixel bytes, the 1024 red
/// values of the 32x32 image in row-major order, then the 1024 green, then the 1024 blue. The
/// official files hold 10 000 records each; smaller files with whole records are accepted too
/// (the tests write a few hundred).

#include <cstdint>
#include <filesystem>
#include <string_view>

#include "examples/idx_dataset.h"

namespace shampoo::examples {

inline constexpr int64_t kCifar10Classes = 10;
inline constexpr int64_t kCifar10Channels = 3;
inline constexpr int64_t kCifar10ImageSize = 32;
inline constexpr int64_t kCifar10PixelBytes =
    kCifar10Channels * kCifar10ImageSize * kCifar10ImageSize;
inline constexpr int64_t kCifar10RecordBytes = 1 + kCifar10PixelBytes;
inline constexpr int64_t kCifar10RecordsPerFile = 10000;
inline constexpr int64_t kCifar10TrainFiles = 5;
/// Where the official archive unpacks, relative to the working directory.
inline constexpr std::string_view kCifar10DefaultDir = "data/cifar-10-batches-bin";
/// Per-channel pixel mean and standard deviation of the training images (in [0, 1]).
inline constexpr double kCifar10Mean[kCifar10Channels] = {0.4914, 0.4822, 0.4465};
inline constexpr double kCifar10Std[kCifar10Channels] = {0.2470, 0.2435, 0.2616};

enum class Cifar10Split { kTrain, kTest };

/// Reads one CIFAR-10 binary file: images uint8 [N, 3, 32, 32], labels int64 [N]. Throws
/// c10::Error naming the file when it is missing, empty, not a whole number of records (a
/// truncated download), or holds a label outside 0..9.
LabeledImages read_cifar10_file(const std::filesystem::path& path);

/// The training split (data_batch_1.bin ... data_batch_5.bin, concatenated in that order) or
/// the test split (test_batch.bin) from `dir`, as uint8 images and int64 labels. A missing file
/// is an error that names it and says where to get the data set.
LabeledImages load_cifar10(const std::filesystem::path& dir, Cifar10Split split);

}  // namespace shampoo::examples
