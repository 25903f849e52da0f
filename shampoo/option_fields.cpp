#include "shampoo/option_fields.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <array>
#include <functional>
#include <map>
#include <sstream>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "shampoo/option_archive.h"
#include "update/grafting.h"

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

/// How a value of one type goes into an archive entry, into the code and into a message.
template <typename T>
struct Codec;

template <>
struct Codec<double> {
  static void write(OutputArchive& a, const std::string& key, double v) {
    a.write(key, c10::IValue(v));
  }
  static double read(InputArchive& a, const std::string& key) { return read_double(a, key); }
  static int64_t code(double v) { return double_bits(v); }
  static std::string describe(double v) { return c10::str(v); }
};

template <>
struct Codec<int64_t> {
  static void write(OutputArchive& a, const std::string& key, int64_t v) {
    a.write(key, c10::IValue(v));
  }
  static int64_t read(InputArchive& a, const std::string& key) { return read_int(a, key); }
  static int64_t code(int64_t v) { return v; }
  static std::string describe(int64_t v) { return c10::str(v); }
};

template <>
struct Codec<bool> {
  static void write(OutputArchive& a, const std::string& key, bool v) {
    a.write(key, c10::IValue(static_cast<int64_t>(v)));
  }
  static bool read(InputArchive& a, const std::string& key) { return read_index(a, key, 2) != 0; }
  static int64_t code(bool v) { return v ? 1 : 0; }
  static std::string describe(bool v) { return v ? "true" : "false"; }
};

template <>
struct Codec<WeightDecayType> {
  static void write(OutputArchive& a, const std::string& key, WeightDecayType v) {
    a.write(key, c10::IValue(static_cast<int64_t>(v)));
  }
  static WeightDecayType read(InputArchive& a, const std::string& key) {
    return static_cast<WeightDecayType>(read_index(a, key, 4));
  }
  static int64_t code(WeightDecayType v) { return static_cast<int64_t>(v); }
  static std::string describe(WeightDecayType v) {
    static constexpr std::array<const char*, 4> kNames = {"kL2", "kDecoupled", "kCorrected",
                                                          "kIndependent"};
    return kNames.at(static_cast<size_t>(v));
  }
};

template <>
struct Codec<CompactState> {
  static void write(OutputArchive& a, const std::string& key, CompactState v) {
    a.write(key, c10::IValue(static_cast<int64_t>(v)));
  }
  static CompactState read(InputArchive& a, const std::string& key) {
    return static_cast<CompactState>(read_index(a, key, 3));
  }
  static int64_t code(CompactState v) { return static_cast<int64_t>(v); }
  static std::string describe(CompactState v) {
    switch (v) {
      case CompactState::kNone:
        return "kNone";
      case CompactState::kBfloat16:
        return "kBfloat16";
      case CompactState::kInt8:
        return "kInt8";
    }
    return "?";
  }
};

template <>
struct Codec<c10::ScalarType> {
  static void write(OutputArchive& a, const std::string& key, c10::ScalarType v) {
    a.write(key, c10::IValue(static_cast<int64_t>(v)));
  }
  static c10::ScalarType read(InputArchive& a, const std::string& key) {
    return static_cast<c10::ScalarType>(
        read_index(a, key, static_cast<int64_t>(c10::ScalarType::NumOptions)));
  }
  static int64_t code(c10::ScalarType v) { return static_cast<int64_t>(v); }
  static std::string describe(c10::ScalarType v) { return c10::toString(v); }
};

/// A field of one value of type T, stored under its own name.
template <typename T, typename Get, typename Set>
OptionField simple_field(const std::string& name, OptionKind kind, Get get, Set set) {
  OptionField f;
  f.name = name;
  f.kind = kind;
  f.archive_keys = {name};
  f.code = [get](const ShampooOptions& o) { return std::vector<int64_t>{Codec<T>::code(get(o))}; };
  f.describe = [get](const ShampooOptions& o) { return Codec<T>::describe(get(o)); };
  f.write = [get, name](const ShampooOptions& o, OutputArchive& a) {
    Codec<T>::write(a, name, get(o));
  };
  f.read = [set, name](InputArchive& a, ShampooOptions& o) { set(o, Codec<T>::read(a, name)); };
  f.copy = [get, set](const ShampooOptions& from, ShampooOptions& to) { set(to, get(from)); };
  return f;
}

