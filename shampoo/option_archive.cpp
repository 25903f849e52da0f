#include "shampoo/option_archive.h"

#include <c10/util/Exception.h>

#include <cstring>

namespace shampoo::detail::option_archive {

using torch::serialize::InputArchive;

c10::IValue read_entry(InputArchive& archive, const std::string& key) {
  c10::IValue value;
  TORCH_CHECK(archive.try_read(key, value), "ShampooOptions archive: entry '", key, "' is missing");
  return value;
}

bool has_entry(InputArchive& a, const std::string& key) {
  c10::IValue value;
  return a.try_read(key, value);
}

double read_double(InputArchive& archive, const std::string& key) {
  const auto value = read_entry(archive, key);
  TORCH_CHECK(value.isDouble(), "ShampooOptions archive: entry '", key, "': got a ",
              value.tagKind(), ", expected a float");
  return value.toDouble();
}

int64_t read_int(InputArchive& archive, const std::string& key) {
  const auto value = read_entry(archive, key);
  TORCH_CHECK(value.isInt(), "ShampooOptions archive: entry '", key, "': got a ", value.tagKind(),
              ", expected an int");
  return value.toInt();
}

int64_t read_index(InputArchive& archive, const std::string& key, int64_t count) {
  const int64_t value = read_int(archive, key);
  TORCH_CHECK(value >= 0 && value < count, "ShampooOptions archive: ", key, ": got ", value,
              ", expected 0..", count - 1);
  return value;
}

int64_t double_bits(double value) {
  value += 0.0;  // −0.0 codes as 0.0
  int64_t bits = 0;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

}  // namespace shampoo::detail::option_archive
