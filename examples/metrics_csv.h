#pragma once
/// The trainer's metrics as CSV files in --metrics-dir (written by rank 0):
///   train.csv: epoch,iteration,loss,lifetime_loss,window_loss,global_loss,
///              global_lifetime_loss,global_window_loss,lr
///     one row per iteration; loss is rank 0's batch loss, global_* the means over the ranks
///     (equal to the local values in one process), lr the first param group's.
///   eval.csv:  epoch,iteration,test_loss,test_accuracy,train_lifetime_loss,epoch_seconds,device
///     one row per epoch; device is where rank 0 trained ("cpu", "cuda:0"), so that runs
///     gathered from several machines say where their epoch_seconds were measured.
/// Numbers are written with 17 significant digits, so a double reads back exactly. A resumed
/// run keeps the rows up to its checkpoint and drops later ones (from an interrupted epoch).

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "examples/loss_metrics.h"

namespace shampoo::examples {

class MetricsCsv {
 public:
  /// Opens (creates) both files in `dir`. With resume_iteration > 0, keeps the rows of train.csv
  /// with iteration ≤ resume_iteration and of eval.csv with epoch ≤ resume_epoch; otherwise
  /// starts both files afresh. `device` is written in eval.csv's device column.
  MetricsCsv(const std::filesystem::path& dir, int64_t resume_epoch, int64_t resume_iteration,
             std::string device);

  void add_iteration(int64_t epoch, int64_t iteration, const IterationLosses& local,
                     const IterationLosses& global, double lr);
  void add_epoch(int64_t epoch, int64_t iteration, double test_loss, double test_accuracy,
                 double train_lifetime_loss, double epoch_seconds);

  /// Writes the rows so far to the files (before a checkpoint: a run resumed from it finds them).
  void flush();

  std::filesystem::path train_path() const { return dir_ / "train.csv"; }
  std::filesystem::path eval_path() const { return dir_ / "eval.csv"; }

 private:
  std::filesystem::path dir_;
  std::string device_;
  std::ofstream train_;
  std::ofstream eval_;
};

}  // namespace shampoo::examples
