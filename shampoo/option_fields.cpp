#include "shampoo/option_fields.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <sstream>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>

namespace shampoo::detail {
namespace {

using torch::serialize::InputArchive;
using torch::serialize::OutputArchive;

c10::IValue read_entry(InputArchive& archive, const std::string& key) {
  c10::IValue value;
  TORCH_CHECK(archive.try_read(key, value), "ShampooOptions archive: entry '", key, "' is missing");
  return value;
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

/// An int entry that must lie in [0, count).
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
    return static_cast<WeightDecayType>(read_index(a, key, 2));
  }
  static int64_t code(WeightDecayType v) { return static_cast<int64_t>(v); }
  static std::string describe(WeightDecayType v) {
    return v == WeightDecayType::kL2 ? "kL2" : "kDecoupled";
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

// Grafting: the kind (the variant's alternative, update/grafting.h) is structural, its beta2 and
// epsilon are floats.
OptionField grafting_kind_field() {
  OptionField f;
  f.name = "grafting kind";
  f.kind = OptionKind::kStructural;
  f.archive_keys = {"grafting_kind"};
  const auto code = [](const ShampooOptions& o) {
    return static_cast<int64_t>(grafting_kind(o.grafting()));
  };
  f.code = [code](const ShampooOptions& o) { return std::vector<int64_t>{code(o)}; };
  f.describe = [](const ShampooOptions& o) {
    return std::string(grafting_method(grafting_kind(o.grafting())).name);
  };
  f.write = [code](const ShampooOptions& o, OutputArchive& a) {
    a.write("grafting_kind", c10::IValue(code(o)));
  };
  f.read = [](InputArchive& a, ShampooOptions& o) {
    o.grafting(default_grafting(
        static_cast<GraftingKind>(read_index(a, "grafting_kind", kGraftingKinds))));
  };
  f.copy = [](const ShampooOptions& from, ShampooOptions& to) {
    if (grafting_kind(to.grafting()) != grafting_kind(from.grafting())) {
      to.grafting(default_grafting(grafting_kind(from.grafting())));
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

// The descent and diagonal families (SpectralDescentConfig ... AdamPreconditionerConfig): each
// family lists its fields once, as (archive key, name in messages, member); the code, the
// description and the archive entries of the preconditioner row are made from that list.
template <typename C, typename F>
requires std::is_same_v<std::remove_const_t<C>, SpectralDescentConfig>
void family_fields(C& c, F&& f) {
  f("preconditioner_spectral_method", "method", c.method);
  f("preconditioner_spectral_num_iterations", "num_iterations", c.num_iterations);
  f("preconditioner_spectral_coefficients", "coefficients", c.coefficients);
  f("preconditioner_spectral_scale_by_nuclear_norm", "scale_by_nuclear_norm",
    c.scale_by_nuclear_norm);
  f("preconditioner_spectral_scale", "scale", c.scale);
}
template <typename C, typename F>
requires std::is_same_v<std::remove_const_t<C>, SignDescentConfig>
void family_fields(C& c, F&& f) { f("preconditioner_sign_scale", "scale", c.scale); }
template <typename C, typename F>
requires std::is_same_v<std::remove_const_t<C>, SGDPreconditionerConfig>
void family_fields(C& /*c*/, F&& /*f*/) {}
template <typename C, typename F>
requires std::is_same_v<std::remove_const_t<C>, AdaGradPreconditionerConfig>
void family_fields(C& c, F&& f) { f("preconditioner_adagrad_epsilon", "epsilon", c.epsilon); }
template <typename C, typename F>
requires std::is_same_v<std::remove_const_t<C>, RMSpropPreconditionerConfig>
void family_fields(C& c, F&& f) {
  f("preconditioner_rmsprop_beta2", "beta2", c.beta2);
  f("preconditioner_rmsprop_epsilon", "epsilon", c.epsilon);
  f("preconditioner_rmsprop_drop_weighting_factor_on_gsquare", "drop_weighting_factor_on_gsquare",
    c.drop_weighting_factor_on_gsquare);
}
template <typename C, typename F>
requires std::is_same_v<std::remove_const_t<C>, AdamPreconditionerConfig>
void family_fields(C& c, F&& f) {
  f("preconditioner_adam_beta2", "beta2", c.beta2);
  f("preconditioner_adam_epsilon", "epsilon", c.epsilon);
  f("preconditioner_adam_drop_weighting_factor_on_gsquare", "drop_weighting_factor_on_gsquare",
    c.drop_weighting_factor_on_gsquare);
}

template <typename C>
concept FieldListed = requires(const C& c) {
  family_fields(c, [](auto&&...) {});
};

/// The families with a field list, in variant order.
using ListedFamilies =
    std::tuple<SpectralDescentConfig, SignDescentConfig, SGDPreconditionerConfig,
               AdaGradPreconditionerConfig, RMSpropPreconditionerConfig, AdamPreconditionerConfig>;

const char* family_name(const RootInvShampooConfig&) { return "root-inverse Shampoo"; }
const char* family_name(const RootInvKLShampooConfig&) { return "root-inverse KL-Shampoo"; }
const char* family_name(const EigenvalueCorrectedShampooConfig&) {
  return "eigenvalue-corrected Shampoo";
}
const char* family_name(const EigendecomposedShampooConfig&) { return "eigendecomposed Shampoo"; }
const char* family_name(const EigendecomposedKLShampooConfig&) {
  return "eigendecomposed KL-Shampoo";
}
const char* family_name(const SpectralDescentConfig&) { return "spectral descent"; }
const char* family_name(const SignDescentConfig&) { return "sign descent"; }
const char* family_name(const SGDPreconditionerConfig&) { return "SGD preconditioner"; }
const char* family_name(const AdaGradPreconditionerConfig&) { return "AdaGrad preconditioner"; }
const char* family_name(const RMSpropPreconditionerConfig&) { return "RMSprop preconditioner"; }
const char* family_name(const AdamPreconditionerConfig&) { return "Adam preconditioner"; }

/// Names of the enumerators of the family fields' enums, in value order.
std::vector<const char*> enum_names(OrthogonalizationMethod) { return {"kNewtonSchulz", "kSVD"}; }
std::vector<const char*> enum_names(OrthogonalizationScale) { return {"kOne", "kSqrtAspectRatio"}; }
std::vector<const char*> enum_names(SignDescentScale) { return {"kOne", "kL1Norm"}; }

// A family field's value: its code, its text, its archive entry.
void append_code(int64_t v, std::vector<int64_t>& out) { out.push_back(v); }
void append_code(double v, std::vector<int64_t>& out) { out.push_back(double_bits(v)); }
void append_code(bool v, std::vector<int64_t>& out) { out.push_back(v ? 1 : 0); }
void append_code(const std::array<double, 3>& v, std::vector<int64_t>& out) {
  for (const double x : v) out.push_back(double_bits(x));
}
template <typename E>
requires std::is_enum_v<E>
void append_code(E v, std::vector<int64_t>& out) { out.push_back(static_cast<int64_t>(v)); }

std::string value_text(int64_t v) { return c10::str(v); }
std::string value_text(double v) { return c10::str(v); }
std::string value_text(bool v) { return v ? "true" : "false"; }
std::string value_text(const std::array<double, 3>& v) {
  return c10::str("(", v[0], ", ", v[1], ", ", v[2], ")");
}
template <typename E>
requires std::is_enum_v<E> std::string value_text(E v) {
  const auto names = enum_names(v);
  const auto i = static_cast<size_t>(v);
  return i < names.size() ? names[i] : c10::str(static_cast<int64_t>(v));
}

c10::IValue archive_value(int64_t v) { return c10::IValue(v); }
c10::IValue archive_value(double v) { return c10::IValue(v); }
c10::IValue archive_value(bool v) { return c10::IValue(int64_t{v ? 1 : 0}); }
c10::IValue archive_value(const std::array<double, 3>& v) {
  return c10::IValue(std::vector<double>(v.begin(), v.end()));
}
template <typename E>
requires std::is_enum_v<E> c10::IValue archive_value(E v) {
  return c10::IValue(static_cast<int64_t>(v));
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
template <typename E>
requires std::is_enum_v<E>
void read_value(InputArchive& a, const std::string& key, E& v) {
  v = static_cast<E>(read_index(a, key, static_cast<int64_t>(enum_names(v).size())));
}

bool has_entry(InputArchive& a, const std::string& key) {
  c10::IValue value;
  return a.try_read(key, value);
}

/// The root solver of a preconditioner config as (solver, max_iterations, tolerance bits, tf32);
/// zeros for the other families.
std::vector<int64_t> root_solver_parts(const PreconditionerConfig& config) {
  const auto* c = root_inverse_config(config);
  if (c == nullptr) return {0, 0, 0, 0};
  return {static_cast<int64_t>(c->solver), c->max_iterations, double_bits(c->tolerance),
          c->tf32 ? 1 : 0};
}

std::string describe_root_solver(const RootInvShampooConfig& c) {
  constexpr const char* kNames[] = {"kEigh", "kCoupledNewton", "kNewtonDB"};
  const auto name = kNames[static_cast<int>(c.solver)];
  if (c.solver == RootSolver::kEigh) return c10::str("solver ", name);
  return c10::str("solver ", name, ", max_iterations ", c.max_iterations, ", tolerance ",
                  c.tolerance, ", tf32 ", c.tf32 ? "true" : "false");
}

/// The rank-deficient stability of a config as (kind, rank_atol bits, rank_rtol bits); zeros for
/// the perturbation and for configs without one.
std::vector<int64_t> stability_parts(const PreconditionerConfig& config) {
  const auto* stability = rank_deficient_stability(config);
  const auto* c = stability != nullptr ? std::get_if<PseudoInverseConfig>(stability) : nullptr;
  if (c == nullptr) return {0, 0, 0};
  return {static_cast<int64_t>(stability->index()), double_bits(c->rank_atol),
          double_bits(c->rank_rtol)};
}

std::string describe_stability(const RankDeficientStabilityConfig& stability) {
  const auto* c = std::get_if<PseudoInverseConfig>(&stability);
  if (c == nullptr) return "rank_deficient_stability perturbation";
  return c10::str(
      "rank_deficient_stability pseudo-inverse (rank_atol ", c->rank_atol, ", rank_rtol ",
      c->rank_rtol == kDtypeRankRtol ? std::string("d * machine epsilon") : c10::str(c->rank_rtol),
      ")");
}

/// (kind, retry_double_precision or 0, eigenbasis_method or 0, root_solver_parts...,
/// stability_parts..., the fields of a listed family...): equal exactly when the family and all
/// its fields are.
std::vector<int64_t> preconditioner_parts(const ShampooOptions& o) {
  std::vector<int64_t> out{static_cast<int64_t>(o.preconditioner().index())};
  std::visit(
      [&](const auto& c) {
        using C = std::decay_t<decltype(c)>;
        int64_t retry = 0;
        int64_t method = 0;
        if constexpr (requires { c.retry_double_precision; }) retry = c.retry_double_precision;
        if constexpr (requires { c.eigenbasis_method; }) {
          method = static_cast<int64_t>(c.eigenbasis_method);
        }
        out.insert(out.end(), {retry, method});
        const auto solver = root_solver_parts(o.preconditioner());
        out.insert(out.end(), solver.begin(), solver.end());
        const auto stability = stability_parts(o.preconditioner());
        out.insert(out.end(), stability.begin(), stability.end());
        if constexpr (FieldListed<C>) {
          family_fields(c, [&](const char*, const char*, const auto& v) { append_code(v, out); });
        }
      },
      o.preconditioner());
  return out;
}

std::string describe_preconditioner(const ShampooOptions& o) {
  return std::visit(
      [](const auto& c) -> std::string {
        using C = std::decay_t<decltype(c)>;
        if constexpr (FieldListed<C>) {
          std::vector<std::string> parts;
          family_fields(c, [&](const char*, const char* name, const auto& v) {
            parts.push_back(c10::str(name, " ", value_text(v)));
          });
          if (parts.empty()) return family_name(c);
          return c10::str(family_name(c), " (", c10::Join(", ", parts), ")");
        } else {
          const char* retry = c.retry_double_precision ? "true" : "false";
          if constexpr (std::is_same_v<C, EigenvalueCorrectedShampooConfig>) {
            return c10::str(family_name(c), " (eigenbasis_method ",
                            c.eigenbasis_method == EigenbasisMethod::kQR ? "kQR" : "kEigh",
                            ", retry_double_precision ", retry, ")");
          } else if constexpr (std::is_base_of_v<EigendecomposedShampooConfig, C>) {
            return c10::str(family_name(c), " (eigenbasis_method ",
                            c.eigenbasis_method == EigenbasisMethod::kQR ? "kQR" : "kEigh",
                            ", retry_double_precision ", retry, ", ",
                            describe_stability(c.rank_deficient_stability), ")");
          } else {
            return c10::str(family_name(c), " (retry_double_precision ", retry, ", ",
                            describe_root_solver(c), ", ",
                            describe_stability(c.rank_deficient_stability), ")");
          }
        }
      },
      o.preconditioner());
}

/// Every listed family's entries: the active family's values, the defaults for the others.
void write_listed_families(const ShampooOptions& o, OutputArchive& a) {
  std::apply(
      [&](auto... family) {
        (family_fields(
             std::get_if<decltype(family)>(&o.preconditioner()) != nullptr
                 ? std::get<decltype(family)>(o.preconditioner())
                 : family,
             [&](const char* key, const char*, const auto& v) { a.write(key, archive_value(v)); }),
         ...);
      },
      ListedFamilies{});
}

void write_preconditioner(const ShampooOptions& o, OutputArchive& a) {
  const auto p = preconditioner_parts(o);
  a.write("preconditioner_kind", c10::IValue(p[0]));
  a.write("preconditioner_retry_double_precision", c10::IValue(p[1]));
  a.write("preconditioner_eigenbasis_method", c10::IValue(p[2]));
  const auto* c = root_inverse_config(o.preconditioner());
  const RootInvShampooConfig solver = c != nullptr ? *c : RootInvShampooConfig{};
  a.write("preconditioner_root_solver", c10::IValue(static_cast<int64_t>(solver.solver)));
  a.write("preconditioner_max_iterations", c10::IValue(solver.max_iterations));
  a.write("preconditioner_tolerance", c10::IValue(solver.tolerance));
  a.write("preconditioner_tf32", c10::IValue(int64_t{solver.tf32 ? 1 : 0}));
  const auto* stability = rank_deficient_stability(o.preconditioner());
  const auto* pseudo_inverse =
      stability != nullptr ? std::get_if<PseudoInverseConfig>(stability) : nullptr;
  const auto pinv = pseudo_inverse != nullptr ? *pseudo_inverse : PseudoInverseConfig{};
  a.write("preconditioner_rank_deficient_stability",
          c10::IValue(int64_t{pseudo_inverse != nullptr ? 1 : 0}));
  a.write("preconditioner_pseudo_inverse_rank_atol", c10::IValue(pinv.rank_atol));
  a.write("preconditioner_pseudo_inverse_rank_rtol", c10::IValue(pinv.rank_rtol));
  write_listed_families(o, a);
}

/// The rank-deficient stability entries; the perturbation (the default) when they are absent, as
/// in checkpoints written before the pseudo-inverse existed.
RankDeficientStabilityConfig read_stability(InputArchive& a) {
  if (!has_entry(a, "preconditioner_rank_deficient_stability")) return PerturbationConfig{};
  const int64_t kind = read_index(a, "preconditioner_rank_deficient_stability",
                                  std::variant_size_v<RankDeficientStabilityConfig>);
  if (kind == 0) return PerturbationConfig{};
  return PseudoInverseConfig{read_double(a, "preconditioner_pseudo_inverse_rank_atol"),
                             read_double(a, "preconditioner_pseudo_inverse_rank_rtol")};
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
  const bool retry = read_index(a, "preconditioner_retry_double_precision", 2) != 0;
  const auto method =
      static_cast<EigenbasisMethod>(read_index(a, "preconditioner_eigenbasis_method", 2));
  auto config =
      default_preconditioner(static_cast<size_t>(kind),
                             std::make_index_sequence<std::variant_size_v<PreconditionerConfig>>{});
  std::visit(
      [&](auto& c) {
        using C = std::decay_t<decltype(c)>;
        if constexpr (FieldListed<C>) {
          // Entries added with the family: an archive without them keeps the defaults.
          family_fields(c, [&](const char* key, const char*, auto& v) {
            if (has_entry(a, key)) read_value(a, key, v);
          });
        } else if constexpr (std::is_same_v<C, EigenvalueCorrectedShampooConfig>) {
          c = EigenvalueCorrectedShampooConfig{method, retry};
        } else if constexpr (std::is_base_of_v<EigendecomposedShampooConfig, C>) {
          // Eigendecomposed Shampoo or KL-Shampoo: the same fields.
          static_cast<EigendecomposedShampooConfig&>(c) =
              EigendecomposedShampooConfig{method, retry, read_stability(a)};
        } else {
          c.retry_double_precision = retry;
          c.solver = static_cast<RootSolver>(read_index(a, "preconditioner_root_solver", 3));
          c.max_iterations = read_int(a, "preconditioner_max_iterations");
          c.tolerance = read_double(a, "preconditioner_tolerance");
          c.tf32 = read_index(a, "preconditioner_tf32", 2) != 0;
          c.rank_deficient_stability = read_stability(a);
        }
      },
      config);
  o.preconditioner(config);
}

/// Archive keys of the preconditioner row: the original seven, the rank-deficient stability's, then
/// every listed family's.
std::vector<std::string> preconditioner_archive_keys() {
  std::vector<std::string> keys{"preconditioner_kind",
                                "preconditioner_retry_double_precision",
                                "preconditioner_eigenbasis_method",
                                "preconditioner_root_solver",
                                "preconditioner_max_iterations",
                                "preconditioner_tolerance",
                                "preconditioner_tf32",
                                "preconditioner_rank_deficient_stability",
                                "preconditioner_pseudo_inverse_rank_atol",
                                "preconditioner_pseudo_inverse_rank_rtol"};
  std::apply(
      [&](auto... family) {
        (family_fields(family,
                       [&](const char* key, const char*, const auto&) { keys.push_back(key); }),
         ...);
      },
      ListedFamilies{});
  return keys;
}

OptionField preconditioner_field() {
  OptionField f;
  f.name = "preconditioner";
  f.kind = OptionKind::kStructural;
  f.archive_keys = preconditioner_archive_keys();
  f.code = preconditioner_parts;
  f.describe = describe_preconditioner;
  f.write = write_preconditioner;
  f.read = read_preconditioner;
  f.copy = [](const ShampooOptions& from, ShampooOptions& to) {
    to.preconditioner(from.preconditioner());
  };
  return f;
}

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
  const auto value = read_entry(a, "inverse_exponent_override");
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

OptionField inverse_exponent_override_field() {
  OptionField f;
  f.name = "inverse_exponent_override";
  f.kind = OptionKind::kStructural;
  f.archive_keys = {"inverse_exponent_override"};
  f.code = [](const ShampooOptions& o) {
    std::vector<int64_t> code;
    for (const auto& e : override_entries(o)) {
      code.insert(code.end(), {e.order, e.dim, double_bits(e.exponent)});
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
  if (!has_entry(a, "iterate_averaging_kind")) {
    o.iterate_averaging(std::monostate{});
    return;
  }
  const int64_t kind =
      read_index(a, "iterate_averaging_kind", std::variant_size_v<IterateAveragingConfig>);
  std::array<double, 3> v{};
  for (size_t i = 0; i < v.size(); ++i) v[i] = read_double(a, kAveragingNumberKeys[i]);
  if (kind == 1) {
    o.iterate_averaging(GeneralizedPrimalAveragingConfig{v[0], v[1]});
  } else if (kind == 2) {
    o.iterate_averaging(ScheduleFreeConfig{v[1], v[2]});
  } else {
    o.iterate_averaging(std::monostate{});
  }
}

OptionField iterate_averaging_field() {
  OptionField f;
  f.name = "iterate_averaging";
  f.kind = OptionKind::kStructural;
  f.archive_keys = {"iterate_averaging_kind", kAveragingNumberKeys[0], kAveragingNumberKeys[1],
                    kAveragingNumberKeys[2]};
  f.code = [](const ShampooOptions& o) {
    const auto p = averaging_parts(o);
    std::vector<int64_t> code{p.kind};
    for (const double x : averaging_numbers(p)) code.push_back(double_bits(x));
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

std::vector<OptionField> make_option_fields() {
  return {
      SHAMPOO_SIMPLE_OPTION(double, lr, kFloat),
      betas_field(),
      SHAMPOO_SIMPLE_OPTION(double, beta3, kFloat),
      SHAMPOO_SIMPLE_OPTION(double, epsilon, kFloat),
      SHAMPOO_SIMPLE_OPTION(double, weight_decay, kFloat),
      SHAMPOO_SIMPLE_OPTION(WeightDecayType, weight_decay_type, kStructural),
      SHAMPOO_SIMPLE_OPTION(double, momentum, kFloat),
      SHAMPOO_SIMPLE_OPTION(double, dampening, kFloat),
      SHAMPOO_SIMPLE_OPTION(bool, use_nesterov, kStructural),
      SHAMPOO_SIMPLE_OPTION(int64_t, max_preconditioner_dim, kStructural),
      SHAMPOO_SIMPLE_OPTION(bool, use_merge_dims, kStructural),
      SHAMPOO_SIMPLE_OPTION(int64_t, precondition_frequency, kStructural),
      start_preconditioning_step_field(),
      SHAMPOO_SIMPLE_OPTION(bool, use_bias_correction, kStructural),
      grafting_kind_field(),
      grafting_floats_field(),
      SHAMPOO_SIMPLE_OPTION(c10::ScalarType, factor_matrix_dtype, kStructural),
      preconditioner_field(),
      inverse_exponent_override_field(),
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

const OptionField* structural_difference(const ShampooOptions& a, const ShampooOptions& b) {
  for (const auto& field : option_fields()) {
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
