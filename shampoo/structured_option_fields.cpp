// Two rows of the options table (option_fields.cpp) that hold structures rather than one value:
// inverse_exponent_override (a map of orders to dims to exponents) and iterate_averaging (a
// variant of configs), each with its code, text and archive entries.
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <array>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include "shampoo/option_archive.h"

namespace shampoo::detail {
namespace {

using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;

/// The overrides as (order, dim, exponent) entries, in map order.
struct OverrideEntry {
  int64_t order;
  int64_t dim;
  double exponent;
};
std::vector<OverrideEntry> override_entries(const ShampooOptions& o) {
  std::vector<OverrideEntry> entries;
  for (const auto& [order, dims] : o.inverse_exponent_override()) {
    for (const auto& [dim, exponent] : dims) entries.push_back({order, dim, exponent});
  }
  return entries;
}

std::string describe_overrides(const ShampooOptions& o) {
  std::vector<std::string> orders;
  for (const auto& [order, dims] : o.inverse_exponent_override()) {
    std::vector<std::string> entries;
    for (const auto& [dim, exponent] : dims) {
      entries.push_back(c10::str(dim == kAllDims ? std::string("kAllDims") : std::to_string(dim),
                                 ": ", exponent));
    }
    orders.push_back(c10::str(order, ": {", c10::Join(", ", entries), "}"));
  }
  return "{" + c10::Join(", ", orders) + "}";
}

/// Archive form: a list of (order, dim, exponent) triples; orders and dims are small integers,
/// exact in a double.
InverseExponentOverride read_overrides(InputArchive& a) {
  const auto value = option_archive::read_entry(a, "inverse_exponent_override");
  TORCH_CHECK(value.isDoubleList(),
              "ShampooOptions archive: entry 'inverse_exponent_override': got a ", value.tagKind(),
              ", expected a list of floats");
  const auto triples = value.toDoubleVector();
  TORCH_CHECK(triples.size() % 3 == 0, "ShampooOptions archive: inverse_exponent_override: got ",
              triples.size(), " numbers, expected (order, dim, exponent) triples");
  InverseExponentOverride overrides;
  for (size_t i = 0; i < triples.size(); i += 3) {
    overrides[static_cast<int64_t>(triples[i])][static_cast<int64_t>(triples[i + 1])] =
        triples[i + 2];
  }
  return overrides;
}

}  // namespace

OptionField inverse_exponent_override_field() {
  OptionField f;
  f.name = "inverse_exponent_override";
  f.kind = OptionKind::kStructural;
  f.archive_keys = {"inverse_exponent_override"};
  f.code = [](const ShampooOptions& o) {
    std::vector<int64_t> code;
    for (const auto& e : override_entries(o)) {
      code.insert(code.end(), {e.order, e.dim, option_archive::double_bits(e.exponent)});
    }
    return code;
  };
  f.describe = describe_overrides;
  f.write = [](const ShampooOptions& o, OutputArchive& a) {
    std::vector<double> triples;
    for (const auto& e : override_entries(o)) {
      triples.insert(triples.end(),
                     {static_cast<double>(e.order), static_cast<double>(e.dim), e.exponent});
    }
    a.write("inverse_exponent_override", c10::IValue(triples));
  };
  f.read = [](InputArchive& a, ShampooOptions& o) {
    o.inverse_exponent_override(read_overrides(a));
  };
  f.copy = [](const ShampooOptions& from, ShampooOptions& to) {
    to.inverse_exponent_override(from.inverse_exponent_override());
  };
  return f;
}

namespace {

// Iterate averaging: the alternative and its three numbers (μx of GPA, μy, the lr power of
// Schedule-Free; the defaults of the other alternatives where a config has no such field).
struct AveragingParts {
  int64_t kind = 0;
  GeneralizedPrimalAveragingConfig gpa;
  ScheduleFreeConfig schedule_free;
};
AveragingParts averaging_parts(const ShampooOptions& o) {
  AveragingParts p;
  p.kind = static_cast<int64_t>(o.iterate_averaging().index());
  if (const auto* c = std::get_if<GeneralizedPrimalAveragingConfig>(&o.iterate_averaging())) {
    p.gpa = *c;
  }
  if (const auto* c = std::get_if<ScheduleFreeConfig>(&o.iterate_averaging())) {
    p.schedule_free = *c;
  }
  return p;
}

/// (eval_interp_coeff, train_interp_coeff, eval_coeff_lr_power) of the active alternative.
std::array<double, 3> averaging_numbers(const AveragingParts& p) {
  if (p.kind == 1) return {p.gpa.eval_interp_coeff, p.gpa.train_interp_coeff, 0.0};
  if (p.kind == 2) {
    return {0.0, p.schedule_free.train_interp_coeff, p.schedule_free.eval_coeff_lr_power};
  }
  return {0.0, 0.0, 0.0};
}

constexpr std::array<const char*, 3> kAveragingNumberKeys = {
    "iterate_averaging_eval_interp_coeff", "iterate_averaging_train_interp_coeff",
    "iterate_averaging_eval_coeff_lr_power"};

std::string describe_averaging(const ShampooOptions& o) {
  const auto& a = o.iterate_averaging();
  if (const auto* c = std::get_if<GeneralizedPrimalAveragingConfig>(&a)) {
    return c10::str("GeneralizedPrimalAveragingConfig (eval_interp_coeff ", c->eval_interp_coeff,
                    ", train_interp_coeff ", c->train_interp_coeff, ")");
  }
  if (const auto* c = std::get_if<ScheduleFreeConfig>(&a)) {
    return c10::str("ScheduleFreeConfig (train_interp_coeff ", c->train_interp_coeff,
                    ", eval_coeff_lr_power ", c->eval_coeff_lr_power, ")");
  }
  return "none";
}

// Added after format 2 was fixed: an archive without these entries keeps no averaging.
void read_averaging(InputArchive& a, ShampooOptions& o) {
  if (!option_archive::has_entry(a, "iterate_averaging_kind")) {
    o.iterate_averaging(std::monostate{});
    return;
  }
  const int64_t kind = option_archive::read_index(a, "iterate_averaging_kind",
                                                  std::variant_size_v<IterateAveragingConfig>);
  std::array<double, 3> v{};
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = option_archive::read_double(a, kAveragingNumberKeys[i]);
  if (kind == 1) {
    o.iterate_averaging(GeneralizedPrimalAveragingConfig{v[0], v[1]});
  } else if (kind == 2) {
    o.iterate_averaging(ScheduleFreeConfig{v[1], v[2]});
  } else {
    o.iterate_averaging(std::monostate{});
  }
}

}  // namespace

OptionField iterate_averaging_field() {
  OptionField f;
  f.name = "iterate_averaging";
  f.kind = OptionKind::kStructural;
  f.archive_keys = {"iterate_averaging_kind", kAveragingNumberKeys[0], kAveragingNumberKeys[1],
                    kAveragingNumberKeys[2]};
  f.code = [](const ShampooOptions& o) {
    const auto p = averaging_parts(o);
    std::vector<int64_t> code{p.kind};
    for (const double x : averaging_numbers(p)) code.push_back(option_archive::double_bits(x));
    return code;
  };
  f.describe = describe_averaging;
  f.write = [](const ShampooOptions& o, OutputArchive& a) {
    const auto p = averaging_parts(o);
    a.write("iterate_averaging_kind", c10::IValue(p.kind));
    const auto numbers = averaging_numbers(p);
    for (size_t i = 0; i < numbers.size(); ++i) {
      a.write(kAveragingNumberKeys[i], c10::IValue(numbers[i]));
    }
  };
  f.read = read_averaging;
  f.copy = [](const ShampooOptions& from, ShampooOptions& to) {
    to.iterate_averaging(from.iterate_averaging());
  };
  return f;
}

}  // namespace shampoo::detail
