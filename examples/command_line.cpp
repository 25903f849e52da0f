#include "examples/command_line.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <system_error>
#include <utility>

namespace shampoo::examples {

namespace {

constexpr size_t kUsageWidth = 96;

template <typename T>
std::optional<T> parse_number(const std::string& text) {
  T value{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty()) return std::nullopt;
  return value;
}

std::optional<bool> parse_bool(const std::string& text) {
  if (text == "true" || text == "1" || text == "yes" || text == "on") return true;
  if (text == "false" || text == "0" || text == "no" || text == "off") return false;
  return std::nullopt;
}

/// The numbers of "0.9,0.999"; nullopt when an item is empty or not a number.
std::optional<std::vector<double>> parse_list(const std::string& text) {
  std::vector<double> values;
  if (text.empty()) return values;
  for (size_t begin = 0;;) {
    const size_t comma = text.find(',', begin);
    const auto value = parse_number<double>(
        text.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin));
    if (!value) return std::nullopt;
    values.push_back(*value);
    if (comma == std::string::npos) return values;
    begin = comma + 1;
  }
}

/// A CLI11 check: empty text when `text` is good, else what was expected. CLI11 puts the flag
/// in front: "--lr: got 'fast', expected a number".
CLI::Validator check(std::function<std::string(const std::string&)> problem) {
  return CLI::Validator(
      [problem = std::move(problem)](std::string& text) {
        const std::string expected = problem(text);
        return expected.empty() ? std::string()
                                : fmt::format("got '{}', expected {}", text, expected);
      },
      /*validator_desc=*/"");
}

template <typename T>
CLI::Validator number_at_least(std::optional<T> min, const char* kind) {
  return check([min, kind](const std::string& text) -> std::string {
    const auto value = parse_number<T>(text);
    if (!value) return kind;
    if (min && *value < *min) return fmt::format("{} >= {}", kind, *min);
    return "";
  });
}

/// `text` as lines of at most `width` characters (words are not split), each after `indent`.
std::string wrap(const std::string& text, size_t width, const std::string& indent) {
  std::string out;
  std::string line;
  std::istringstream words(text);
  std::string word;
  while (words >> word) {
    if (!line.empty() && indent.size() + line.size() + 1 + word.size() > width) {
      out += indent + line + "\n";
      line.clear();
    }
    line += (line.empty() ? "" : " ") + word;
  }
  if (!line.empty()) out += indent + line + "\n";
  return out;
}

/// --help as "  --name <value>" and the help text, with its default, wrapped below it.
class UsageFormatter : public CLI::Formatter {
 public:
  std::string make_option(const CLI::Option* option, bool /*is_positional*/) const override {
    const std::string type = option->get_type_name();
    const bool attached = !type.empty() && type.front() == '[';
    return fmt::format("  {}{}{}\n{}", option->get_name(false, true),
                       type.empty() || attached ? "" : " ", type,
                       wrap(option->get_description(), kUsageWidth, "      "));
  }
};

std::string with_default(std::string help, const std::string& value) {
  return fmt::format("{} (default: {})", help, value.empty() ? "none" : value);
}

}  // namespace

CommandLine::CommandLine(std::string program, std::string summary)
    : app_(std::make_unique<CLI::App>(std::move(summary), std::move(program))) {
  app_->formatter(std::make_shared<UsageFormatter>());
  app_->set_help_flag("-h,--help", "print this help and exit");
  // Unknown flags and stray arguments are kept and reported by parse() in our words.
  app_->allow_extras();
}

CommandLine::~CommandLine() = default;

CommandLine& CommandLine::add(const std::string& name, int64_t& value, std::string help,
                              std::optional<int64_t> min) {
  app_->add_option("--" + name, value, with_default(std::move(help), fmt::format("{}", value)))
      ->check(number_at_least(min, "an integer"))
      ->type_name("<value>")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  return *this;
}

CommandLine& CommandLine::add(const std::string& name, double& value, std::string help,
                              std::optional<double> min) {
  app_->add_option("--" + name, value, with_default(std::move(help), fmt::format("{}", value)))
      ->check(number_at_least(min, "a number"))
      ->type_name("<value>")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  return *this;
}

CommandLine& CommandLine::add(const std::string& name, std::string& value, std::string help) {
  app_->add_option("--" + name, value, with_default(std::move(help), value))
      ->type_name("<value>")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  return *this;
}

CommandLine& CommandLine::add(const std::string& name, std::filesystem::path& value,
                              std::string help) {
  app_->add_option_function<std::string>(
          "--" + name, [&value](const std::string& text) { value = text; },
          with_default(std::move(help), value.string()))
      ->type_name("<value>")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  return *this;
}

