#include "examples/command_line.h"

#include <charconv>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <system_error>
#include <utility>

namespace shampoo::examples {

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
    std::string value;
    const auto equals = name.find('=');
    if (equals != std::string::npos) {
      value = name.substr(equals + 1);
      name.resize(equals);
    } else {
      if (i + 1 >= argc) throw std::invalid_argument("flag --" + name + " needs a value");
      value = argv[++i];
    }
    const auto it = flags_.find(name);
    if (it == flags_.end()) throw std::invalid_argument("unknown flag --" + name);
    it->second.value = std::move(value);
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
  const std::string& text = flag(name).value;
  double value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || text.empty()) {
    throw std::invalid_argument("--" + name + ": got '" + text + "', expected a number");
  }
  return value;
}

std::string CommandLine::usage() const {
  std::ostringstream out;
  out << "Usage: " << program_ << " [flags]\n" << summary_ << "\n\nFlags:\n";
  for (const auto& name : order_) {
    const Flag& f = flags_.at(name);
    out << "  --" << name << " <value>\n      " << f.help
        << " (default: " << (f.default_value.empty() ? "none" : f.default_value) << ")\n";
  }
  return out.str();
}

}  // namespace shampoo::examples
