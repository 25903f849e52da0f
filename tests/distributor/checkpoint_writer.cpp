// A process that trains DistributedShampoo and saves a world-size-independent checkpoint after
// every step, for the kill tests in checkpoint_kill_test.cpp:
//   checkpoint_writer <dir> <steps> [<file to die before> <generation>]
// With the last two arguments it kills itself with SIGKILL just before writing that file of that
// generation (a crash at a known point); otherwise the test kills it from outside at random.
// Step t's checkpoint is generation t; "saved <t>" is printed after each.
#include <shampoo/shampoo.h>

#include <csignal>
#include <cstdio>
#include <string>

#include "checkpoint_writer_model.h"

int main(int argc, char** argv) {
  if (argc != 3 && argc != 5) {
    std::fprintf(stderr, "usage: %s <dir> <steps> [<file to die before> <generation>]\n", argv[0]);
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  const int steps = std::stoi(argv[2]);
  const std::string die_before = argc == 5 ? argv[3] : "";
  const int die_generation = argc == 5 ? std::stoi(argv[4]) : 0;
  int step = 0;
  if (!die_before.empty()) {
    shampoo::detail::set_checkpoint_write_hook_for_testing([&](const std::filesystem::path& path) {
      if (step == die_generation && path.filename() == die_before) std::raise(SIGKILL);
    });
  }
  checkpoint_writer::Model model;
  for (step = 1; step <= steps; ++step) {
    model.step(step);
    shampoo::save_distributed_checkpoint(*model.optimizer, dir);
    std::printf("saved %d\n", step);
    std::fflush(stdout);
  }
  return 0;
}
