#include "examples/progress_bar.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <utility>

namespace shampoo::examples {

namespace {

constexpr int kBarWidth = 30;
constexpr auto kRedrawInterval = std::chrono::milliseconds(100);

std::string format_duration(double seconds) {
  const auto total = static_cast<int64_t>(seconds + 0.5);
  if (total >= 3600) {
    return fmt::format("{}:{:02}:{:02}", total / 3600, (total / 60) % 60, total % 60);
  }
  return fmt::format("{}:{:02}", total / 60, total % 60);
}

}  // namespace

ProgressBar::ProgressBar(std::FILE* stream, bool enabled) : stream_(stream), enabled_(enabled) {}

bool ProgressBar::is_terminal(std::FILE* stream) { return isatty(fileno(stream)) == 1; }

void ProgressBar::start(std::string label, int64_t total) {
  if (!enabled_) return;
  erase();
  label_ = std::move(label);
  status_.clear();
  total_ = std::max<int64_t>(total, 1);
  done_ = 0;
  start_ = std::chrono::steady_clock::now();
  last_draw_ = start_;
  draw();
}

void ProgressBar::update(int64_t done, const std::string& status) {
  if (!enabled_) return;
  done_ = done;
  status_ = status;
  const auto now = std::chrono::steady_clock::now();
  if (done_ >= total_ || now - last_draw_ >= kRedrawInterval) {
    last_draw_ = now;
    draw();
  }
}

void ProgressBar::finish() {
  if (!enabled_) return;
  erase();
}

void ProgressBar::print_line(const std::string& line) {
  const bool redraw = visible_;
  erase();
  fmt::print("{}\n", line);
  std::fflush(stdout);
  if (redraw) draw();
}

void ProgressBar::draw() {
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double rate = elapsed > 0 ? static_cast<double>(done_) / elapsed : 0.0;
  const int filled = static_cast<int>(kBarWidth * std::min<int64_t>(done_, total_) / total_);
  std::string bar(static_cast<size_t>(filled), '#');
  bar.append(static_cast<size_t>(kBarWidth - filled), '.');
  const std::string eta =
      rate > 0 ? format_duration(static_cast<double>(total_ - done_) / rate) : "?";
  // \r: back to the start of the line; \033[K: clear what a longer previous draw left.
  fmt::print(stream_, "\r{} [{}] {}/{}  {:.1f} it/s  ETA {}  {}\033[K", label_, bar, done_, total_,
             rate, eta, status_);
  std::fflush(stream_);
  visible_ = true;
}

void ProgressBar::erase() {
  if (!visible_) return;
  std::fputs("\r\033[K", stream_);
  std::fflush(stream_);
  visible_ = false;
}

}  // namespace shampoo::examples
