#include "examples/idx_dataset.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <system_error>
#include <vector>

namespace shampoo::examples {

namespace {

constexpr uint8_t kIdxTypeUnsignedByte = 0x08;
// Largest size accepted for one dim; guards the element count against a corrupt header.
constexpr uint32_t kMaxIdxDimSize = 1u << 28;

/// gzFile owned for the scope of one read.
class GzInput {
 public:
  explicit GzInput(const std::filesystem::path& path) : path_(path) {
    std::error_code ec;
    TORCH_CHECK(std::filesystem::exists(path_, ec), path_.string(), ": no such file");
    TORCH_CHECK(std::filesystem::is_regular_file(path_, ec), path_.string(),
                ": not a regular file");
    file_ = gzopen(path_.c_str(), "rb");
    TORCH_CHECK(file_ != nullptr, path_.string(), ": cannot open (", std::strerror(errno), ")");
  }
  ~GzInput() {
    if (file_ != nullptr) gzclose(file_);
  }
  GzInput(const GzInput&) = delete;
  GzInput& operator=(const GzInput&) = delete;

  /// Reads exactly `size` bytes; `what` names the part of the file for the error message.
  void read_exact(void* destination, size_t size, const char* what) {
    auto* out = static_cast<char*>(destination);
    size_t done = 0;
    while (done < size) {
      // gzread takes an unsigned count; read large payloads in chunks.
      const auto chunk = static_cast<unsigned>(std::min<size_t>(size - done, 1u << 30));
      const int got = gzread(file_, out + done, chunk);
      if (got <= 0) {
        int code = Z_OK;
        std::string message = gzerror(file_, &code);
        // zlib prefixes its message with the path, which ours already names.
        const std::string path_prefix = path_.string() + ": ";
        if (message.rfind(path_prefix, 0) == 0) message.erase(0, path_prefix.size());
        const std::string detail =
            (got < 0 || (code != Z_OK && code != Z_STREAM_END)) ? " (zlib: " + message + ")" : "";
        TORCH_CHECK(false, path_.string(), ": truncated: expected ", size, " bytes of ", what,
                    ", got ", done, detail);
      }
      done += static_cast<size_t>(got);
    }
  }

  uint32_t read_big_endian_u32(const char* what) {
    std::array<unsigned char, 4> bytes{};
    read_exact(bytes.data(), bytes.size(), what);
    return (uint32_t{bytes[0]} << 24) | (uint32_t{bytes[1]} << 16) | (uint32_t{bytes[2]} << 8) |
           uint32_t{bytes[3]};
  }

 private:
  std::filesystem::path path_;
  gzFile file_ = nullptr;
};

}  // namespace

at::Tensor read_idx_ubyte(const std::filesystem::path& path, int64_t expected_dims) {
  TORCH_CHECK(expected_dims >= 1 && expected_dims <= 255, "read_idx_ubyte: expected_dims: got ",
              expected_dims, ", expected 1..255");
  GzInput input(path);
  const uint32_t magic = input.read_big_endian_u32("header");
  const uint32_t expected_magic =
      (uint32_t{kIdxTypeUnsignedByte} << 8) | static_cast<uint32_t>(expected_dims);
  if (magic != expected_magic) {
    TORCH_CHECK(false, fmt::format("{}: wrong magic number {:#010x}, expected {:#010x} (IDX "
                                   "unsigned-byte file with {} dims)",
                                   path.string(), magic, expected_magic, expected_dims));
  }

  std::vector<int64_t> shape;
  int64_t numel = 1;
  for (int64_t d = 0; d < expected_dims; ++d) {
    const uint32_t size = input.read_big_endian_u32("header");
    TORCH_CHECK(size <= kMaxIdxDimSize, path.string(), ": dim ", d, " has size ", size,
                ", more than ", kMaxIdxDimSize, " (corrupt header?)");
    shape.push_back(static_cast<int64_t>(size));
    numel *= static_cast<int64_t>(size);
    TORCH_CHECK(numel <= (int64_t{1} << 34), path.string(), ": header promises more than 2^34 ",
                "elements (corrupt header?)");
  }

  at::Tensor data = at::empty(shape, at::TensorOptions().dtype(at::kByte));
  input.read_exact(data.data_ptr<uint8_t>(), static_cast<size_t>(numel), "data");
  return data;
}

LabeledImages load_idx_dataset(const std::filesystem::path& images_path,
                               const std::filesystem::path& labels_path) {
  LabeledImages result;
  result.images = read_idx_ubyte(images_path, 3);
  result.labels = read_idx_ubyte(labels_path, 1).to(at::kLong);
  TORCH_CHECK(result.images.size(0) == result.labels.size(0), images_path.string(), " holds ",
              result.images.size(0), " images but ", labels_path.string(), " holds ",
              result.labels.size(0), " labels");
  return result;
}

}  // namespace shampoo::examples
