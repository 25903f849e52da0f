#include "examples/fashion_mnist.h"

#include <c10/util/Exception.h>

#include <string>
#include <system_error>

namespace shampoo::examples {

namespace {

/// `dir/stem.gz` when it exists, else `dir/stem` when that exists, else `dir/stem.gz` (so the
/// error names the file the Debian package ships).
std::filesystem::path find_file(const std::filesystem::path& dir, const std::string& stem) {
  std::error_code ec;
  auto compressed = dir / (stem + ".gz");
  if (std::filesystem::exists(compressed, ec)) return compressed;
  auto plain = dir / stem;
  if (std::filesystem::exists(plain, ec)) return plain;
  return compressed;
}

}  // namespace

LabeledImages load_fashion_mnist(const std::filesystem::path& dir, FashionMnistSplit split) {
  std::error_code ec;
  TORCH_CHECK(std::filesystem::is_directory(dir, ec), "Fashion-MNIST: ", dir.string(),
              " is not a directory; install Debian's dataset-fashion-mnist package or pass "
              "--data-dir");
  const std::string prefix = split == FashionMnistSplit::kTrain ? "train" : "t10k";
  const auto images_path = find_file(dir, prefix + "-images-idx3-ubyte");
  const auto labels_path = find_file(dir, prefix + "-labels-idx1-ubyte");

  LabeledImages raw = load_idx_dataset(images_path, labels_path);
  TORCH_CHECK(raw.images.size(1) == 28 && raw.images.size(2) == 28, images_path.string(),
              ": images are ", raw.images.size(1), "x", raw.images.size(2), ", expected 28x28");
  if (raw.size() > 0) {
    const int64_t max_label = raw.labels.max().item<int64_t>();
    TORCH_CHECK(max_label < kFashionMnistClasses, labels_path.string(), ": label ", max_label,
                " out of range, expected 0..", kFashionMnistClasses - 1);
  }

  raw.images = raw.images.unsqueeze(1);
  return raw;
}

}  // namespace shampoo::examples
