#pragma once
/// Helpers shared by the benchmark programs: timing and medians, the flags every benchmark takes
/// (the examples' CommandLine, CLI11), JSON output (nlohmann-json), what the machine was doing
/// (CPU, load average), the benchmarked models, their gradients and the benchmarks' Shampoo
/// settings, and ranks as threads of one process for the multi-rank benchmarks.

#include <ATen/ATen.h>
#include <shampoo/shampoo.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "examples/command_line.h"
#include "update/elementwise_chain.h"

namespace shampoo::bench {

using Clock = std::chrono::steady_clock;

double elapsed_ms(Clock::time_point begin, Clock::time_point end);
/// CPU time consumed so far by the calling thread (CLOCK_THREAD_CPUTIME_ID), in milliseconds:
/// with one intra-op thread, the work a rank's thread did itself, whatever the machine's load.
double thread_cpu_ms();
/// Median (mean of the two middle values for an even count); 0 for an empty vector.
double median(std::vector<double> v);
double mean(const std::vector<double>& v);
double max_of(const std::vector<double>& v);
double min_of(const std::vector<double>& v);

/// The flags of a benchmark: the examples' CommandLine.
using Flags = shampoo::examples::CommandLine;
/// Adds the flags every benchmark takes: --json PATH (machine-readable results) and --label TEXT
/// (free text copied into the JSON; run_all.sh passes the git revision).
void add_output_flags(Flags& flags, std::string& json, std::string& label);
/// Parses argv; exits 0 after --help, and 2 with "<program>: <error>" on stderr on a bad flag.
void parse_flags_or_exit(Flags& flags, const std::string& program, int argc, char** argv);

/// JSON with keys in the order they were written, as the benchmarks write their results.
using Json = nlohmann::ordered_json;
/// Writes `json` (indented by two) to `path` and says so on stdout; on failure says why on stderr
/// and returns false.
bool write_json(const std::string& path, const Json& json, const std::string& program);

/// 1-minute load average: on a shared machine, how busy it was around the measurement.
double load_average();
std::string cpu_model();
/// {"cpu": ..., "hardware_threads": ..., "threads": ..., "libtorch": ..., load averages}.
Json machine_json(double load_before, double load_after);
/// Prints "timed section S s; load average (1 min) B before, A after on N hardware threads\n"
/// (S with one decimal, the loads with two) on stdout.
void print_timed_section(double seconds, double load_before, double load_after);

/// Models. An MLP of Linear layers sizes[0] -> sizes[1] -> ... -> sizes.back(), ReLU between them,
/// and its name "mlp 784-2048-1024-512-10".
torch::nn::Sequential make_mlp(at::IntArrayRef sizes);
std::string mlp_name(at::IntArrayRef sizes);
/// `layers` x [Linear(width, width), LayerNorm(width), ReLU], and its name
/// "mlp 64 x [Linear(128, 128), LayerNorm(128), ReLU]".
torch::nn::Sequential make_layered_mlp(int64_t layers, int64_t width);
std::string layered_mlp_name(int64_t layers, int64_t width);

/// The parameter shapes of the transformer-like workload of issue 13 (bench_transformer,
/// bench_gradient_sharding; 29.4M parameters in 21 tensors): an embedding (4096, 1024), then
/// twice (3072, 1024), (3072), (1024, 1024), (1024), (4096, 1024), (4096), (1024, 4096), (1024),
/// (1024), (1024); every dim divided by `divisor` (1 = full size).
std::vector<std::vector<int64_t>> transformer_workload_shapes(int64_t divisor = 1);
/// bench_optimizer_step's MLP 784-2048-1024-512-10 (4.2M parameters) as parameter shapes
/// (weights [out, in], then biases), every dimension divided by `divisor`.
std::vector<std::vector<int64_t>> mlp_workload_shapes(int64_t divisor = 1);

/// Gradients of `k` forward/backward passes (cross-entropy) on random batches: Gaussian inputs
/// [batch, in_features], random labels below `classes`. Real gradient structure (a linear
/// layer's gradient has rank <= batch size); pool[i][p] is pass i's gradient of parameter p.
/// Leaves the model without gradients (zero_grad).
std::vector<std::vector<at::Tensor>> make_gradient_pool(torch::nn::Sequential& model, int64_t k,
                                                        int64_t batch, int64_t in_features,
                                                        int64_t classes);

/// Copies of `params` (detached, requiring gradients): a benchmarked optimizer's own parameters.
std::vector<at::Tensor> clone_params(const std::vector<at::Tensor>& params);
/// Copies grads[i] into params[i].grad() (allocated on first use) without autograd recording:
/// the untimed part of a benchmarked step.
void set_gradients(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads);
/// Sum of numel of the tensors.
int64_t numel_of(const std::vector<at::Tensor>& tensors);

/// The benchmarks' Shampoo: lr 1e-3, betas (0.9, 0.999), epsilon 1e-12, max_preconditioner_dim
/// 1024, Adam grafting (beta2 0.999, epsilon 1e-8), with the given precondition_frequency and
/// start_preconditioning_step.
shampoo::ShampooOptions shampoo_options(int64_t frequency, int64_t start);
/// Whether step t (counted from 1) computes roots with these options: the first at `start`, then
/// every multiple of `frequency`.
bool is_root_step(int64_t t, int64_t start, int64_t frequency);
/// `groups` param groups over equal consecutive shares of `params` (group g holds
/// [g·n/groups, (g+1)·n/groups)), that differ only in their learning rate:
/// options.lr()·(1 + g/groups).
std::vector<torch::optim::OptimizerParamGroup> lr_param_groups(
    const std::vector<at::Tensor>& params, int64_t groups, const shampoo::ShampooOptions& options);

/// shampoo::testing::run_ranks_as_threads (tests/support/rank_threads.h) over Gloo with a
/// five-minute timeout, each rank's thread using `threads_per_rank` intra-op threads.
void run_ranks_as_threads(
    int world, int threads_per_rank,
    const std::function<void(int, const c10::intrusive_ptr<c10d::ProcessGroup>&)>& fn);

/// A barrier across the ranks of `group` (one tiny AllReduce): lines up the ranks before timing.
void barrier(const c10::intrusive_ptr<c10d::ProcessGroup>& group);

/// max over the ranks of `group` of a double (one AllReduce).
double max_over_ranks(const c10::intrusive_ptr<c10d::ProcessGroup>& group, double value);

/// AllGathers a few int64 values from every rank: result[r] = rank r's values (same count on
/// every rank).
std::vector<std::vector<int64_t>> gather_from_ranks(
    const c10::intrusive_ptr<c10d::ProcessGroup>& group, const std::vector<int64_t>& values);

/// Sum of nbytes of the tensors (undefined ones count 0).
int64_t nbytes_of(const std::vector<at::Tensor>& tensors);

std::string format_bytes(int64_t bytes);

/// The tensors of a virtual group's elementwise chain over `count` blocks of one shape, and the
/// chain's blocks over them: Adam grafting, momentum 0.9, decoupled weight decay 1e-4, lr 1e-3.
struct ChainTensors {
  std::vector<at::Tensor> grad, param, filter, diagonal, momentum, pre, filtered;
  std::vector<shampoo::detail::ChainBlockTensors> blocks;
};
ChainTensors make_chain(int64_t count, at::IntArrayRef block_shape,
                        const at::TensorOptions& options);  ///< "12,345,678 (11.8 MiB)"

}  // namespace shampoo::bench
