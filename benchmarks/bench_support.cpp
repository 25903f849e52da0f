#include "benchmarks/bench_support.h"

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <time.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/types.h>
#include <torch/utils.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <stdexcept>
#include <thread>

#include "support/rank_threads.h"

namespace shampoo::bench {

double elapsed_ms(Clock::time_point begin, Clock::time_point end) {
  return std::chrono::duration<double, std::milli>(end - begin).count();
}

double thread_cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double mean(const std::vector<double>& v) {
  if (v.empty()) return 0.0;
  return std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
}

double max_of(const std::vector<double>& v) {
  return v.empty() ? 0.0 : *std::max_element(v.begin(), v.end());
}

double min_of(const std::vector<double>& v) {
  return v.empty() ? 0.0 : *std::min_element(v.begin(), v.end());
}

// ---- command line and JSON ---------------------------------------------------------------------

void add_output_flags(Flags& flags, std::string& json, std::string& label) {
  flags.add("json", json, "write the results as JSON to this file")
      .add("label", label, "free text copied into the JSON (run_all.sh: the git revision)");
}

void parse_flags_or_exit(Flags& flags, const std::string& program, int argc, char** argv) {
  try {
    if (!flags.parse(argc, argv)) std::exit(0);
  } catch (const std::invalid_argument& e) {
    fmt::print(stderr, "{}: {} (see --help)\n", program, e.what());
    std::exit(2);
  }
}

bool write_json(const std::string& path, const Json& json, const std::string& program) {
  std::ofstream out(path);
  out << json.dump(2) << "\n";
  if (!out) {
    fmt::print(stderr, "{}: cannot write {}\n", program, path);
    return false;
  }
  fmt::print("\nwrote {}\n", path);
  return true;
}

// ---- machine ------------------------------------------------------------------------------------

double load_average() {
  std::ifstream in("/proc/loadavg");
  double load = -1.0;
  in >> load;
  return load;
}

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(colon + 2);
    }
  }
  return "unknown";
}

Json machine_json(double load_before, double load_after) {
  return Json{{"cpu", cpu_model()},
              {"hardware_threads", std::thread::hardware_concurrency()},
              {"threads", at::get_num_threads()},
              {"libtorch", TORCH_VERSION},
              {"load_average_before", load_before},
              {"load_average_after", load_after}};
}

void print_timed_section(double seconds, double load_before, double load_after) {
  fmt::print(
      "timed section {:.1f} s; load average (1 min) {:.2f} before, {:.2f} after on {} "
      "hardware threads\n",
      seconds, load_before, load_after, std::thread::hardware_concurrency());
}

// ---- models, gradients and Shampoo settings -----------------------------------------------------

torch::nn::Sequential make_mlp(at::IntArrayRef sizes) {
  torch::nn::Sequential model;
  const size_t layers = sizes.size() - 1;
  for (size_t l = 0; l < layers; ++l) {
    model->push_back(torch::nn::Linear(sizes[l], sizes[l + 1]));
    if (l + 1 < layers) model->push_back(torch::nn::ReLU());
  }
  return model;
}

std::string mlp_name(at::IntArrayRef sizes) { return fmt::format("mlp {}", fmt::join(sizes, "-")); }

torch::nn::Sequential make_layered_mlp(int64_t layers, int64_t width) {
  torch::nn::Sequential model;
  for (int64_t l = 0; l < layers; ++l) {
    model->push_back(torch::nn::Linear(width, width));
    model->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
    model->push_back(torch::nn::ReLU());
  }
  return model;
}

std::string layered_mlp_name(int64_t layers, int64_t width) {
  return fmt::format("mlp {} x [Linear({}, {}), LayerNorm({}), ReLU]", layers, width, width, width);
}

