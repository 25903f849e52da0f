#pragma once
/// The fields of ShampooOptions, described once. Everything that treats the options field by
/// field reads this table: which groups may merge (structurally_equal), the ranks' fingerprint,
/// ShampooOptions::serialize (checkpoints), restoring the float options from a checkpoint, and
/// the error messages that name a field. Adding an option is its TORCH_ARG and one row of
/// option_fields() (shampoo/option_fields.cpp).

#include <torch/serialize/archive.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "shampoo/shampoo_options.h"

namespace shampoo::detail {

enum class OptionKind {
  /// May differ between groups of one virtual group (read per block at every step), may change
  /// after construction (schedulers), restored from checkpoints.
  kFloat,
  /// Equal within a virtual group and on every rank, fixed after construction, must match a
  /// checkpoint's.
  kStructural,
};

/// One field (or, for grafting, one half of a field) of ShampooOptions.
struct OptionField {
  /// The setter's name, as messages show it; the grafting config is two rows, "grafting kind"
  /// (structural) and "grafting floats" (its beta2 and epsilon).
  std::string name;
  OptionKind kind;
  /// The entries it has in a ShampooOptions archive (the name for a field of one value).
  std::vector<std::string> archive_keys;
  /// Canonical value: two options agree on this field exactly when their codes are equal. The
  /// ranks' fingerprint hashes it. Float values are coded by their bits (−0.0 as 0.0).
  std::function<std::vector<int64_t>(const ShampooOptions&)> code;
  /// The value as messages show it.
  std::function<std::string(const ShampooOptions&)> describe;
  /// Writes / reads the field's entries of a ShampooOptions archive; reading checks that they
  /// are there and have the right type and range.
  std::function<void(const ShampooOptions&, torch::serialize::OutputArchive&)> write;
  std::function<void(torch::serialize::InputArchive&, ShampooOptions&)> read;
  /// Sets this field of `to` to its value in `from`, nothing else.
  std::function<void(const ShampooOptions& from, ShampooOptions& to)> copy;
  /// A structural field that only chooses how the state is stored (use_symmetric_packing): a
  /// checkpoint saved with any value loads, the state converting on import.
  bool storage_layout = false;
};

/// Every field, in archive order (a row may read what an earlier row set: the grafting floats
/// come after the grafting kind).
const std::vector<OptionField>& option_fields();

/// The names of the fields of one kind, comma-separated, for messages.
std::string option_names(OptionKind kind);

/// The first structural field in which `a` and `b` differ; nullptr when there is none. With
/// `for_checkpoint`, storage-layout fields (OptionField::storage_layout) do not count.
const OptionField* structural_difference(const ShampooOptions& a, const ShampooOptions& b,
                                         bool for_checkpoint = false);

/// "<name>: got <value in got>, expected <value in expected>".
std::string describe_difference(const OptionField& field, const ShampooOptions& got,
                                const ShampooOptions& expected);

}  // namespace shampoo::detail
