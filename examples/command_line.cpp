#include "examples/command_line.h"

#include <algorithm>
#include <charconv>
#include <iostream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <system_error>
#include <utility>

namespace shampoo::examples {

namespace {

constexpr size_t kUsageWidth = 96;

std::optional<bool> parse_bool(const std::string& text) {
  if (text == "true" || text == "1" || text == "yes" || text == "on") return true;
  if (text == "false" || text == "0" || text == "no" || text == "off") return false;
  return std::nullopt;
}

std::string join(const std::vector<std::string>& items, const char* separator) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += separator;
    out += items[i];
  }
  return out;
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

double parse_double(const std::string& name, const std::string& text) {
  double value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty()) {
    throw std::invalid_argument("--" + name + ": got '" + text + "', expected a number");
  }
  return value;
}

}  // namespace

CommandLine::CommandLine(std::string program, std::string summary)
    : program_(std::move(program)), summary_(std::move(summary)) {}

CommandLine& CommandLine::add(const std::string& name, std::string default_value,
                              std::string help) {
  if (flags_.count(name) != 0) throw std::logic_error("flag --" + name + " declared twice");
  order_.push_back(name);
  Flag& flag = flags_[name];
  flag.value = default_value;
  flag.default_value = std::move(default_value);
  flag.help = std::move(help);
  return *this;
}

CommandLine& CommandLine::add_bool(const std::string& name, bool default_value, std::string help) {
  add(name, default_value ? "true" : "false", std::move(help));
  flags_[name].is_bool = true;
  return *this;
}

CommandLine& CommandLine::add_choice(const std::string& name, std::vector<std::string> choices,
                                     std::string default_value, std::string help) {
  if (std::find(choices.begin(), choices.end(), default_value) == choices.end()) {
    throw std::logic_error("flag --" + name + ": default '" + default_value +
                           "' is not one of its choices");
  }
  add(name, std::move(default_value), std::move(help));
  flags_[name].choices = std::move(choices);
  return *this;
}

bool CommandLine::parse(int argc, const char* const* argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::cout << usage();
      return false;
    }
    if (arg.rfind("--", 0) != 0) {
      throw std::invalid_argument("unexpected argument '" + arg + "' (flags start with --)");
    }
    std::string name = arg.substr(2);
    std::optional<std::string> value;
    const auto equals = name.find('=');
    if (equals != std::string::npos) {
      value = name.substr(equals + 1);
      name.resize(equals);
    }
    const auto it = flags_.find(name);
    if (it == flags_.end()) throw std::invalid_argument("unknown flag --" + name);
    Flag& flag = it->second;
    if (!value) {
      if (flag.is_bool) {
        value = "true";  // `--name` alone; never consumes the next argument
      } else {
        if (i + 1 >= argc) throw std::invalid_argument("flag --" + name + " needs a value");
        value = argv[++i];
      }
    }
    if (flag.is_bool && !parse_bool(*value)) {
      throw std::invalid_argument("--" + name + ": got '" + *value +
                                  "', expected true or false (or --" + name + " alone for true)");
    }
    if (!flag.choices.empty() &&
        std::find(flag.choices.begin(), flag.choices.end(), *value) == flag.choices.end()) {
      throw std::invalid_argument("--" + name + ": got '" + *value + "', expected one of " +
                                  join(flag.choices, ", "));
    }
    flag.value = std::move(*value);
    flag.set = true;
  }
  return true;
}

const CommandLine::Flag& CommandLine::flag(const std::string& name) const {
  const auto it = flags_.find(name);
  if (it == flags_.end()) throw std::logic_error("flag --" + name + " was not declared");
  return it->second;
}

const std::string& CommandLine::get_string(const std::string& name) const {
  return flag(name).value;
}

int64_t CommandLine::get_int(const std::string& name) const {
  const std::string& text = flag(name).value;
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty()) {
    throw std::invalid_argument("--" + name + ": got '" + text + "', expected an integer");
  }
  return value;
}

double CommandLine::get_double(const std::string& name) const {
  return parse_double(name, flag(name).value);
}

bool CommandLine::get_bool(const std::string& name) const {
  const auto value = parse_bool(flag(name).value);
  if (!value) {
    throw std::invalid_argument("--" + name + ": got '" + flag(name).value +
                                "', expected true or false");
  }
  return *value;
}

std::vector<double> CommandLine::get_doubles(const std::string& name) const {
  const std::string& text = flag(name).value;
  std::vector<double> values;
  if (text.empty()) return values;
  size_t begin = 0;
  while (true) {
    const size_t comma = text.find(',', begin);
    const std::string item =
        text.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin);
    if (item.empty()) {
      throw std::invalid_argument("--" + name + ": got '" + text +
                                  "', expected numbers separated by commas");
    }
    values.push_back(parse_double(name, item));
    if (comma == std::string::npos) break;
    begin = comma + 1;
  }
  return values;
}

bool CommandLine::was_set(const std::string& name) const { return flag(name).set; }

std::string CommandLine::usage() const {
  std::ostringstream out;
  out << "Usage: " << program_ << " [flags]\n" << summary_ << "\n\nFlags:\n";
  for (const auto& name : order_) {
    const Flag& f = flags_.at(name);
    out << "  --" << name;
    if (f.is_bool) {
      out << "[=true|false]";
    } else if (!f.choices.empty()) {
      out << " {" << join(f.choices, ",") << "}";
    } else {
      out << " <value>";
    }
    out << "\n"
        << wrap(f.help + " (default: " + (f.default_value.empty() ? "none" : f.default_value) + ")",
                kUsageWidth, "      ");
  }
  return out.str();
}

}  // namespace shampoo::examples