std::vector<std::vector<int64_t>> transformer_workload_shapes(int64_t divisor) {
  std::vector<std::vector<int64_t>> shapes{{4096, 1024}};
  for (int layer = 0; layer < 2; ++layer) {
    for (const auto& s : std::vector<std::vector<int64_t>>{{3072, 1024},
                                                           {3072},
                                                           {1024, 1024},
                                                           {1024},
                                                           {4096, 1024},
                                                           {4096},
                                                           {1024, 4096},
                                                           {1024},
                                                           {1024},
                                                           {1024}}) {
      shapes.push_back(s);
    }
  }
  for (auto& s : shapes) {
    for (auto& d : s) d /= divisor;
  }
  return shapes;
}

std::vector<std::vector<int64_t>> mlp_workload_shapes(int64_t divisor) {
  std::vector<std::vector<int64_t>> shapes{{2048, 784}, {2048},     {1024, 2048}, {1024},
                                           {512, 1024}, {512},      {10, 512},    {10}};
  for (auto& s : shapes) {
    for (auto& d : s) d = std::max<int64_t>(1, d / divisor);
  }
  return shapes;
}

std::vector<std::vector<at::Tensor>> make_gradient_pool(torch::nn::Sequential& model, int64_t k,
                                                        int64_t batch, int64_t in_features,
                                                        int64_t classes) {
  std::vector<std::vector<at::Tensor>> pool;
  for (int64_t i = 0; i < k; ++i) {
    model->zero_grad();
    const auto x = torch::randn({batch, in_features});
    const auto y = torch::randint(classes, {batch}, torch::kLong);
    torch::nn::functional::cross_entropy(model->forward(x), y).backward();
    std::vector<at::Tensor> grads;
    for (const auto& p : model->parameters()) grads.push_back(p.grad().detach().clone());
    pool.push_back(std::move(grads));
  }
  model->zero_grad();
  return pool;
}

std::vector<at::Tensor> clone_params(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone().set_requires_grad(true));
  return out;
}

void set_gradients(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    auto& g = params[i].mutable_grad();
    if (!g.defined()) g = torch::empty_like(params[i]);
    g.copy_(grads[i]);
  }
}

int64_t numel_of(const std::vector<at::Tensor>& tensors) {
  int64_t numel = 0;
  for (const auto& t : tensors) numel += t.numel();
  return numel;
}

shampoo::ShampooOptions shampoo_options(int64_t frequency, int64_t start) {
  return shampoo::ShampooOptions::reference_defaults(1e-3)
      .betas(std::make_tuple(0.9, 0.999))
      .epsilon(1e-12)
      .max_preconditioner_dim(1024)
      .precondition_frequency(frequency)
      .start_preconditioning_step(start)
      .grafting(shampoo::AdamGraftingConfig{0.999, 1e-8});
}

bool is_root_step(int64_t t, int64_t start, int64_t frequency) {
  return t == start || (t > start && t % frequency == 0);
}

std::vector<torch::optim::OptimizerParamGroup> lr_param_groups(
    const std::vector<at::Tensor>& params, int64_t groups, const shampoo::ShampooOptions& options) {
  const auto per_group = static_cast<int64_t>(params.size()) / groups;
  std::vector<torch::optim::OptimizerParamGroup> param_groups;
  for (int64_t g = 0; g < groups; ++g) {
    std::vector<at::Tensor> members(params.begin() + g * per_group,
                                    params.begin() + (g + 1) * per_group);
    auto group_options = std::make_unique<shampoo::ShampooOptions>(options);
    group_options->lr(options.lr() * (1.0 + static_cast<double>(g) / static_cast<double>(groups)));
    param_groups.emplace_back(std::move(members), std::move(group_options));
  }
  return param_groups;
}

// ---- ranks as threads ---------------------------------------------------------------------------

void run_ranks_as_threads(
    int world, int threads_per_rank,
    const std::function<void(int, const c10::intrusive_ptr<c10d::ProcessGroup>&)>& fn) {
  shampoo::testing::run_ranks_as_threads(world, fn, std::chrono::minutes(5), /*with_nccl=*/false,
                                         threads_per_rank);
}

