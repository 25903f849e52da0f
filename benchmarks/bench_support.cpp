#include "benchmarks/bench_support.h"

#include <ATen/Parallel.h>
#include <time.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <mutex>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "distributor/process_group.h"

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

// ---- command line -------------------------------------------------------------------------------

void Flags::add_int(const std::string& flag, int64_t* value, int64_t min) {
  ints_[flag] = {value, min};
}
void Flags::add_string(const std::string& flag, std::string* value) { strings_[flag] = value; }
void Flags::add_bool(const std::string& flag, bool* value) { bools_[flag] = value; }

void Flags::usage(const std::string& error) const {
  if (!error.empty()) std::cerr << program_ << ": " << error << "\n";
  std::cerr << "usage: " << program_ << " " << usage_ << "\n";
  std::exit(error.empty() ? 0 : 2);
}

void Flags::parse(int argc, char** argv) const {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") usage("");
    if (const auto it = bools_.find(a); it != bools_.end()) {
      *it->second = true;
      continue;
    }
    if (i + 1 >= argc && (ints_.count(a) != 0 || strings_.count(a) != 0)) {
      usage(a + " needs a value");
    }
    if (const auto it = ints_.find(a); it != ints_.end()) {
      char* end = nullptr;
      const long long v = std::strtoll(argv[++i], &end, 10);
      if (end == nullptr || *end != '\0' || v < it->second.second) {
        usage(a + ": got '" + argv[i] +
              "', expected an integer >= " + std::to_string(it->second.second));
      }
      *it->second.first = static_cast<int64_t>(v);
    } else if (const auto it = strings_.find(a); it != strings_.end()) {
      *it->second = argv[++i];
    } else {
      usage("unknown argument '" + a + "'");
    }
  }
}

// ---- JSON and machine ---------------------------------------------------------------------------

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

std::string json_array(const std::vector<double>& v) {
  std::ostringstream out;
  out << std::setprecision(6) << "[";
  for (size_t i = 0; i < v.size(); ++i) out << (i ? ", " : "") << v[i];
  out << "]";
  return out.str();
}

std::string json_array(const std::vector<int64_t>& v) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < v.size(); ++i) out << (i ? ", " : "") << v[i];
  out << "]";
  return out.str();
}

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

std::string machine_json(double load_before, double load_after) {
  std::ostringstream out;
  out << std::setprecision(6) << "{\"cpu\": " << json_string(cpu_model())
      << ", \"hardware_threads\": " << std::thread::hardware_concurrency()
      << ", \"threads\": " << at::get_num_threads()
      << ", \"libtorch\": " << json_string(TORCH_VERSION)
      << ", \"load_average_before\": " << load_before << ", \"load_average_after\": " << load_after
      << "}";
  return out.str();
}

// ---- ranks as threads ---------------------------------------------------------------------------

void run_ranks_as_threads(
    int world, int threads_per_rank,
    const std::function<void(int, const c10::intrusive_ptr<c10d::ProcessGroup>&)>& fn) {
  // As tests/support/test_support.cpp run_ranks: c10d's flight recorder races when several
  // ranks of one process enqueue collectives at once.
  setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0);
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::mutex mutex;
  std::exception_ptr first_error;
  int failed_rank = -1;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        at::set_num_threads(threads_per_rank);
        auto group =
            shampoo::detail::make_process_group(store, rank, world, std::chrono::minutes(5),
                                                /*with_nccl=*/false);
        fn(rank, group);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!first_error) {
          first_error = std::current_exception();
          failed_rank = rank;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  if (first_error) {
    try {
      std::rethrow_exception(first_error);
    } catch (const c10::Error& e) {
      throw std::runtime_error("rank " + std::to_string(failed_rank) + ": " +
                               e.what_without_backtrace());
    } catch (const std::exception& e) {
      throw std::runtime_error("rank " + std::to_string(failed_rank) + ": " + e.what());
    }
  }
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
  std::ostringstream out;
  out << (bytes < 0 ? "-" : "") << grouped << " (" << std::fixed << std::setprecision(1)
      << static_cast<double>(bytes) / 1048576.0 << " MiB)";
  return out.str();
}

}  // namespace shampoo::bench
