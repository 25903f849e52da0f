#include "trainer_runs.h"

#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <random>
#include <sstream>

namespace shampoo::testing {

namespace fs = std::filesystem;

namespace {

std::string shell_quote(const std::string& text) {
  std::string quoted = "'";
  for (const char c : text) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

/// Removes `path` and everything under it. (Not std::filesystem::remove_all: in a program linked
/// with the torch wheel's libtorch.so, which exports its own copy of it, that crashes.)
void remove_tree(const fs::path& path) {
  std::error_code ec;
  if (fs::is_directory(fs::symlink_status(path, ec))) {
    for (const auto& entry : fs::directory_iterator(path, ec)) remove_tree(entry.path());
  }
  fs::remove(path, ec);
}

}  // namespace

TrainerPaths& trainer_paths() {
  static TrainerPaths paths;
  return paths;
}

bool parse_trainer_test_args(int argc, char** argv, const std::string& program,
                             std::string* record_dir) {
  auto& paths = trainer_paths();
  bool ok = argc % 2 == 1;
  for (int i = 1; ok && i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const std::string value = argv[i + 1];
    if (flag == "--trainer") {
      paths.trainer = value;
    } else if (flag == "--torchrun") {
      paths.torchrun = value;
    } else if (flag == "--work-dir") {
      paths.work_dir = value;
    } else if (flag == "--golden-dir") {
      paths.golden_dir = value;
    } else if (flag == "--param-distance") {
      paths.param_distance = value;
    } else if (flag == "--record-golden" && record_dir != nullptr) {
      *record_dir = value;
    } else {
      std::cerr << program << ": unknown argument " << flag << "\n";
      ok = false;
    }
  }
  if (!ok || paths.trainer.empty()) {
    std::cerr << "usage: " << program
              << " --trainer PATH [--torchrun PATH] [--work-dir DIR] [--golden-dir DIR]"
              << " [--param-distance PATH]"
              << (record_dir != nullptr ? " [--record-golden DIR]" : "") << " [gtest flags]\n";
    return false;
  }
  if (paths.work_dir.empty()) paths.work_dir = fs::temp_directory_path() / program;
  paths.work_dir = fs::absolute(paths.work_dir);
  return true;
}

// ---- data ------------------------------------------------------------------------------------

/// Writes data_batch_1..5.bin and test_batch.bin into `dir`. Each image is noise plus a faint
/// copy of its class's fixed random template (kSignal/256 of the pixel), and a fifth of the
/// labels are random: learnable but not separable within the suite's 30 iterations, so the
/// losses stay well above zero and relative comparisons mean something. Uses the raw output of
/// std::mt19937 (specified by the standard), so the bytes are the same everywhere.
constexpr uint32_t kSignal = 20;
constexpr uint32_t kRandomLabelPercent = 20;

void write_cifar10_files(const fs::path& dir) {
  fs::create_directories(dir);
  std::mt19937 random(20240611u);
  std::vector<std::vector<uint32_t>> templates(kClasses, std::vector<uint32_t>(kPixelBytes));
  for (auto& t : templates) {
    for (auto& value : t) value = random() >> 24;
  }
  auto write_file = [&](const fs::path& path, int records) {
    std::ofstream out(path, std::ios::binary);
    std::vector<char> record(kRecordBytes);
    for (int r = 0; r < records; ++r) {
      const auto image_class = random() % kClasses;
      const bool random_label = random() % 100 < kRandomLabelPercent;
      const auto label = random_label ? random() % kClasses : image_class;
      record[0] = static_cast<char>(label);
      for (int p = 0; p < kPixelBytes; ++p) {
        const uint32_t noise = random() >> 24;
        record[1 + p] =
            static_cast<char>((kSignal * templates[image_class][p] + (256 - kSignal) * noise) >> 8);
      }
      out.write(record.data(), kRecordBytes);
    }
  };
  for (int i = 1; i <= 5; ++i) {
    write_file(dir / ("data_batch_" + std::to_string(i) + ".bin"), kRecordsPerTrainFile);
  }
  write_file(dir / "test_batch.bin", kTestRecords);
}

// ---- running the trainer ---------------------------------------------------------------------

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

Columns read_csv(const fs::path& path) {
  std::ifstream in(path);
  Columns columns;
  std::vector<std::string> names;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::stringstream fields(line);
    std::string field;
    if (names.empty()) {
      while (std::getline(fields, field, ',')) names.push_back(field);
      continue;
    }
    for (size_t c = 0; c < names.size() && std::getline(fields, field, ','); ++c) {
      columns[names[c]].push_back(std::strtod(field.c_str(), nullptr));
    }
  }
  return columns;
}

/// Rows of a column (0 when the column is absent).
size_t rows(const Columns& columns, const std::string& name) {
  const auto it = columns.find(name);
  return it == columns.end() ? 0 : it->second.size();
}

/// The flags every run shares: the data, the reference's ConvNet, three epochs of 10
/// iterations with a global batch of 32 (`ranks` ranks of 32 / ranks each).
std::vector<std::string> base_flags(const fs::path& data_dir, int ranks) {
  return {"--dataset",
          "cifar10",
          "--data-dir",
          data_dir.string(),
          "--model",
          "convnet",
          "--epochs",
          "3",
          "--local-batch-size",
          std::to_string(32 / ranks),
          "--seed",
          "7",
          "--window-size",
          "5",
          "--log-every",
          "1000",
          "--progress",
          "off",
          "--threads",
          "1"};
}

/// Shampoo settings of the suite: Adam grafting alone for 9 steps, then roots every 5 steps
/// from step 10; blocks of at most 64 (the linear layer's 10x65536 weight becomes 1024 blocks of
/// 10x64: cheap roots). Starting at step 10 keeps the 64x64 factors full rank (each step adds
/// rank ≤ 10): with roots of rank-deficient factors the ε^(-1/4) of the null space amplifies
/// rounding differences to 1e-4, which would blur the parity tests.
std::vector<std::string> shampoo_flags() {
  return {"--optimizer",
          "shampoo",
          "--betas",
          "0.9,0.999",
          "--epsilon",
          "1e-10",
          "--grafting",
          "adam",
          "--max-preconditioner-dim",
          "64",
          "--precondition-frequency",
          "5",
          "--start-preconditioning-step",
          "10"};
}

std::vector<std::string> operator+(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

/// Runs the trainer in `dir` (metrics in dir/metrics, log in dir/log.txt) with `ranks` ranks.
TrainerRun run_trainer(const fs::path& dir, int ranks, const std::vector<std::string>& flags) {
  fs::create_directories(dir);
  // Appended piece by piece (GCC 12 warns falsely about `"literal" + std::string&&`).
  std::vector<std::string> words{"OMP_NUM_THREADS=1"};
  if (ranks > 1) {
    words.insert(words.end(), {shell_quote(trainer_paths().torchrun), "--no-python", "--standalone",
                               "--nproc-per-node", std::to_string(ranks)});
  }
  words.push_back(shell_quote(trainer_paths().trainer));
  for (const auto& flag : flags) words.push_back(shell_quote(flag));
  words.push_back("--metrics-dir");
  words.push_back(shell_quote((dir / "metrics").string()));
  const auto log_path = dir / "log.txt";
  words.push_back(">>");
  words.push_back(shell_quote(log_path.string()));
  words.push_back("2>&1");
  std::string command;
  for (const auto& word : words) {
    if (!command.empty()) command += ' ';
    command += word;
  }
  { std::ofstream(log_path, std::ios::app) << "+ " << command << "\n"; }
  const int status = std::system(command.c_str());
  TrainerRun run;
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  run.log = read_text(log_path);
  run.train = read_csv(dir / "metrics" / "train.csv");
  run.eval = read_csv(dir / "metrics" / "eval.csv");
  return run;
}

void TrainerTest::SetUp() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = std::string(info->test_suite_name()) + "." + info->name();
  std::replace(name.begin(), name.end(), '/', '_');
  dir_ = trainer_paths().work_dir / name;
  remove_tree(dir_);
  data_dir_ = dir_ / "data";
  write_cifar10_files(data_dir_);
}

TrainerRun TrainerTest::run_ok(const std::string& name, int ranks,
                               const std::vector<std::string>& flags) {
  TrainerRun run = run_trainer(dir_ / name, ranks, flags);
  EXPECT_EQ(run.exit_code, 0) << "run " << name << " failed:\n" << run.log;
  EXPECT_EQ(rows(run.train, "loss"), 30u) << "run " << name << ":\n" << run.log;
  return run;
}

// ---- comparisons -----------------------------------------------------------------------------

/// Bit-for-bit equal columns (the CSV holds 17 significant digits: doubles read back exactly).
::testing::AssertionResult identical(const std::vector<double>& actual,
                                     const std::vector<double>& expected) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << "lengths differ: " << actual.size() << " vs " << expected.size();
  }
  if (actual.empty()) return ::testing::AssertionFailure() << "no values";
  for (size_t i = 0; i < actual.size(); ++i) {
    if (actual[i] != expected[i]) {
      return ::testing::AssertionFailure()
             << "first difference at row " << i << " (iteration " << i + 1
             << "): " << std::setprecision(17) << actual[i] << " vs " << expected[i];
    }
  }
  return ::testing::AssertionSuccess();
}