#define SHAMPOO_SIMPLE_OPTION(type, field, kind)                                           \
  simple_field<type>(                                                                      \
      #field, OptionKind::kind, [](const ShampooOptions& o) -> type { return o.field(); }, \
      [](ShampooOptions& o, type v) { o.field(v); })

/// A storage choice (use_symmetric_packing, compact_state, factor_matrix_dtype,
/// factored_grafting): checkpoints hold
/// the state in a form that loads into any value (entries convert to the optimizer's dtype and
/// layout), so the field is not compared on load, and archives written before the option existed
/// have no entry and keep the optimizer's value.
OptionField storage_layout_field(OptionField f) {
  f.storage_layout = true;
  f.read = [read = f.read, key = f.name](InputArchive& a, ShampooOptions& o) {
    if (has_entry(a, key)) read(a, o);
  };
  return f;
}

/// A field added after checkpoints existed: an archive without its entry was written by an
/// optimizer that behaved as `before` does (the reference's behaviour), and reads as that.
OptionField added_field(OptionField f, std::function<void(ShampooOptions&)> before) {
  f.read = [read = f.read, key = f.name, before = std::move(before)](InputArchive& a,
                                                                     ShampooOptions& o) {
    if (has_entry(a, key)) {
      read(a, o);
    } else {
      before(o);
    }
  };
  return f;
}

OptionField betas_field() {
  OptionField f;
  f.name = "betas";
  f.kind = OptionKind::kFloat;
  f.archive_keys = {"beta1", "beta2"};
  f.code = [](const ShampooOptions& o) {
    return std::vector<int64_t>{double_bits(std::get<0>(o.betas())),
                                double_bits(std::get<1>(o.betas()))};
  };
  f.describe = [](const ShampooOptions& o) {
    return c10::str("(", std::get<0>(o.betas()), ", ", std::get<1>(o.betas()), ")");
  };
  f.write = [](const ShampooOptions& o, OutputArchive& a) {
    a.write("beta1", c10::IValue(std::get<0>(o.betas())));
    a.write("beta2", c10::IValue(std::get<1>(o.betas())));
  };
  f.read = [](InputArchive& a, ShampooOptions& o) {
    o.betas(std::make_tuple(read_double(a, "beta1"), read_double(a, "beta2")));
  };
  f.copy = [](const ShampooOptions& from, ShampooOptions& to) { to.betas(from.betas()); };
  return f;
}

OptionField start_preconditioning_step_field() {
  auto f = SHAMPOO_SIMPLE_OPTION(int64_t, start_preconditioning_step, kStructural);
  // −1 means precondition_frequency: compared resolved.
  f.code = [](const ShampooOptions& o) {
    return std::vector<int64_t>{o.resolved_start_preconditioning_step()};
  };
  f.describe = [](const ShampooOptions& o) -> std::string {
    if (o.start_preconditioning_step() == -1) {
      return c10::str("-1 (= precondition_frequency = ", o.precondition_frequency(), ")");
    }
    if (o.start_preconditioning_step() == kNeverStartPreconditioning) {
      return "kNeverStartPreconditioning";
    }
    return c10::str(o.start_preconditioning_step());
  };
  return f;
}

// Grafting: the kind (the variant's alternative, update/grafting.h) and
// drop_weighting_factor_on_gsquare are structural, its beta2 and epsilon are floats.
bool grafting_drops_weighting(const GraftingConfig& config) {
  return std::visit(
      [](const auto& g) {
        if constexpr (requires { g.drop_weighting_factor_on_gsquare; }) {
          return g.drop_weighting_factor_on_gsquare;
        } else {
          return false;
        }
      },
      config);
}

