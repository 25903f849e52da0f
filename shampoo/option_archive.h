#pragma once
/// What the rows of the options table (option_fields.cpp) share: checked reads of a
/// ShampooOptions archive entry, which name the entry and what it should hold, and the code of a
/// float (its bits); and the rows built in files of their own: the preconditioner row
/// (preconditioner_option_field.cpp, from each family's fields) and the structured rows
/// (structured_option_fields.cpp).

#include <torch/serialize/input-archive.h>

#include <cstdint>
#include <string>

#include "shampoo/option_fields.h"

namespace shampoo::detail {
namespace option_archive {

/// The entry under `key`; its absence is an error naming it.
c10::IValue read_entry(torch::serialize::InputArchive& archive, const std::string& key);
bool has_entry(torch::serialize::InputArchive& archive, const std::string& key);
double read_double(torch::serialize::InputArchive& archive, const std::string& key);
int64_t read_int(torch::serialize::InputArchive& archive, const std::string& key);
/// An int entry that must lie in [0, count).
int64_t read_index(torch::serialize::InputArchive& archive, const std::string& key, int64_t count);
/// A float's code: its bits, −0.0 coded as 0.0.
int64_t double_bits(double value);

}  // namespace option_archive

/// The preconditioner row: the family's kind and every family's fields (visit_fields).
OptionField preconditioner_field();

/// The rows of inverse_exponent_override and iterate_averaging (structured_option_fields.cpp).
OptionField inverse_exponent_override_field();
OptionField iterate_averaging_field();

}  // namespace shampoo::detail
