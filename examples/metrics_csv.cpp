#include "examples/metrics_csv.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace shampoo::examples {

namespace {

constexpr const char* kTrainHeader =
    "epoch,iteration,loss,lifetime_loss,window_loss,global_loss,global_lifetime_loss,"
    "global_window_loss,lr";
constexpr const char* kEvalHeader =
    "epoch,iteration,test_loss,test_accuracy,train_lifetime_loss,epoch_seconds,device";

std::string number(double value) { return fmt::format("{:.17g}", value); }

/// Rewrites `path` with `header` and the existing rows whose column `key_column` (an integer) is
/// ≤ `keep_up_to`; with keep_up_to < 0 only the header. Then opens it for appending.
void reopen(std::ofstream& out, const std::filesystem::path& path, const char* header,
            size_t key_column, int64_t keep_up_to) {
  std::vector<std::string> kept;
  if (keep_up_to >= 0) {
    std::ifstream in(path);
    std::string line;
    bool first = true;
    while (std::getline(in, line)) {
      if (first) {  // the header
        first = false;
        continue;
      }
      std::stringstream fields(line);
      std::string field;
      size_t column = 0;
      while (std::getline(fields, field, ',') && column < key_column) ++column;
      // A partly written last row of a killed run has fewer fields: dropped.
      const bool complete = std::count(line.begin(), line.end(), ',') ==
                            std::count(header, header + std::strlen(header), ',');
      try {
        if (complete && column == key_column && std::stoll(field) <= keep_up_to) {
          kept.push_back(line);
        }
      } catch (const std::exception&) {
        // Not a number: dropped too.
      }
    }
  }
  {
    std::ofstream rewrite(path, std::ios::trunc);
    TORCH_CHECK(rewrite, "--metrics-dir: cannot write ", path.string());
    rewrite << header << "\n";
    for (const auto& row : kept) rewrite << row << "\n";
  }
  out.open(path, std::ios::app);
  TORCH_CHECK(out, "--metrics-dir: cannot write ", path.string());
}

}  // namespace

MetricsCsv::MetricsCsv(const std::filesystem::path& dir, int64_t resume_epoch,
                       int64_t resume_iteration, std::string device)
    : dir_(dir), device_(std::move(device)) {
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  TORCH_CHECK(!ec, "--metrics-dir: cannot create ", dir_.string(), " (", ec.message(), ")");
  // A checkpoint within the first epoch has resume_epoch 0.
  const bool resume = resume_iteration > 0;
  reopen(train_, train_path(), kTrainHeader, /*key_column=*/1, resume ? resume_iteration : -1);
  reopen(eval_, eval_path(), kEvalHeader, /*key_column=*/0, resume ? resume_epoch : -1);
}

void MetricsCsv::add_iteration(int64_t epoch, int64_t iteration, const IterationLosses& local,
                               const IterationLosses& global, double lr) {
  train_ << epoch << ',' << iteration << ',' << number(local.loss) << ','
         << number(local.lifetime_loss) << ',' << number(local.window_loss) << ','
         << number(global.loss) << ',' << number(global.lifetime_loss) << ','
         << number(global.window_loss) << ',' << number(lr) << '\n';
}

void MetricsCsv::flush() {
  train_.flush();
  eval_.flush();
}

void MetricsCsv::add_epoch(int64_t epoch, int64_t iteration, double test_loss, double test_accuracy,
                           double train_lifetime_loss, double epoch_seconds) {
  // Flushed every epoch, so a plot of a run still going shows the finished epochs.
  train_.flush();
  eval_ << epoch << ',' << iteration << ',' << number(test_loss) << ',' << number(test_accuracy)
        << ',' << number(train_lifetime_loss) << ',' << number(epoch_seconds) << ',' << device_
        << std::endl;
}

}  // namespace shampoo::examples