/// The default config of `kind` with drop_weighting_factor_on_gsquare set where it has one.
GraftingConfig grafting_of_kind(GraftingKind kind, bool drop_weighting) {
  auto config = default_grafting(kind);
  std::visit(
      [&](auto& g) {
        if constexpr (requires { g.drop_weighting_factor_on_gsquare; }) {
          g.drop_weighting_factor_on_gsquare = drop_weighting;
        }
      },
      config);
  return config;
}

constexpr const char* kGraftingDropKey = "grafting_drop_weighting_factor_on_gsquare";

OptionField grafting_kind_field() {
  OptionField f;
  f.name = "grafting kind";
  f.kind = OptionKind::kStructural;
  f.archive_keys = {"grafting_kind", kGraftingDropKey};
  f.code = [](const ShampooOptions& o) {
    return std::vector<int64_t>{static_cast<int64_t>(grafting_kind(o.grafting())),
                                grafting_drops_weighting(o.grafting()) ? 1 : 0};
  };
  f.describe = [](const ShampooOptions& o) {
    const std::string name = grafting_method(grafting_kind(o.grafting())).name;
    return grafting_drops_weighting(o.grafting()) ? name + " (drop_weighting_factor_on_gsquare)"
                                                  : name;
  };
  f.write = [](const ShampooOptions& o, OutputArchive& a) {
    a.write("grafting_kind", c10::IValue(static_cast<int64_t>(grafting_kind(o.grafting()))));
    a.write(kGraftingDropKey, c10::IValue(int64_t{grafting_drops_weighting(o.grafting()) ? 1 : 0}));
  };
  // Checkpoints written before grafting configs were the diagonal configs have no drop entry.
  f.read = [](InputArchive& a, ShampooOptions& o) {
    const auto kind = static_cast<GraftingKind>(read_index(a, "grafting_kind", kGraftingKinds));
    const bool drop = has_entry(a, kGraftingDropKey) && read_index(a, kGraftingDropKey, 2) != 0;
    o.grafting(grafting_of_kind(kind, drop));
  };
  f.copy = [](const ShampooOptions& from, ShampooOptions& to) {
    const auto kind = grafting_kind(from.grafting());
    const bool drop = grafting_drops_weighting(from.grafting());
    if (grafting_kind(to.grafting()) != kind || grafting_drops_weighting(to.grafting()) != drop) {
      to.grafting(grafting_of_kind(kind, drop));
    }
  };
  return f;
}

OptionField grafting_floats_field() {
  OptionField f;
  f.name = "grafting floats";
  f.kind = OptionKind::kFloat;
  f.archive_keys = {"grafting_beta2", "grafting_epsilon"};
  f.code = [](const ShampooOptions& o) {
    const auto floats = grafting_floats(o.grafting());
    return std::vector<int64_t>{double_bits(floats.beta2), double_bits(floats.epsilon)};
  };
  f.describe = [](const ShampooOptions& o) {
    const auto floats = grafting_floats(o.grafting());
    return c10::str("(beta2 ", floats.beta2, ", epsilon ", floats.epsilon, ")");
  };
  f.write = [](const ShampooOptions& o, OutputArchive& a) {
    const auto floats = grafting_floats(o.grafting());
    a.write("grafting_beta2", c10::IValue(floats.beta2));
    a.write("grafting_epsilon", c10::IValue(floats.epsilon));
  };
  // After the grafting kind row: sets the floats of the kind read there.
  f.read = [](InputArchive& a, ShampooOptions& o) {
    o.grafting(with_grafting_floats(
        o.grafting(),
        GraftingFloats{read_double(a, "grafting_beta2"), read_double(a, "grafting_epsilon")}));
  };
  f.copy = [](const ShampooOptions& from, ShampooOptions& to) {
    to.grafting(with_grafting_floats(to.grafting(), grafting_floats(from.grafting())));
  };
  return f;
}

