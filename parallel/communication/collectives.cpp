#include "parallel/communication/collectives.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <c10/util/hash.h>

#include <cstring>
#include <map>
#include <string>
#include <tuple>

namespace shampoo::detail {
namespace {

c10::intrusive_ptr<c10d::Backend> backend_for(c10d::ProcessGroup& group, const at::Tensor& t) {
  return group.getBackend(t.device().type());
}

}  // namespace

CollectiveWork start_all_reduce(c10d::ProcessGroup& group, std::vector<at::Tensor>& tensors) {
  return backend_for(group, tensors.at(0))->allreduce(tensors);
}

CollectiveWork start_reduce(c10d::ProcessGroup& group, std::vector<at::Tensor>& tensors, int root) {
  c10d::ReduceOptions options;
  options.rootRank = root;
  return backend_for(group, tensors.at(0))->reduce(tensors, options);
}

CollectiveWork start_broadcast(c10d::ProcessGroup& group, std::vector<at::Tensor>& tensors,
                               int root) {
  c10d::BroadcastOptions options;
  options.rootRank = root;
  return backend_for(group, tensors.at(0))->broadcast(tensors, options);
}

CollectiveWork start_all_gather(c10d::ProcessGroup& group, at::Tensor& output, at::Tensor& input) {
  return backend_for(group, input)->_allgather_base(output, input);
}

CollectiveWork start_reduce_scatter(c10d::ProcessGroup& group, at::Tensor& output,
                                    at::Tensor& input) {
  return backend_for(group, input)->_reduce_scatter_base(output, input);
}

CollectiveWork start_all_to_all(c10d::ProcessGroup& group, at::Tensor& output, at::Tensor& input,
                                std::vector<int64_t> output_splits,
                                std::vector<int64_t> input_splits) {
  return backend_for(group, input)->alltoall_base(output, input, output_splits, input_splits);
}

int64_t fingerprint(const std::vector<int64_t>& values) {
  std::string bytes(sizeof(int64_t) * (values.size() + 1), '\0');
  const auto count = static_cast<int64_t>(values.size());
  std::memcpy(bytes.data(), &count, sizeof(count));
  if (!values.empty()) {
    std::memcpy(bytes.data() + sizeof(count), values.data(), sizeof(int64_t) * values.size());
  }
  // The digest as hex: its first 16 digits are the first 64 bits; one is dropped to stay >= 0.
  const auto digest = c10::sha1(bytes).str();
  return static_cast<int64_t>(std::stoull(digest.substr(0, 16), nullptr, 16) >> 1);
}

Fingerprint& Fingerprint::add_list(at::IntArrayRef values) {
  add(static_cast<int64_t>(values.size()));
  values_.insert(values_.end(), values.begin(), values.end());
  return *this;
}

std::vector<std::vector<int64_t>> gather_int64(c10d::ProcessGroup& group,
                                               const std::vector<int64_t>& values) {
  const auto n = static_cast<int64_t>(values.size());
  const int world = group.getSize();
  auto send = at::tensor(values, at::TensorOptions().dtype(at::kLong));
  auto receive = at::empty({world * n}, send.options());
  start_all_gather(group, receive, send)->wait();
  std::vector<std::vector<int64_t>> out(world);
  const auto* data = receive.data_ptr<int64_t>();
  for (int r = 0; r < world; ++r) out[r].assign(data + r * n, data + (r + 1) * n);
  return out;
}

std::optional<int> first_differing_rank(const std::vector<std::vector<int64_t>>& all) {
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r] != all[0]) return static_cast<int>(r);
  }
  return std::nullopt;
}

namespace {

std::string shown_flag(int64_t value) { return value != 0 ? "true" : "false"; }
std::string shown_number(int64_t value) { return std::to_string(value); }
std::string shown_dtype(int64_t value) {
  return value < 0 ? "unset" : c10::toString(static_cast<at::ScalarType>(value));
}

}  // namespace

SharedSetting SharedSetting::flag(std::string name, bool value) {
  return {std::move(name), value ? 1 : 0, shown_flag};
}

SharedSetting SharedSetting::number(std::string name, int64_t value) {
  return {std::move(name), value, shown_number};
}

SharedSetting SharedSetting::dtype(std::string name, std::optional<at::ScalarType> value) {
  return {std::move(name), value ? static_cast<int64_t>(*value) : -1, shown_dtype};
}

void check_settings_agree(c10d::ProcessGroup& group, const std::string& who,
                          const std::vector<SharedSetting>& settings) {
  std::vector<int64_t> mine;
  for (const auto& setting : settings) mine.push_back(setting.value);
  const auto all = gather_int64(group, mine);
  std::string differing;
  for (size_t s = 0; s < settings.size(); ++s) {
    std::string ranks;  // the first three ranks that differ
    int count = 0;
    for (size_t r = 1; r < all.size() && count <= 3; ++r) {
      if (all[r][s] == all[0][s]) continue;
      ranks +=
          count == 3 ? "..., " : c10::str("rank ", r, " has ", settings[s].shown(all[r][s]), ", ");
      ++count;
    }
    if (count == 0) continue;
    differing += c10::str(" ", settings[s].name, " differs between the ranks: ", ranks,
                          "rank 0 has ", settings[s].shown(all[0][s]), ";");
  }
  TORCH_CHECK(differing.empty(), who,
              "every rank must be constructed with the same options where they decide what a "
              "rank sends:",
              differing, " the ranks' collectives would not match");
}

void wait_collectives(std::vector<c10::intrusive_ptr<c10d::Work>>& works, const std::string& who,
                      const std::string& what, int rank) {
  std::string failure;
  for (auto& work : works) {
    try {
      work->wait();
    } catch (const std::exception& e) {
      if (failure.empty()) failure = e.what();
    }
  }
  works.clear();
  TORCH_CHECK(failure.empty(), who, what, " failed on rank ", rank,
              " (did another rank stop, or time out?): ", failure);
}

void broadcast_from_rank_zero(c10d::ProcessGroup& group, const std::vector<at::Tensor>& tensors,
                              const std::string& who, const std::string& what) {
  // c10::Device has no ordering: the kind is (dtype, device type, device index).
  using Kind = std::tuple<int, int, int>;
  std::map<Kind, std::vector<at::Tensor>> by_kind;
  for (const auto& t : tensors) {
    by_kind[{static_cast<int>(t.scalar_type()), static_cast<int>(t.device().type()),
             static_cast<int>(t.device().index())}]
        .push_back(t);
  }
  at::NoGradGuard no_grad;
  for (auto& [kind, members] : by_kind) {
    std::vector<at::Tensor> flat;
    for (const auto& t : members) flat.push_back(t.detach().reshape({-1}));
    std::vector<at::Tensor> buffer{at::cat(flat)};
    std::vector<CollectiveWork> works{start_broadcast(group, buffer, 0)};
    wait_collectives(works, who, what, group.getRank());
    int64_t offset = 0;
    for (auto& t : members) {
      t.variable_data().copy_(buffer[0].narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

}  // namespace shampoo::detail