void barrier(const c10::intrusive_ptr<c10d::ProcessGroup>& group) {
  (void)max_over_ranks(group, 0.0);
}

double max_over_ranks(const c10::intrusive_ptr<c10d::ProcessGroup>& group, double value) {
  std::vector<at::Tensor> t{at::full({1}, value, at::TensorOptions().dtype(at::kDouble))};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MAX;
  group->getBackend(c10::DeviceType::CPU)->allreduce(t, options)->wait();
  return t[0].item<double>();
}

std::vector<std::vector<int64_t>> gather_from_ranks(
    const c10::intrusive_ptr<c10d::ProcessGroup>& group, const std::vector<int64_t>& values) {
  const auto n = static_cast<int64_t>(values.size());
  const int world = group->getSize();
  auto send = at::tensor(values, at::TensorOptions().dtype(at::kLong));
  auto receive = at::empty({world * n}, send.options());
  group->getBackend(c10::DeviceType::CPU)->_allgather_base(receive, send)->wait();
  std::vector<std::vector<int64_t>> out(world);
  const auto* data = receive.data_ptr<int64_t>();
  for (int r = 0; r < world; ++r) out[r].assign(data + r * n, data + (r + 1) * n);
  return out;
}

int64_t nbytes_of(const std::vector<at::Tensor>& tensors) {
  int64_t bytes = 0;
  for (const auto& t : tensors) bytes += t.defined() ? static_cast<int64_t>(t.nbytes()) : 0;
  return bytes;
}

std::string format_bytes(int64_t bytes) {
  std::string digits = std::to_string(bytes < 0 ? -bytes : bytes);
  std::string grouped;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) grouped += ',';
    grouped += digits[i];
  }
  return fmt::format("{}{} ({:.1f} MiB)", bytes < 0 ? "-" : "", grouped,
                     static_cast<double>(bytes) / 1048576.0);
}

// ---- elementwise chain -------------------------------------------------------------------------

namespace {

/// Adam grafting, momentum, decoupled weight decay.
shampoo::kernels::ChainScalars chain_scalars() {
  shampoo::kernels::ChainScalars s;
  s.beta1 = 0.9;
  s.beta3 = 0.9;
  s.filter_bias_correction = 0.5;
  s.diagonal_beta2 = 0.999;
  s.diagonal_weight = 0.001;
  s.diagonal_bias_correction = 0.01;
  s.diagonal_epsilon = 1e-8;
  s.direction_mode = static_cast<int32_t>(shampoo::kernels::DirectionMode::kGraftNorm);
  s.decoupled_weight_decay = 1e-4;
  s.momentum = 0.9;
  s.lr = 1e-3;
  return s;
}

}  // namespace

ChainTensors make_chain(int64_t count, at::IntArrayRef block_shape,
                        const at::TensorOptions& options) {
  ChainTensors t;
  for (int64_t i = 0; i < count; ++i) {
    t.grad.push_back(at::randn(block_shape, options));
    t.param.push_back(at::randn(block_shape, options));
    t.filter.push_back(at::zeros(block_shape, options));
    t.diagonal.push_back(at::zeros(block_shape, options));
    t.momentum.push_back(at::zeros(block_shape, options));
    t.pre.push_back(at::randn(block_shape, options));
    t.filtered.push_back(at::empty(block_shape, options));
    shampoo::detail::ChainBlockTensors c;
    c.grad = t.grad[i];
    c.param = t.param[i];
    c.param_out = t.param[i];
    c.gradient_out = t.filtered[i];
    c.filtered_out = t.filtered[i];
    c.filter_state = t.filter[i];
    c.diagonal_state = t.diagonal[i];
    c.momentum_state = t.momentum[i];
    c.preconditioned = t.pre[i];
    c.scalars = chain_scalars();
    t.blocks.push_back(c);
  }
  return t;
}

}  // namespace shampoo::bench