std::vector<OptionField> make_option_fields() {
  return {
      SHAMPOO_SIMPLE_OPTION(double, lr, kFloat),
      betas_field(),
      SHAMPOO_SIMPLE_OPTION(double, beta3, kFloat),
      SHAMPOO_SIMPLE_OPTION(double, epsilon, kFloat),
      added_field(SHAMPOO_SIMPLE_OPTION(double, relative_epsilon, kFloat),
                  [](ShampooOptions& o) { o.relative_epsilon(0.0); }),
      SHAMPOO_SIMPLE_OPTION(double, weight_decay, kFloat),
      SHAMPOO_SIMPLE_OPTION(WeightDecayType, weight_decay_type, kStructural),
      // Checkpoints from before peak_lr: L2 or decoupled decay, which do not read it.
      added_field(SHAMPOO_SIMPLE_OPTION(double, peak_lr, kFloat), [](ShampooOptions&) {}),
      SHAMPOO_SIMPLE_OPTION(double, momentum, kFloat),
      SHAMPOO_SIMPLE_OPTION(double, dampening, kFloat),
      SHAMPOO_SIMPLE_OPTION(bool, use_nesterov, kStructural),
      SHAMPOO_SIMPLE_OPTION(int64_t, max_preconditioner_dim, kStructural),
      SHAMPOO_SIMPLE_OPTION(bool, use_merge_dims, kStructural),
      added_field(SHAMPOO_SIMPLE_OPTION(bool, precondition_1d, kStructural),
                  [](ShampooOptions& o) { o.precondition_1d(true); }),
      added_field(SHAMPOO_SIMPLE_OPTION(int64_t, max_factored_dim, kStructural),
                  [](ShampooOptions& o) { o.max_factored_dim(-1); }),
      SHAMPOO_SIMPLE_OPTION(int64_t, precondition_frequency, kStructural),
      start_preconditioning_step_field(),
      SHAMPOO_SIMPLE_OPTION(bool, use_bias_correction, kStructural),
      grafting_kind_field(),
      grafting_floats_field(),
      storage_layout_field(
          SHAMPOO_SIMPLE_OPTION(c10::ScalarType, factor_matrix_dtype, kStructural)),
      storage_layout_field(SHAMPOO_SIMPLE_OPTION(bool, use_symmetric_packing, kStructural)),
      storage_layout_field(SHAMPOO_SIMPLE_OPTION(CompactState, compact_state, kStructural)),
      storage_layout_field(SHAMPOO_SIMPLE_OPTION(bool, factored_grafting, kStructural)),
      preconditioner_field(),
      inverse_exponent_override_field(),
      added_field(SHAMPOO_SIMPLE_OPTION(bool, use_trace_scaling, kStructural),
                  [](ShampooOptions& o) { o.use_trace_scaling(false); }),
      added_field(SHAMPOO_SIMPLE_OPTION(double, trace_scaling_exponent, kStructural),
                  [](ShampooOptions& o) { o.trace_scaling_exponent(0.5); }),
      SHAMPOO_SIMPLE_OPTION(int64_t, num_tolerated_failed_amortized_computations, kStructural),
      iterate_averaging_field(),
  };
}

#undef SHAMPOO_SIMPLE_OPTION

}  // namespace

const std::vector<OptionField>& option_fields() {
  static const std::vector<OptionField> fields = make_option_fields();
  return fields;
}

std::string option_names(OptionKind kind) {
  std::string names;
  for (const auto& field : option_fields()) {
    if (field.kind != kind) continue;
    if (!names.empty()) names += ", ";
    names += field.name;
  }
  return names;
}

const OptionField* structural_difference(const ShampooOptions& a, const ShampooOptions& b,
                                         bool for_checkpoint) {
  for (const auto& field : option_fields()) {
    if (for_checkpoint && field.storage_layout) continue;
    if (field.kind == OptionKind::kStructural && field.code(a) != field.code(b)) return &field;
  }
  return nullptr;
}

std::string describe_difference(const OptionField& field, const ShampooOptions& got,
                                const ShampooOptions& expected) {
  return c10::str(field.name, ": got ", field.describe(got), ", expected ",
                  field.describe(expected));
}

}  // namespace shampoo::detail
