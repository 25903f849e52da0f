#pragma once
/// A small command-line flag parser for the example programs: `--name value` or `--name=value`,
/// every flag declared up front with a default and a help line, `--help` prints the usage.
/// Boolean flags are set with `--name` (true) or `--name=true|false` (also 1/0, yes/no, on/off);
/// choice flags accept only their listed values.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace shampoo::examples {

class CommandLine {
 public:
  CommandLine(std::string program, std::string summary);

  /// Declares flag `--name` with its default value (as text) and a help line.
  CommandLine& add(const std::string& name, std::string default_value, std::string help);
  /// Declares boolean flag `--name`: `--name` alone sets it true, `--name=false` false.
  CommandLine& add_bool(const std::string& name, bool default_value, std::string help);
  /// Declares flag `--name` that takes one of `choices` (checked by parse()).
  CommandLine& add_choice(const std::string& name, std::vector<std::string> choices,
                          std::string default_value, std::string help);

  /// Parses argv. Returns false when --help was given (the usage is then printed to stdout).
  /// Throws std::invalid_argument on an unknown flag, a flag without a value, a value that is not
  /// one of a choice flag's choices or not a boolean for a boolean flag, or a positional argument.
  bool parse(int argc, const char* const* argv);

  /// The value of a declared flag. The typed getters throw std::invalid_argument naming the flag
  /// when the text is not a whole number / a number.
  const std::string& get_string(const std::string& name) const;
  int64_t get_int(const std::string& name) const;
  double get_double(const std::string& name) const;
  bool get_bool(const std::string& name) const;
  /// A comma-separated list of numbers ("0.9,0.999"); empty text gives an empty list.
  std::vector<double> get_doubles(const std::string& name) const;
  /// Whether the flag was given on the command line (not just defaulted).
  bool was_set(const std::string& name) const;

  std::string usage() const;

 private:
  struct Flag {
    std::string value;
    std::string default_value;
    std::string help;
    bool is_bool = false;
    bool set = false;
    std::vector<std::string> choices;  // empty = any value
  };
  const Flag& flag(const std::string& name) const;

  std::string program_;
  std::string summary_;
  std::vector<std::string> order_;
  std::map<std::string, Flag> flags_;
};

}  // namespace shampoo::examples
