#pragma once
/// The command-line flags of the example programs and the benchmarks, parsed by CLI11: every flag
/// is bound to the variable it fills, whose value before parse() is the default shown by --help.
/// `--name value` or `--name=value`; a flag given twice takes the last value. Boolean flags are
/// set with `--name` (true) or `--name=true|false` (also 1/0, yes/no, on/off); choice flags accept
/// only their listed values. Every error names the flag, the value and what is allowed:
///   --lr: got 'fast', expected a number
///   --optimizer: got 'adam', expected one of sgd, adam, adamw, shampoo

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace CLI {
class App;
}  // namespace CLI

namespace shampoo::examples {

class CommandLine {
 public:
  /// `summary` follows the usage line of --help.
  CommandLine(std::string program, std::string summary);
  ~CommandLine();
  CommandLine(const CommandLine&) = delete;
  CommandLine& operator=(const CommandLine&) = delete;

  /// `--name <value>`: a whole number, at least `min` when given.
  CommandLine& add(const std::string& name, int64_t& value, std::string help,
                   std::optional<int64_t> min = std::nullopt);
  /// `--name <value>`: a number, at least `min` when given.
  CommandLine& add(const std::string& name, double& value, std::string help,
                   std::optional<double> min = std::nullopt);
  /// `--name <value>`: any text ("" shows as "none" in --help).
  CommandLine& add(const std::string& name, std::string& value, std::string help);
  /// `--name <value>`: a path ("" shows as "none" in --help).
  CommandLine& add(const std::string& name, std::filesystem::path& value, std::string help);
  /// `--name <value>`: a number; left unset (shown as `none_means` in --help) unless given.
  CommandLine& add(const std::string& name, std::optional<double>& value, std::string help,
                   const std::string& none_means);
  /// `--name[=true|false]`: `--name` alone sets true and never takes the next argument.
  CommandLine& add_bool(const std::string& name, bool& value, std::string help);
  /// `--name {a,b,...}`: one of `choices`; `value`'s initial text must be one of them.
  CommandLine& add_choice(const std::string& name, std::string& value,
                          std::vector<std::string> choices, std::string help);
  /// `--name {a,b,...}`: one of the names of `choices`, which sets `value` to the paired value;
  /// `value`'s initial value must be one of them (its name is the default).
  template <typename T>
  CommandLine& add_choice(const std::string& name, T& value,
                          const std::vector<std::pair<std::string, T>>& choices, std::string help) {
    std::vector<std::string> names;
    std::optional<size_t> current;
    for (size_t i = 0; i < choices.size(); ++i) {
      names.push_back(choices[i].first);
      if (!current && choices[i].second == value) current = i;
    }
    return add_choice_index(
        name, std::move(names), current, [&value, choices](size_t i) { value = choices[i].second; },
        std::move(help));
  }
  /// `--name <value>`: comma-separated numbers ("0.9,0.999"), exactly `count` of them when given
  /// (`count_meaning` names them in the error, e.g. "beta1,beta2"), every one at least `min` when
  /// given; empty text gives an empty list.
  CommandLine& add_list(const std::string& name, std::vector<double>& values, std::string help,
                        std::optional<size_t> count = std::nullopt,
                        const std::string& count_meaning = "",
                        std::optional<double> min = std::nullopt);

  /// Parses argv into the bound variables. Returns false when -h/--help was given (the usage is
  /// then printed to stdout). Throws std::invalid_argument naming the flag on an unknown flag, a
  /// flag without a value, a bad value or a positional argument.
  bool parse(int argc, const char* const* argv);

  /// Whether the flag was given on the command line (not just defaulted).
  bool was_set(const std::string& name) const;

  std::string usage() const;

 private:
  /// `--name {names...}`: calls `on_choice` with the index of the given name; `current` is the
  /// index of the default (nullopt: a programming error, thrown as std::logic_error).
  CommandLine& add_choice_index(const std::string& name, std::vector<std::string> names,
                                std::optional<size_t> current,
                                std::function<void(size_t)> on_choice, std::string help);

  std::unique_ptr<CLI::App> app_;
};

/// `argv` as one line that a shell reproduces (arguments quoted where needed): for logs.
std::string quoted_command_line(int argc, const char* const* argv);

}  // namespace shampoo::examples
