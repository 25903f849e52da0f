#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>
#include <array>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "shampoo/option_archive.h"

namespace shampoo::detail {
namespace {

using option_archive::double_bits;
using option_archive::has_entry;
using option_archive::read_double;
using option_archive::read_entry;
using option_archive::read_index;
using option_archive::read_int;
using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;

// The preconditioner row. Every family lists its fields once, with the family
// (preconditioners/preconditioner_configs.h, visit_fields); the row's code, description and
// archive entries are made from those lists: two configs merge exactly when the family and every
// field are equal.

// A family field's value: its code, its text, its archive entries.
void append_code(int64_t v, std::vector<int64_t>& out) { out.push_back(v); }
void append_code(double v, std::vector<int64_t>& out) { out.push_back(double_bits(v)); }
void append_code(bool v, std::vector<int64_t>& out) { out.push_back(v ? 1 : 0); }
void append_code(const std::array<double, 3>& v, std::vector<int64_t>& out) {
  for (const double x : v) out.push_back(double_bits(x));
}
/// Newton–Schulz's schedule: (number of triples, each triple's bits).
using Triples = std::vector<std::array<double, 3>>;
void append_code(const Triples& v, std::vector<int64_t>& out) {
  out.push_back(static_cast<int64_t>(v.size()));
  for (const auto& t : v) append_code(t, out);
}
template <typename E>
requires std::is_enum_v<E>
void append_code(E v, std::vector<int64_t>& out) { out.push_back(static_cast<int64_t>(v)); }
/// SOAP's ignored dims, flattened: (order, number of dims, dims...) per order, in map order.
using IgnoredDims = std::map<int64_t, std::vector<int64_t>>;
std::vector<int64_t> flatten(const IgnoredDims& v) {
  std::vector<int64_t> out;
  for (const auto& [order, dims] : v) {
    out.push_back(order);
    out.push_back(static_cast<int64_t>(dims.size()));
    out.insert(out.end(), dims.begin(), dims.end());
  }
  return out;
}
void append_code(const IgnoredDims& v, std::vector<int64_t>& out) {
  const auto flat = flatten(v);
  out.push_back(static_cast<int64_t>(flat.size()));
  out.insert(out.end(), flat.begin(), flat.end());
}
/// (kind, rank_atol bits, rank_rtol bits); zeros for the perturbation.
void append_code(const RankDeficientStabilityConfig& v, std::vector<int64_t>& out) {
  const auto* c = std::get_if<PseudoInverseConfig>(&v);
  if (c == nullptr) {
    out.insert(out.end(), {0, 0, 0});
    return;
  }
  out.insert(out.end(), {static_cast<int64_t>(v.index()), double_bits(c->rank_atol),
                         double_bits(c->rank_rtol)});
}

std::string value_text(int64_t v) { return c10::str(v); }
std::string value_text(double v) { return c10::str(v); }
std::string value_text(bool v) { return v ? "true" : "false"; }
std::string value_text(const std::array<double, 3>& v) {
  return c10::str("(", v[0], ", ", v[1], ", ", v[2], ")");
}
std::string value_text(const Triples& v) {
  std::vector<std::string> parts;
  for (const auto& t : v) parts.push_back(value_text(t));
  return c10::str("[", c10::Join(", ", parts), "]");
}
template <typename E>
requires std::is_enum_v<E> std::string value_text(E v) {
  const auto names = enumerator_names(v);
  const auto i = static_cast<size_t>(v);
  return i < names.size() ? names[i] : c10::str(static_cast<int64_t>(v));
}
std::string value_text(const IgnoredDims& v) {
  std::vector<std::string> parts;
  for (const auto& [order, dims] : v)
    parts.push_back(c10::str(order, ": [", c10::Join(", ", dims), "]"));
  return c10::str("{", c10::Join(", ", parts), "}");
}
std::string value_text(const RankDeficientStabilityConfig& v) {
  const auto* c = std::get_if<PseudoInverseConfig>(&v);
  if (c == nullptr) return "perturbation";
  return c10::str(
      "pseudo-inverse (rank_atol ", c->rank_atol, ", rank_rtol ",
      c->rank_rtol == kDtypeRankRtol ? std::string("d * machine epsilon") : c10::str(c->rank_rtol),
      ")");
}

using Entries = std::vector<std::pair<std::string, c10::IValue>>;
Entries archive_entries(const std::string& key, int64_t v) { return {{key, c10::IValue(v)}}; }
Entries archive_entries(const std::string& key, double v) { return {{key, c10::IValue(v)}}; }
Entries archive_entries(const std::string& key, bool v) {
  return {{key, c10::IValue(int64_t{v ? 1 : 0})}};
}
Entries archive_entries(const std::string& key, const std::array<double, 3>& v) {
  return {{key, c10::IValue(std::vector<double>(v.begin(), v.end()))}};
}
Entries archive_entries(const std::string& key, const Triples& v) {
  std::vector<double> flat;
  for (const auto& t : v) flat.insert(flat.end(), t.begin(), t.end());
  return {{key, c10::IValue(flat)}};
}
Entries archive_entries(const std::string& key, const IgnoredDims& v) {
  return {{key, c10::IValue(flatten(v))}};
}
template <typename E>
requires std::is_enum_v<E> Entries archive_entries(const std::string& key, E v) {
  return {{key, c10::IValue(static_cast<int64_t>(v))}};
}
// The rank-deficient stability: its kind under `key`, the pseudo-inverse thresholds (or their
// defaults) under two entries of their own.
constexpr const char* kRankAtolKey = "preconditioner_pseudo_inverse_rank_atol";
constexpr const char* kRankRtolKey = "preconditioner_pseudo_inverse_rank_rtol";
Entries archive_entries(const std::string& key, const RankDeficientStabilityConfig& v) {
  const auto* c = std::get_if<PseudoInverseConfig>(&v);
  const auto pinv = c != nullptr ? *c : PseudoInverseConfig{};
  return {{key, c10::IValue(int64_t{c != nullptr ? 1 : 0})},
          {kRankAtolKey, c10::IValue(pinv.rank_atol)},
          {kRankRtolKey, c10::IValue(pinv.rank_rtol)}};
}

void read_value(InputArchive& a, const std::string& key, int64_t& v) { v = read_int(a, key); }
void read_value(InputArchive& a, const std::string& key, double& v) { v = read_double(a, key); }
void read_value(InputArchive& a, const std::string& key, bool& v) {
  v = read_index(a, key, 2) != 0;
}
void read_value(InputArchive& a, const std::string& key, std::array<double, 3>& v) {
  const auto value = read_entry(a, key);
  TORCH_CHECK(value.isDoubleList() && value.toDoubleVector().size() == 3,
              "ShampooOptions archive: entry '", key, "': got a ", value.tagKind(),
              ", expected a list of 3 floats");
  const auto list = value.toDoubleVector();
  std::copy(list.begin(), list.end(), v.begin());
}
void read_value(InputArchive& a, const std::string& key, Triples& v) {
  const auto value = read_entry(a, key);
  TORCH_CHECK(value.isDoubleList() && value.toDoubleVector().size() % 3 == 0,
              "ShampooOptions archive: entry '", key, "': got a ", value.tagKind(),
              ", expected a list of floats, three per (a, b, c)");
  const auto flat = value.toDoubleVector();
  v.clear();
  for (size_t i = 0; i < flat.size(); i += 3) v.push_back({flat[i], flat[i + 1], flat[i + 2]});
}
void read_value(InputArchive& a, const std::string& key, IgnoredDims& v) {
  const auto value = read_entry(a, key);
  TORCH_CHECK(value.isIntList(), "ShampooOptions archive: entry '", key, "': got a ",
              value.tagKind(), ", expected a list of ints");
  const auto flat = value.toIntVector();
  v.clear();
  for (size_t i = 0; i < flat.size();) {
    TORCH_CHECK(i + 1 < flat.size() && flat[i + 1] >= 0 &&
                    i + 2 + static_cast<size_t>(flat[i + 1]) <= flat.size(),
                "ShampooOptions archive: entry '", key, "' is truncated");
    const auto begin = flat.begin() + static_cast<int64_t>(i) + 2;
    v[flat[i]] = std::vector<int64_t>(begin, begin + flat[i + 1]);
    i += 2 + static_cast<size_t>(flat[i + 1]);
  }
}
template <typename E>
requires std::is_enum_v<E>
void read_value(InputArchive& a, const std::string& key, E& v) {
  v = static_cast<E>(read_index(a, key, static_cast<int64_t>(enumerator_names(v).size())));
}
void read_value(InputArchive& a, const std::string& key, RankDeficientStabilityConfig& v) {
  const int64_t kind =
      read_index(a, key, static_cast<int64_t>(std::variant_size_v<RankDeficientStabilityConfig>));
  if (kind == 0) {
    v = PerturbationConfig{};
  } else {
    v = PseudoInverseConfig{read_double(a, kRankAtolKey), read_double(a, kRankRtolKey)};
  }
}

/// Entries every checkpoint has had since the first format: reading them is required. Entries
/// added later (a family's, the rank-deficient stability's) keep the default when absent.
bool required_entry(const std::string& key) {
  static const std::array<std::string, 6> kRequired = {"preconditioner_retry_double_precision",
                                                       "preconditioner_eigenbasis_method",
                                                       "preconditioner_root_solver",
                                                       "preconditioner_max_iterations",
                                                       "preconditioner_tolerance",
                                                       "preconditioner_tf32"};
  return std::find(kRequired.begin(), kRequired.end(), key) != kRequired.end();
}

/// f(default config) for every family, in variant order.
template <typename F, size_t... I>
void for_each_family(F&& f, std::index_sequence<I...>) {
  (f(std::variant_alternative_t<I, PreconditionerConfig>{}), ...);
}
template <typename F>
void for_each_family(F&& f) {
  for_each_family(f, std::make_index_sequence<std::variant_size_v<PreconditionerConfig>>{});
}

/// (kind, the active family's fields' codes...).
std::vector<int64_t> preconditioner_code(const ShampooOptions& o) {
  std::vector<int64_t> out{static_cast<int64_t>(o.preconditioner().index())};
  std::visit(
      [&](const auto& c) {
        visit_fields(c, [&](const char*, const char*, const auto& v) { append_code(v, out); });
      },
      o.preconditioner());
  return out;
}

std::string describe_preconditioner(const ShampooOptions& o) {
  return std::visit(
      [](const auto& c) -> std::string {
        std::vector<std::string> parts;
        visit_fields(c, [&](const char*, const char* name, const auto& v) {
          parts.push_back(c10::str(name, " ", value_text(v)));
        });
        if (parts.empty()) return family_name(c);
        return c10::str(family_name(c), " (", c10::Join(", ", parts), ")");
      },
      o.preconditioner());
}

/// Every family's entries: the active family's values, the defaults of the first family that
/// lists a key for the others (a key shared by families is one entry).
void write_preconditioner(const ShampooOptions& o, OutputArchive& a) {
  std::map<std::string, c10::IValue> entries;
  std::visit(
      [&](const auto& c) {
        visit_fields(c, [&](const char* key, const char*, const auto& v) {
          for (auto& [k, value] : archive_entries(key, v)) entries[k] = value;
        });
      },
      o.preconditioner());
  for_each_family([&](const auto& family) {
    visit_fields(family, [&](const char* key, const char*, const auto& v) {
      for (auto& [k, value] : archive_entries(key, v)) entries.emplace(k, value);
    });
  });
  a.write("preconditioner_kind", c10::IValue(static_cast<int64_t>(o.preconditioner().index())));
  for (const auto& [key, value] : entries) a.write(key, value);
}

/// The default config of the family with variant index `kind`.
template <size_t... I>
PreconditionerConfig default_preconditioner(size_t kind, std::index_sequence<I...>) {
  PreconditionerConfig out;
  ((kind == I ? (out = std::variant_alternative_t<I, PreconditionerConfig>{}, true) : false), ...);
  return out;
}

void read_preconditioner(InputArchive& a, ShampooOptions& o) {
  const int64_t kind =
      read_index(a, "preconditioner_kind", std::variant_size_v<PreconditionerConfig>);
  auto config =
      default_preconditioner(static_cast<size_t>(kind),
                             std::make_index_sequence<std::variant_size_v<PreconditionerConfig>>{});
  std::visit(
      [&](auto& c) {
        visit_fields(c, [&](const char* key, const char*, auto& v) {
          if (required_entry(key) || has_entry(a, key)) read_value(a, key, v);
        });
      },
      config);
  o.preconditioner(config);
}

/// Archive keys of the preconditioner row: the kind, then every family's, each once.
std::vector<std::string> preconditioner_archive_keys() {
  std::vector<std::string> keys{"preconditioner_kind"};
  for_each_family([&](const auto& family) {
    visit_fields(family, [&](const char* key, const char*, const auto& v) {
      for (const auto& [k, value] : archive_entries(key, v)) {
        if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
      }
    });
  });
  return keys;
}

}  // namespace

OptionField preconditioner_field() {
  OptionField f;
  f.name = "preconditioner";
  f.kind = OptionKind::kStructural;
  f.archive_keys = preconditioner_archive_keys();
  f.code = preconditioner_code;
  f.describe = describe_preconditioner;
  f.write = write_preconditioner;
  f.read = read_preconditioner;
  f.copy = [](const ShampooOptions& from, ShampooOptions& to) {
    to.preconditioner(from.preconditioner());
  };
  return f;
}

}  // namespace shampoo::detail
