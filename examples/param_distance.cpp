/// param_distance A B: how far the parameters in file A (the trainer's --save-params) are from
/// those in file B, the reference. Prints one line per parameter and one over all of them:
/// max|a − b| / max|b| and ‖a − b‖ / ‖b‖. Exit code 0; 1 when the files hold different
/// parameter names (in order) or shapes, or cannot be read; 2 on a usage error.

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>

#include "examples/parameter_file.h"

int main(int argc, char** argv) {
  using namespace shampoo::examples;
  if (argc != 3) {
    fmt::print(stderr,
               "usage: param_distance A B\n  prints max|a-b|/max|b| and ||a-b||/||b|| per "
               "parameter and overall, for two files of the trainer's --save-params (B is the "
               "reference)\n");
    return 2;
  }
  try {
    const auto rows =
        parameter_distances(read_parameter_file(argv[1]), read_parameter_file(argv[2]));
    fmt::print("{:<32} {:>14} {:>14}\n", "parameter", "max_rel", "norm_rel");
    for (const auto& row : rows) {
      fmt::print("{:<32} {:>14.6e} {:>14.6e}\n", row.name, row.max_relative, row.norm_relative);
    }
    return 0;
  } catch (const std::invalid_argument& e) {
    fmt::print(stderr, "param_distance: {} and {} do not match: {}\n", argv[1], argv[2], e.what());
    return 1;
  } catch (const c10::Error& e) {
    fmt::print(stderr, "param_distance: {}\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "param_distance: {}\n", e.what());
    return 1;
  }
}
