/// The optimizer state the defaults keep, as a multiple of the parameters' bytes, per workload:
/// DistributedShampoo's memory_summary() by kind before the first step and after `--steps`
/// steps (the β1 filter M is allocated at the first step that uses it), for the library's
/// defaults, the reference's (ShampooOptions::reference_defaults) and the defaults with
/// compact_state(kBfloat16); and AdamW's state (its two moments) for comparison. Bytes, not time:
/// the figures do not depend on the machine.
///
/// Workloads (parameter shapes as the models hold them, gradients drawn from a fixed seed):
///   convnet       make compare's Fashion-MNIST ConvNet (examples/models.h)
///   lstm          make compare's LSTM language model (10000-word vocabulary, d = 128, tied)
///   gpt-tiny      a nanoGPT-style transformer: 4 layers, 4 heads, width 64, vocabulary 65,
///                 context 64, tied head (0.21M parameters)
///   gpt-char      nanoGPT's shakespeare_char: 6 layers, width 384, vocabulary 65, context 256
///                 (10.7M parameters)
///   transformer   bench_transformer's workload of issue 13 (29.4M parameters)
///
///   bench_state_memory [--workloads convnet,lstm,gpt-tiny,gpt-char,transformer] [--steps 2]
///                      [--json PATH] [--label TEXT]
#include <fmt/format.h>
#include <shampoo/shampoo.h>
#include <torch/optim/adamw.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cstdint>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "benchmarks/bench_support.h"
#include "examples/language_model.h"
#include "examples/models.h"

namespace {

using shampoo::bench::Json;
using Shapes = std::vector<std::vector<int64_t>>;

/// nanoGPT's parameters (its lm_head is tied to wte): wte [V, E], wpe [T, E], per layer ln_1,
/// c_attn [3E, E] and bias, c_proj [E, E] and bias, ln_2, c_fc [4E, E] and bias, c_proj [E, 4E]
/// and bias; ln_f.
Shapes gpt_shapes(int64_t layers, int64_t width, int64_t vocabulary, int64_t context) {
  Shapes shapes{{vocabulary, width}, {context, width}};
  for (int64_t l = 0; l < layers; ++l) {
    for (const auto& shape : Shapes{{width},
                                    {width},
                                    {3 * width, width},
                                    {3 * width},
                                    {width, width},
                                    {width},
                                    {width},
                                    {width},
                                    {4 * width, width},
                                    {4 * width},
                                    {width, 4 * width},
                                    {width}}) {
      shapes.push_back(shape);
    }
  }
  shapes.push_back({width});
  shapes.push_back({width});
  return shapes;
}

Shapes shapes_of(const std::vector<at::Tensor>& params) {
  Shapes out;
  for (const auto& p : params) out.push_back(p.sizes().vec());
  return out;
}

Shapes workload(const std::string& name) {
  if (name == "convnet") {
    return shapes_of(shampoo::examples::ConvNet(1, 10, 28, 28)->parameters());
  }
  if (name == "lstm") {
    return shapes_of(
        shampoo::examples::LstmLanguageModel(shampoo::examples::LanguageModelOptions{})->parameters());
  }
  if (name == "gpt-tiny") return gpt_shapes(4, 64, 65, 64);
  if (name == "gpt-char") return gpt_shapes(6, 384, 65, 256);
  if (name == "transformer") return shampoo::bench::transformer_workload_shapes();
  throw std::invalid_argument("--workloads: unknown workload '" + name +
                              "' (convnet, lstm, gpt-tiny, gpt-char, transformer)");
}

std::vector<at::Tensor> make_params(const Shapes& shapes) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  std::vector<at::Tensor> params;
  for (const auto& shape : shapes) params.push_back(at::randn(shape, gen).mul_(0.02).requires_grad_());
  return params;
}

void set_grads(const std::vector<at::Tensor>& params, int64_t step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  for (const auto& p : params) p.mutable_grad() = at::randn(p.sizes(), gen);
}

struct Setting {
  std::string name;
  shampoo::ShampooOptions options;
};

std::vector<Setting> settings() {
  return {{"defaults", shampoo::ShampooOptions(1e-3)},
          {"reference_defaults", shampoo::ShampooOptions::reference_defaults(1e-3)},
          {"defaults + compact bf16",
           shampoo::ShampooOptions(1e-3).compact_state(shampoo::CompactState::kBfloat16)}};
}