/// |actual − expected| ≤ rtol·|expected| at every row; the message gives the largest relative
/// error and where.
::testing::AssertionResult close(const std::vector<double>& actual,
                                 const std::vector<double>& expected, double rtol) {
  if (actual.size() != expected.size() || actual.empty()) {
    return ::testing::AssertionFailure()
           << "lengths differ or empty: " << actual.size() << " vs " << expected.size();
  }
  double worst = 0;
  size_t where = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double rel = std::abs(actual[i] - expected[i]) / std::abs(expected[i]);
    if (std::isnan(rel) || rel > worst) {
      worst = rel;
      where = i;
      if (std::isnan(rel)) break;
    }
  }
  auto result = worst <= rtol ? ::testing::AssertionSuccess() : ::testing::AssertionFailure();
  return result << "max relative error " << std::setprecision(3) << worst << " at row " << where
                << " (iteration " << where + 1 << "): " << std::setprecision(17) << actual[where]
                << " vs " << expected[where] << " (rtol " << rtol << ")";
}

double max_relative_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    worst = std::max(worst, std::abs(a[i] - b[i]) / std::abs(b[i]));
  }
  return worst;
}

std::string number(double value) {
  std::ostringstream out;
  out << std::setprecision(17) << value;
  return out.str();
}

}  // namespace shampoo::testing
