#include "examples/image_dataset.h"

#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>

#include <stdexcept>

#include "examples/cifar10.h"
#include "examples/fashion_mnist.h"
#include "examples/text_corpus.h"

namespace shampoo::examples {

DatasetKind parse_dataset_kind(const std::string& name) {
  if (name == "cifar10") return DatasetKind::kCifar10;
  if (name == "fashion-mnist") return DatasetKind::kFashionMnist;
  if (name == "ptb") return DatasetKind::kPtb;
  throw std::invalid_argument("--dataset: got '" + name +
                              "', expected cifar10, fashion-mnist or ptb");
}

std::string dataset_name(DatasetKind kind) {
  switch (kind) {
    case DatasetKind::kCifar10:
      return "cifar10";
    case DatasetKind::kFashionMnist:
      return "fashion-mnist";
    case DatasetKind::kPtb:
      return "ptb";
  }
  return "?";
}

std::filesystem::path default_data_dir(DatasetKind kind) {
  switch (kind) {
    case DatasetKind::kCifar10:
      return std::filesystem::path(kCifar10DefaultDir);
    case DatasetKind::kFashionMnist:
      return std::filesystem::path(kFashionMnistDefaultDir);
    case DatasetKind::kPtb:
      return default_ptb_dir();
  }
  return {};
}

namespace {

/// `values` as float [1, C, 1, 1] on `device`: rounded to float on the CPU, then moved, so every
/// device normalizes with the same values.
at::Tensor channel_tensor(const std::vector<double>& values, c10::Device device) {
  const auto shape = std::vector<int64_t>{1, static_cast<int64_t>(values.size()), 1, 1};
  return at::tensor(values, at::TensorOptions().dtype(at::kDouble))
      .to(at::kFloat)
      .view(shape)
      .to(device);
}

}  // namespace

at::Tensor ImageDataset::normalize(const at::Tensor& images) const {
  TORCH_CHECK(images.dim() == 4 && images.scalar_type() == at::kByte &&
                  images.size(1) == static_cast<int64_t>(mean.size()),
              "ImageDataset::normalize: images: got ", images.sizes(), " ", images.scalar_type(),
              ", expected uint8 [B, ", mean.size(), ", H, W]");
  const bool cached = channel_mean_.defined() && channel_mean_.device() == images.device();
  const auto channel_mean = cached ? channel_mean_ : channel_tensor(mean, images.device());
  const auto channel_std = cached ? channel_std_ : channel_tensor(std, images.device());
  return images.to(at::kFloat).div_(255.0).sub_(channel_mean).div_(channel_std);
}

void ImageDataset::move_to(c10::Device device) {
  for (LabeledImages* split : {&train, &test}) {
    split->images = split->images.to(device);
    split->labels = split->labels.to(device);
  }
  channel_mean_ = channel_tensor(mean, device);
  channel_std_ = channel_tensor(std, device);
}

ImageDataset load_image_dataset(DatasetKind kind, const std::filesystem::path& dir) {
  TORCH_CHECK(!is_text(kind), "load_image_dataset: --dataset ", dataset_name(kind),
              " is a text corpus, not images");
  ImageDataset data;
  data.kind = kind;
  if (kind == DatasetKind::kCifar10) {
    data.train = load_cifar10(dir, Cifar10Split::kTrain);
    data.test = load_cifar10(dir, Cifar10Split::kTest);
    data.num_classes = kCifar10Classes;
    data.mean.assign(std::begin(kCifar10Mean), std::end(kCifar10Mean));
    data.std.assign(std::begin(kCifar10Std), std::end(kCifar10Std));
  } else {
    data.train = load_fashion_mnist(dir, FashionMnistSplit::kTrain);
    data.test = load_fashion_mnist(dir, FashionMnistSplit::kTest);
    data.num_classes = kFashionMnistClasses;
    data.mean = {kFashionMnistMean};
    data.std = {kFashionMnistStd};
  }
  return data;
}

}  // namespace shampoo::examples