CommandLine& CommandLine::add(const std::string& name, std::optional<double>& value,
                              std::string help, const std::string& none_means) {
  app_->add_option_function<double>(
          "--" + name, [&value](const double& given) { value = given; },
          with_default(std::move(help), value ? fmt::format("{}", *value) : none_means))
      ->check(number_at_least<double>(std::nullopt, "a number"))
      ->type_name("<value>")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  return *this;
}

CommandLine& CommandLine::add_bool(const std::string& name, bool& value, std::string help) {
  const std::string flag = "--" + name;
  app_->add_flag(flag, value, with_default(std::move(help), value ? "true" : "false"))
      ->check(check([flag](const std::string& text) -> std::string {
        return parse_bool(text) ? "" : fmt::format("true or false (or {} alone for true)", flag);
      }))
      ->type_name("[=true|false]")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  return *this;
}

CommandLine& CommandLine::add_choice(const std::string& name, std::string& value,
                                     std::vector<std::string> choices, std::string help) {
  const auto current = std::find(choices.begin(), choices.end(), value);
  const auto index = current == choices.end()
                         ? std::nullopt
                         : std::optional<size_t>(static_cast<size_t>(current - choices.begin()));
  return add_choice_index(
      name, choices, index, [&value, choices](size_t i) { value = choices[i]; }, std::move(help));
}

CommandLine& CommandLine::add_choice_index(const std::string& name, std::vector<std::string> names,
                                           std::optional<size_t> current,
                                           std::function<void(size_t)> on_choice,
                                           std::string help) {
  if (!current) {
    throw std::logic_error(fmt::format("flag --{}: its default is not one of its choices", name));
  }
  const std::string type = fmt::format("{{{}}}", fmt::join(names, ","));
  auto choose = [names, on_choice = std::move(on_choice)](const std::string& text) {
    on_choice(static_cast<size_t>(std::find(names.begin(), names.end(), text) - names.begin()));
  };
  app_->add_option_function<std::string>("--" + name, std::move(choose),
                                         with_default(std::move(help), names[*current]))
      ->check(check([names](const std::string& text) -> std::string {
        if (std::find(names.begin(), names.end(), text) != names.end()) return "";
        return fmt::format("one of {}", fmt::join(names, ", "));
      }))
      ->type_name(type)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  return *this;
}

CommandLine& CommandLine::add_list(const std::string& name, std::vector<double>& values,
                                   std::string help, std::optional<size_t> count,
                                   const std::string& count_meaning, std::optional<double> min) {
  // Bound as text and split here: CLI11's own delimiter would drop empty items ("0.1,,0.2").
  app_->add_option_function<std::string>(
          "--" + name, [&values](const std::string& text) { values = *parse_list(text); },
          with_default(std::move(help), fmt::format("{}", fmt::join(values, ","))))
      ->check(check([count, count_meaning, min](const std::string& text) -> std::string {
        const auto list = parse_list(text);
        if (!list) return "numbers separated by commas";
        if (count && list->size() != *count) {
          return fmt::format("{} numbers {}", *count, count_meaning);
        }
        for (const double value : *list) {
          if (min && value < *min) return fmt::format("numbers >= {}", *min);
        }
        return "";
      }))
      ->type_name("<value>")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  return *this;
}

bool CommandLine::parse(int argc, const char* const* argv) {
  try {
    app_->parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << usage();
    return false;
  } catch (const CLI::ParseError& e) {
    throw std::invalid_argument(e.what());
  }
  const auto extras = app_->remaining();
  if (!extras.empty()) {
    const std::string& first = extras.front();
    if (first.rfind("--", 0) == 0) {
      throw std::invalid_argument(fmt::format("unknown flag {}", first.substr(0, first.find('='))));
    }
    throw std::invalid_argument(
        fmt::format("unexpected argument '{}' (flags start with --)", first));
  }
  return true;
}

bool CommandLine::was_set(const std::string& name) const {
  return app_->get_option("--" + name)->count() > 0;
}

std::string CommandLine::usage() const { return app_->help(); }

std::string quoted_command_line(int argc, const char* const* argv) {
  std::vector<std::string> args;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (!arg.empty() && arg.find_first_of(" \t'\"$\\") == std::string::npos) {
      args.push_back(arg);
      continue;
    }
    std::string quoted = "'";
    for (const char c : arg) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
    args.push_back(quoted + "'");
  }
  return fmt::format("{}", fmt::join(args, " "));
}

}  // namespace shampoo::examples
