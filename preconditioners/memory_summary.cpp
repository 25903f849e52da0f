#include "preconditioners/memory_summary.h"

#include <c10/util/StringUtil.h>
#include <fmt/format.h>

#include <utility>
#include <vector>

namespace shampoo {
namespace {

double megabytes(int64_t bytes) { return static_cast<double>(bytes) / 1e6; }

/// The kinds of state in the order of the struct, with their names.
std::vector<std::pair<const char*, int64_t>> kinds(const MemorySummary& m) {
  return {{"factors", m.factors},           {"inverse roots", m.inverse_roots},
          {"eigenvectors", m.eigenvectors}, {"other preconditioner", m.preconditioner_other},
          {"grafting", m.grafting},         {"filtered gradient", m.filtered_gradient},
          {"momentum", m.momentum},         {"averaging", m.averaging}};
}

}  // namespace

std::string MemorySummary::to_string() const {
  std::string out;
  for (const auto& [name, bytes] : kinds(*this)) {
    if (bytes != 0) out += fmt::format("  {:<22}{:>10.1f} MB\n", name, megabytes(bytes));
  }
  out += fmt::format("  {:<22}{:>10.1f} MB\n", "state total", megabytes(state_total()));
  if (scratch_last_step != 0) {
    out +=
        fmt::format("  {:<22}{:>10.1f} MB\n", "scratch (last step)", megabytes(scratch_last_step));
  }
  return out + params_to_string();
}

std::string MemorySummary::params_to_string() const {
  std::string out;
  for (const auto& p : params) {
    out += fmt::format("  parameter {} [{}] (group {}): {}; {:.1f} MB, state {:.1f} MB\n", p.param,
                       c10::Join(", ", p.shape), p.group, p.treatment, megabytes(p.param_bytes),
                       megabytes(p.state_bytes));
  }
  return out;
}

std::string MemorySummary::to_line() const {
  std::string out;
  for (const auto& [name, bytes] : kinds(*this)) {
    if (bytes == 0) continue;
    out += fmt::format("{}{:.1f} MB {}", out.empty() ? "" : ", ", megabytes(bytes), name);
  }
  out += fmt::format("{}state {:.1f} MB", out.empty() ? "" : "; ", megabytes(state_total()));
  if (scratch_last_step != 0) {
    out += fmt::format("; the last step's undo journal {:.1f} MB", megabytes(scratch_last_step));
  }
  return out;
}

}  // namespace shampoo
