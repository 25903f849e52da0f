#pragma once
/// What the Python class DistributedShampoo drives: one C++ shampoo::DistributedShampoo over the
/// same tensors (the parameters and their .grad are the Python tensors themselves), and the
/// conversions of its state to and from tensors for state_dict().

#include <ATen/ATen.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "shampoo/distributed_shampoo.h"

namespace shampoo::python {

/// A param group as the Python layer hands it over: its parameters and its options (the flat
/// dictionary of options_from_python.h).
struct GroupSpec {
  std::vector<at::Tensor> params;
  pybind11::dict options;
};

class Engine {
 public:
  Engine(const std::vector<GroupSpec>& groups, const pybind11::dict& distributed,
         const pybind11::object& process_group);

  /// One step of every parameter with a gradient (the GIL is released by the binding).
  void step();
  /// The float hyperparameters of param group `group`, as the Python param_groups hold them now.
  void set_floats(size_t group, double lr, double beta1, double beta2, double beta3,
                  double epsilon, double weight_decay, double peak_lr);
  void add_param_group(const GroupSpec& group);
  int64_t group_step(size_t group) const;
  size_t num_groups() const;

  /// Per parameter (index over the groups' parameters, in order), the pieces of its state that
  /// this rank holds, each serialized into a uint8 tensor: "optimizer" (its group's step count
  /// and mode) and "block_<k>" per block this rank owns.
  std::vector<std::map<std::string, at::Tensor>> state_pieces() const;
  /// Loads what state_pieces() returned (the same parameters, in the same order); nothing changes
  /// unless every piece reads and checks.
  void load_state_pieces(const std::vector<std::map<std::string, at::Tensor>>& pieces);

  void train();
  void eval();
  bool is_training() const;
  pybind11::dict stats() const;
  pybind11::dict memory_summary() const;

  /// World-size-independent checkpoints of the optimizer
  /// (parallel/checkpoints/distributed_checkpoint.h).
  void save_checkpoint(const std::string& dir) const;
  void load_checkpoint(const std::string& dir);

 private:
  std::vector<at::Tensor> all_params() const;
  std::unique_ptr<DistributedShampoo> optimizer_;
};

}  // namespace shampoo::python
