#include "examples/cifar10.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>
#include <system_error>
#include <vector>

namespace shampoo::examples {

namespace {

constexpr const char* kWhereToGetIt =
    "download the binary version (cifar-10-binary.tar.gz) from "
    "https://www.cs.toronto.edu/~kriz/cifar.html, unpack it and pass the cifar-10-batches-bin "
    "folder as --data-dir";

}  // namespace

LabeledImages read_cifar10_file(const std::filesystem::path& path) {
  std::error_code ec;
  TORCH_CHECK(std::filesystem::exists(path, ec), "CIFAR-10: ", path.string(), ": no such file; ",
              kWhereToGetIt);
  TORCH_CHECK(std::filesystem::is_regular_file(path, ec), "CIFAR-10: ", path.string(),
              ": not a regular file");
  const auto bytes = static_cast<int64_t>(std::filesystem::file_size(path, ec));
  TORCH_CHECK(!ec, "CIFAR-10: ", path.string(), ": cannot read its size (", ec.message(), ")");
  TORCH_CHECK(bytes > 0, "CIFAR-10: ", path.string(), ": empty file, expected ",
              kCifar10RecordsPerFile, " records of ", kCifar10RecordBytes, " bytes");
  TORCH_CHECK(bytes % kCifar10RecordBytes == 0, "CIFAR-10: ", path.string(), ": truncated: ", bytes,
              " bytes is not a whole number of ", kCifar10RecordBytes,
              "-byte records (1 label byte + 3072 pixel bytes; the official files have ",
              kCifar10RecordsPerFile * kCifar10RecordBytes, " bytes)");
  const int64_t records = bytes / kCifar10RecordBytes;

  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "CIFAR-10: ", path.string(), ": cannot open (", std::strerror(errno), ")");
  std::vector<char> raw(static_cast<size_t>(bytes));
  in.read(raw.data(), bytes);
  TORCH_CHECK(in.gcount() == bytes, "CIFAR-10: ", path.string(), ": truncated: read ", in.gcount(),
              " of ", bytes, " bytes");

  LabeledImages result;
  result.images = at::empty({records, kCifar10Channels, kCifar10ImageSize, kCifar10ImageSize},
                            at::TensorOptions().dtype(at::kByte));
  result.labels = at::empty({records}, at::TensorOptions().dtype(at::kLong));
  auto* pixels = result.images.data_ptr<uint8_t>();
  auto* labels = result.labels.data_ptr<int64_t>();
  for (int64_t r = 0; r < records; ++r) {
    const char* record = raw.data() + r * kCifar10RecordBytes;
    const auto label = static_cast<uint8_t>(record[0]);
    TORCH_CHECK(label < kCifar10Classes, "CIFAR-10: ", path.string(), ": record ", r, " has label ",
                static_cast<int>(label), ", expected 0..", kCifar10Classes - 1,
                " (not a CIFAR-10 binary file?)");
    labels[r] = label;
    // The record's pixel bytes are already channel-major (R plane, G plane, B plane), the
    // [3, 32, 32] layout of one image.
    std::memcpy(pixels + r * kCifar10PixelBytes, record + 1, kCifar10PixelBytes);
  }
  return result;
}

LabeledImages load_cifar10(const std::filesystem::path& dir, Cifar10Split split) {
  std::error_code ec;
  TORCH_CHECK(std::filesystem::is_directory(dir, ec), "CIFAR-10: ", dir.string(),
              " is not a directory; ", kWhereToGetIt);
  std::vector<std::filesystem::path> files;
  if (split == Cifar10Split::kTrain) {
    for (int64_t i = 1; i <= kCifar10TrainFiles; ++i) {
      files.push_back(dir / ("data_batch_" + std::to_string(i) + ".bin"));
    }
  } else {
    files.push_back(dir / "test_batch.bin");
  }
  std::vector<at::Tensor> images;
  std::vector<at::Tensor> labels;
  for (const auto& file : files) {
    LabeledImages part = read_cifar10_file(file);
    images.push_back(std::move(part.images));
    labels.push_back(std::move(part.labels));
  }
  LabeledImages result;
  result.images = images.size() == 1 ? images[0] : at::cat(images);
  result.labels = labels.size() == 1 ? labels[0] : at::cat(labels);
  return result;
}

}  // namespace shampoo::examples