double mb(int64_t bytes) { return static_cast<double>(bytes) / 1e6; }

Json kinds_json(const shampoo::MemorySummary& m) {
  return Json{{"factors", m.factors},
              {"inverse_roots", m.inverse_roots},
              {"eigenvectors", m.eigenvectors},
              {"preconditioner_other", m.preconditioner_other},
              {"grafting", m.grafting},
              {"filtered_gradient", m.filtered_gradient},
              {"momentum", m.momentum},
              {"averaging", m.averaging},
              {"total", m.state_total()}};
}

}  // namespace

int main(int argc, char** argv) {
  std::string workloads = "convnet,lstm,gpt-tiny,gpt-char,transformer";
  int64_t steps = 2;
  std::string json_path;
  std::string label;
  shampoo::bench::Flags flags("bench_state_memory",
                              "Optimizer state per workload as a multiple of the parameters");
  flags.add("workloads", workloads, "comma-separated: convnet, lstm, gpt-tiny, gpt-char, transformer");
  flags.add("steps", steps, "steps before the second measurement", int64_t{1});
  shampoo::bench::add_output_flags(flags, json_path, label);
  shampoo::bench::parse_flags_or_exit(flags, "bench_state_memory", argc, argv);
  at::set_num_threads(1);
  Json results = Json::array();
  fmt::print(
      "State as a multiple of the parameters' bytes (MB in parentheses); after {} step(s) by "
      "kind, MB\n\n| workload | params | setting | before the first step | after | factors | "
      "roots | grafting V | filtered M | other |\n|---|---|---|---|---|---|---|---|---|---|\n",
      steps);
  std::stringstream list(workloads);
  std::string name;
  while (std::getline(list, name, ',')) {
    Shapes shapes;
    try {
      shapes = workload(name);
    } catch (const std::exception& e) {
      fmt::print(stderr, "bench_state_memory: {}\n", e.what());
      return 2;
    }
    const auto probe = make_params(shapes);
    const int64_t param_bytes = shampoo::bench::numel_of(probe) * 4;
    Json row{{"workload", name}, {"param_bytes", param_bytes}, {"settings", Json::array()}};
    for (const auto& setting : settings()) {
      const auto params = make_params(shapes);
      shampoo::DistributedShampoo optimizer(params, setting.options);
      const auto before = optimizer.memory_summary();
      for (int64_t t = 1; t <= steps; ++t) {
        set_grads(params, t);
        optimizer.step();
      }
      const auto after = optimizer.memory_summary();
      const int64_t other = after.eigenvectors + after.preconditioner_other + after.momentum +
                            after.averaging;
      fmt::print("| {} | {:.2f} MB | {} | {:.2f}x ({:.2f}) | {:.2f}x ({:.2f}) | {:.2f} | {:.2f} | "
                 "{:.2f} | {:.2f} | {:.2f} |\n",
                 name, mb(param_bytes), setting.name,
                 static_cast<double>(before.state_total()) / static_cast<double>(param_bytes),
                 mb(before.state_total()),
                 static_cast<double>(after.state_total()) / static_cast<double>(param_bytes),
                 mb(after.state_total()), mb(after.factors), mb(after.inverse_roots),
                 mb(after.grafting), mb(after.filtered_gradient), mb(other));
      row["settings"].push_back(Json{{"setting", setting.name},
                                     {"before_first_step", kinds_json(before)},
                                     {"after_steps", kinds_json(after)}});
    }
    {
      const auto params = make_params(shapes);
      torch::optim::AdamW adamw(params, torch::optim::AdamWOptions(1e-3));
      set_grads(params, 1);
      adamw.step();
      const auto bytes = shampoo::optimizer_state_bytes(adamw);
      fmt::print("| {} | {:.2f} MB | AdamW | - | {:.2f}x ({:.2f}) | | | | | |\n", name,
                 mb(param_bytes), static_cast<double>(bytes) / static_cast<double>(param_bytes),
                 mb(bytes));
      row["adamw_state_bytes"] = bytes;
    }
    results.push_back(row);
  }
  if (!json_path.empty()) {
    Json out{{"benchmark", "bench_state_memory"},
             {"label", label},
             {"steps", steps},
             {"machine", shampoo::bench::machine_json(shampoo::bench::load_average(),
                                                      shampoo::bench::load_average())},
             {"workloads", results}};
    if (!shampoo::bench::write_json(json_path, out, "bench_state_memory")) return 1;
  }
  return 0;
}
