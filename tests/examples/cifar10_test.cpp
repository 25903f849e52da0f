// The CIFAR-10 binary reader: record layout (label byte, then the red, green and blue planes of
// a 32x32 image, row-major), concatenation of the training files, and its errors.
#include "examples/cifar10.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "support/test_support.h"

namespace {

namespace fs = std::filesystem;
using shampoo::examples::kCifar10RecordBytes;

/// Record r of file f: label (f + r) % 10, pixel p = (7·p + 13·r + 29·f) mod 251.
std::vector<char> make_record(int file, int r) {
  std::vector<char> record(kCifar10RecordBytes);
  record[0] = static_cast<char>((file + r) % 10);
  for (int p = 0; p < 3072; ++p)
    record[1 + p] = static_cast<char>((7 * p + 13 * r + 29 * file) % 251);
  return record;
}

fs::path write_files(const std::string& name, int records_per_file) {
  const fs::path dir = shampoo::testing::temp_path(name);
  shampoo::testing::remove_tree(dir);
  fs::create_directories(dir);
  for (int f = 0; f <= 5; ++f) {
    const std::string file = f == 0 ? "test_batch.bin" : "data_batch_" + std::to_string(f) + ".bin";
    std::ofstream out(dir / file, std::ios::binary);
    for (int r = 0; r < records_per_file; ++r) {
      const auto record = make_record(f, r);
      out.write(record.data(), kCifar10RecordBytes);
    }
  }
  return dir;
}

TEST(Cifar10, RecordLayoutIsLabelThenChannelPlanes) {
  const auto dir = write_files("cifar10_layout", 3);
  const auto data = shampoo::examples::load_cifar10(dir, shampoo::examples::Cifar10Split::kTrain);
  ASSERT_EQ(data.images.sizes(), (std::vector<int64_t>{15, 3, 32, 32}));
  ASSERT_EQ(data.images.scalar_type(), at::kByte);
  ASSERT_EQ(data.labels.scalar_type(), at::kLong);
  for (int f = 1; f <= 5; ++f) {
    for (int r = 0; r < 3; ++r) {
      const int64_t n = (f - 1) * 3 + r;  // files concatenated in order 1..5
      EXPECT_EQ(data.labels[n].item<int64_t>(), (f + r) % 10);
      for (const auto& [c, y, x] : {std::tuple{0, 0, 0}, std::tuple{0, 5, 31}, std::tuple{1, 0, 0},
                                    std::tuple{2, 31, 31}, std::tuple{1, 17, 3}}) {
        const int p = c * 1024 + y * 32 + x;
        EXPECT_EQ(data.images[n][c][y][x].item<int64_t>(), (7 * p + 13 * r + 29 * f) % 251)
            << "image " << n << " channel " << c << " row " << y << " column " << x;
      }
    }
  }
  const auto test = shampoo::examples::load_cifar10(dir, shampoo::examples::Cifar10Split::kTest);
  EXPECT_EQ(test.size(), 3);
  EXPECT_EQ(test.labels[2].item<int64_t>(), 2);
}

TEST(Cifar10, MissingAndTruncatedFilesAreErrorsNamingTheFile) {
  const auto dir = write_files("cifar10_errors", 2);
  fs::remove(dir / "data_batch_4.bin");
  try {
    shampoo::examples::load_cifar10(dir, shampoo::examples::Cifar10Split::kTrain);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("data_batch_4.bin: no such file"), std::string::npos)
        << e.what();
  }
  fs::resize_file(dir / "test_batch.bin", kCifar10RecordBytes + 1);
  try {
    shampoo::examples::load_cifar10(dir, shampoo::examples::Cifar10Split::kTest);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("test_batch.bin: truncated: 3074 bytes"),
              std::string::npos)
        << e.what();
  }
  fs::resize_file(dir / "test_batch.bin", 0);
  EXPECT_THROW(shampoo::examples::load_cifar10(dir, shampoo::examples::Cifar10Split::kTest),
               c10::Error);
}

}  // namespace
