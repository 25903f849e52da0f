#include "python/src/engine.h"

#include <torch/csrc/utils/pybind.h>

#include <sstream>

#include "parallel/checkpoints/distributed_checkpoint.h"
#include "parallel/optimizers/portable_checkpoint.h"
#include "python/src/options_from_python.h"

namespace py = pybind11;

namespace shampoo::python {
namespace {

torch::optim::OptimizerParamGroup group_of(const GroupSpec& spec) {
  return torch::optim::OptimizerParamGroup(
      spec.params, std::make_unique<ShampooOptions>(shampoo_options_from(spec.options)));
}

at::Tensor bytes_tensor(const std::string& bytes) {
  auto tensor = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(tensor.data_ptr(), bytes.data(), bytes.size());
  return tensor;
}

std::string tensor_bytes(const at::Tensor& tensor, const std::string& key) {
  TORCH_CHECK(tensor.scalar_type() == at::kByte && tensor.dim() == 1,
              "load_state_dict: state entry '", key,
              "' is not a 1-D uint8 tensor (a state_dict of another optimizer?)");
  const auto cpu = tensor.to(at::kCPU).contiguous();
  return std::string(static_cast<const char*>(cpu.data_ptr()), static_cast<size_t>(cpu.numel()));
}

/// "p<i>/<rest>" -> (i, rest).
std::pair<size_t, std::string> split_key(const std::string& key) {
  const auto slash = key.find('/');
  TORCH_CHECK(key.size() > 1 && key[0] == 'p' && slash != std::string::npos,
              "state_dict: unexpected piece key ", key);
  return {std::stoul(key.substr(1, slash - 1)), key.substr(slash + 1)};
}

}  // namespace

Engine::Engine(const std::vector<GroupSpec>& groups, const py::dict& distributed,
               const py::object& process_group) {
  std::vector<torch::optim::OptimizerParamGroup> param_groups;
  for (const auto& spec : groups) param_groups.push_back(group_of(spec));
  auto options = distributed_options_from(distributed, process_group);
  py::gil_scoped_release release;
  optimizer_ = std::make_unique<DistributedShampoo>(std::move(param_groups),
                                                    ShampooOptions::reference_defaults(),
                                                    std::move(options));
}

void Engine::step() { optimizer_->step(); }

void Engine::set_floats(size_t group, double lr, double beta1, double beta2, double beta3,
                        double epsilon, double weight_decay, double peak_lr) {
  auto& options = optimizer_->group_options(group);
  options.lr(lr).betas({beta1, beta2}).beta3(beta3).epsilon(epsilon).weight_decay(weight_decay);
  options.peak_lr(peak_lr);
}

void Engine::add_param_group(const GroupSpec& group) {
  auto param_group = group_of(group);
  py::gil_scoped_release release;
  optimizer_->add_param_group(param_group);
}

int64_t Engine::group_step(size_t group) const { return optimizer_->group_step(group); }
size_t Engine::num_groups() const { return optimizer_->param_groups().size(); }

std::vector<at::Tensor> Engine::all_params() const {
  std::vector<at::Tensor> params;
  for (const auto& group : optimizer_->param_groups()) {
    params.insert(params.end(), group.params().begin(), group.params().end());
  }
  return params;
}

std::vector<std::map<std::string, at::Tensor>> Engine::state_pieces() const {
  const auto params = all_params();
  std::map<const c10::TensorImpl*, size_t> index;
  for (size_t i = 0; i < params.size(); ++i) index[params[i].unsafeGetTensorImpl()] = i;
  std::vector<std::map<std::string, at::Tensor>> out(params.size());
  PieceWriter pieces([&](const std::string& key, torch::serialize::OutputArchive piece) {
    torch::serialize::OutputArchive holder;
    holder.write("piece_0", piece);
    std::ostringstream stream;
    holder.save_to(stream);
    const auto [i, rest] = split_key(key);
    out.at(i)[rest] = bytes_tensor(stream.str());
  });
  const ParamNames names = [&](const at::Tensor& p) {
    return "p" + std::to_string(index.at(p.unsafeGetTensorImpl()));
  };
  detail::save_param_states(*optimizer_, params, pieces, names, "state_dict: ");
  return out;
}

void Engine::load_state_pieces(const std::vector<std::map<std::string, at::Tensor>>& pieces) {
  const auto params = all_params();
  TORCH_CHECK(pieces.size() == params.size(), "load_state_dict: the state_dict has ",
              pieces.size(), " parameters, this optimizer ", params.size());
  auto bytes = std::make_shared<std::map<std::string, std::string>>();
  std::map<std::string, PieceReader::Location> locations;
  for (size_t i = 0; i < pieces.size(); ++i) {
    for (const auto& [rest, tensor] : pieces[i]) {
      std::string key = "p";
      key += std::to_string(i);
      key += '/';
      key += rest;
      (*bytes)[key] = tensor_bytes(tensor, key);
      locations[key] = PieceReader::Location{key, 0};
    }
  }
  PieceReader reader("state_dict", std::move(locations), [bytes](const std::string& key) {
    torch::serialize::InputArchive archive;
    const auto& data = bytes->at(key);
    archive.load_from(data.data(), data.size());
    return archive;
  });
  std::map<const c10::TensorImpl*, size_t> index;
  for (size_t i = 0; i < params.size(); ++i) index[params[i].unsafeGetTensorImpl()] = i;
  const ParamNames names = [&](const at::Tensor& p) {
    return "p" + std::to_string(index.at(p.unsafeGetTensorImpl()));
  };
  auto install = detail::prepare_param_states(*optimizer_, reader, names, "load_state_dict: ");
  install();
}

void Engine::train() {
  py::gil_scoped_release release;
  optimizer_->train();
}

void Engine::eval() {
  py::gil_scoped_release release;
  optimizer_->eval();
}

bool Engine::is_training() const { return optimizer_->is_training(); }

py::dict Engine::stats() const {
  const auto s = optimizer_->stats();
  py::dict d;
  d["virtual_groups"] = s.virtual_groups;
  d["collectives_last_step"] = s.collectives_last_step;
  d["amortized_computations"] = s.amortized_computations;
  d["failed_amortized_computations"] = s.failed_amortized_computations;
  d["double_precision_retries"] = s.double_precision_retries;
  d["state_bytes"] = s.state_bytes;
  d["bytes_sent_per_step"] = s.bytes_sent_per_step;
  d["bytes_received_per_step"] = s.bytes_received_per_step;
  return d;
}

py::dict Engine::memory_summary() const {
  const auto m = optimizer_->memory_summary();
  py::dict d;
  d["factors"] = m.factors;
  d["inverse_roots"] = m.inverse_roots;
  d["eigenvectors"] = m.eigenvectors;
  d["preconditioner_other"] = m.preconditioner_other;
  d["grafting"] = m.grafting;
  d["filtered_gradient"] = m.filtered_gradient;
  d["momentum"] = m.momentum;
  d["averaging"] = m.averaging;
  d["total"] = m.state_total();
  return d;
}

void Engine::save_checkpoint(const std::string& dir) const {
  py::gil_scoped_release release;
  save_distributed_checkpoint(*optimizer_, dir);
}

void Engine::load_checkpoint(const std::string& dir) {
  py::gil_scoped_release release;
  load_distributed_checkpoint(*optimizer_, dir);
}

}  // namespace shampoo::python
