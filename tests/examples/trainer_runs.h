#pragma once
/// Running the image classification trainer (examples/cifar10_trainer) from a GoogleTest
/// program and comparing its metrics: a small CIFAR-10 data set in the official binary format,
/// the flags every run shares, a run in one process or under torchrun, and comparisons of CSV
/// columns. No LibTorch: the programs only start the trainer and read its files.
///
/// Arguments of such a program (CTest passes them): --trainer PATH [--torchrun PATH]
/// --work-dir DIR [--golden-dir DIR] [--param-distance PATH] [gtest flags].

#include <gtest/gtest.h>

#include <cstddef>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace shampoo::testing {

/// Where the trainer, the launcher and the files are.
struct TrainerPaths {
  std::string trainer;
  std::string torchrun;  ///< empty: no torchrun (multi-rank tests skip)
  std::filesystem::path work_dir;
  std::filesystem::path golden_dir;
  std::string param_distance;  ///< examples/param_distance (--param-distance); empty: not given
};
TrainerPaths& trainer_paths();

/// Fills trainer_paths() from argv (after ::testing::InitGoogleTest); --record-golden DIR goes
/// to *record_dir when given. Prints the usage and returns false on a bad argument.
bool parse_trainer_test_args(int argc, char** argv, const std::string& program,
                             std::string* record_dir = nullptr);

// ---- data ------------------------------------------------------------------------------------

constexpr int kRecordBytes = 3073;
constexpr int kPixelBytes = 3072;
constexpr int kRecordsPerTrainFile = 64;
constexpr int kTestRecords = 128;
constexpr int kClasses = 10;

/// Writes data_batch_1..5.bin (64 records each) and test_batch.bin (128) into `dir`: class
/// templates under noise, a fifth of the labels random, the same bytes everywhere.
void write_cifar10_files(const std::filesystem::path& dir);

// ---- running the trainer ---------------------------------------------------------------------

std::string read_text(const std::filesystem::path& path);

/// Columns of a CSV file by header name (numbers only; lines starting with # are comments).
using Columns = std::map<std::string, std::vector<double>>;
Columns read_csv(const std::filesystem::path& path);

/// Rows of a column (0 when the column is absent).
size_t rows(const Columns& columns, const std::string& name);

struct TrainerRun {
  int exit_code = -1;
  std::string log;  // stdout and stderr
  Columns train;    // metrics train.csv
  Columns eval;     // metrics eval.csv
};

/// The flags every run shares: the data, the reference's ConvNet, three epochs of 10
/// iterations with a global batch of 32 (`ranks` ranks of 32 / ranks each).
std::vector<std::string> base_flags(const std::filesystem::path& data_dir, int ranks);

/// Shampoo settings of the suites: Adam grafting alone for 9 steps, then roots every 5 steps
/// from step 10; blocks of at most 64.
std::vector<std::string> shampoo_flags();

std::vector<std::string> operator+(std::vector<std::string> a, const std::vector<std::string>& b);

/// `value` with 17 significant digits (reads back exactly).
std::string number(double value);

/// Runs the trainer in `dir` (metrics in dir/metrics, log appended to dir/log.txt) with `ranks`
/// ranks (torchrun --standalone when more than one).
TrainerRun run_trainer(const std::filesystem::path& dir, int ranks,
                       const std::vector<std::string>& flags);

/// A fresh folder for one test, holding its data set.
class TrainerTest : public ::testing::Test {
 protected:
  void SetUp() override;

  /// Runs and asserts success and 30 iterations (the log is printed on failure).
  TrainerRun run_ok(const std::string& name, int ranks, const std::vector<std::string>& flags);

  std::filesystem::path dir_;
  std::filesystem::path data_dir_;
};

// ---- comparisons -----------------------------------------------------------------------------

/// Bit-for-bit equal columns (the CSV holds 17 significant digits: doubles read back exactly).
::testing::AssertionResult identical(const std::vector<double>& actual,
                                     const std::vector<double>& expected);

/// |actual − expected| ≤ rtol·|expected| at every row; the message gives the largest relative
/// error and where.
::testing::AssertionResult close(const std::vector<double>& actual,
                                 const std::vector<double>& expected, double rtol);

double max_relative_difference(const std::vector<double>& a, const std::vector<double>& b);

}  // namespace shampoo::testing
