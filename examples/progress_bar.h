#pragma once
/// A one-line progress bar with rate and estimated time left, redrawn in place on a terminal:
///   epoch 2/5 [###########.........]  230/468  41.3 it/s  ETA 0:05  loss 0.4123
/// Disabled (every call a no-op) when the stream is not a terminal, so logs and CI output
/// stay clean. Lines printed through print_line() erase the bar first and redraw it after.

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace shampoo::examples {

class ProgressBar {
 public:
  /// Draws on `stream` (e.g. stderr) when `enabled`.
  ProgressBar(std::FILE* stream, bool enabled);

  /// Whether `stream` is a terminal (isatty).
  static bool is_terminal(std::FILE* stream);

  bool enabled() const { return enabled_; }

  /// Starts a bar of `total` steps with the label on its left.
  void start(std::string label, int64_t total);
  /// `done` of the total steps are finished; `status` is shown on the right. Redraws at most
  /// ten times a second (and always at the last step).
  void update(int64_t done, const std::string& status);
  /// Erases the bar (it stays erased until the next update()).
  void finish();

  /// Prints `line` (a newline is added) to stdout without garbling the bar.
  void print_line(const std::string& line);

 private:
  void draw();
  void erase();

  std::FILE* stream_;
  bool enabled_;
  bool visible_ = false;
  std::string label_;
  std::string status_;
  int64_t total_ = 0;
  int64_t done_ = 0;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_;
};

}  // namespace shampoo::examples
