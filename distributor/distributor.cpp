#include "distributor/distributor.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <string>

#include "parallel/communication/collectives.h"
#include "parallel/communication/ownership_plan.h"
#include "parallel/communication/process_group.h"

namespace shampoo::detail {

Distributor::Distributor(DistributorConfig config) : config_(std::move(config)) {
  if (!config_.process_group) return;
  auto& parent = config_.process_group;
  global_rank_ = parent->getRank();
  global_world_size_ = parent->getSize();
  const int64_t trainers =
      config_.num_trainers_per_group == -1 ? global_world_size_ : config_.num_trainers_per_group;
  TORCH_CHECK(trainers >= 1 && trainers <= global_world_size_ && global_world_size_ % trainers == 0,
              "DistributedOptions.num_trainers_per_group: got ", config_.num_trainers_per_group,
              ", expected -1 or a divisor of the world size ", global_world_size_);
  if (trainers == global_world_size_) {
    group_ = parent;
  } else {
    const int first = static_cast<int>(global_rank_ / trainers * trainers);
    // A tag unique to this construction and equal on every rank: rank 0 draws a ticket from the
    // store and everyone receives it with one small AllGather.
    const int64_t ticket =
        global_rank_ == 0 ? parent->getStore()->add("shampoo_subgroup_ticket", 1) : 0;
    const auto tag = std::to_string(gather_from_all_ranks({ticket})[0][0]);
    group_ = make_subgroup(parent, first, static_cast<int>(trainers), tag, group_timeout(*parent));
  }
  rank_ = group_->getRank();
  world_size_ = group_->getSize();
  plan_ = OwnershipPlan(world_size_);
}

std::vector<int> Distributor::add_blocks(const std::vector<DistributedBlock>& blocks) {
  const auto first_new = static_cast<int64_t>(blocks_.size());
  const int64_t element_size = c10::elementSize(config_.communication_dtype);
  std::map<int64_t, std::vector<int64_t>> new_by_unit;
  for (const auto& block : blocks) {
    new_by_unit[block.unit].push_back(static_cast<int64_t>(blocks_.size()));
    blocks_.push_back(block);
  }
  item_of_.resize(blocks_.size(), 0);
  position_.resize(blocks_.size(), 0);
  for (auto& [unit_index, indices] : new_by_unit) {
    if (unit_index >= static_cast<int64_t>(units_.size())) units_.resize(unit_index + 1);
    auto& unit = units_[unit_index];
    // Owned one by one, or with shard_by_parameter a parameter's blocks together.
    std::vector<int64_t> costs, together;
    for (const int64_t b : indices) {
      costs.push_back(block_cost(blocks_[b].numel, element_size));
      together.push_back(config_.shard_by_parameter ? blocks_[b].id.param : b);
    }
    const int64_t first_item = plan_.add_together(costs, together);
    for (size_t i = 0; i < indices.size(); ++i) {
      item_of_[indices[i]] = first_item + static_cast<int64_t>(i);
      unit.blocks.push_back(indices[i]);
    }
    if (distributed()) layout_unit(unit);
  }
  std::vector<int> owners;
  for (auto b = first_new; b < num_blocks(); ++b) owners.push_back(owner(b));
  return owners;
}

void Distributor::layout_unit(Unit& unit) {
  std::sort(unit.blocks.begin(), unit.blocks.end());
  std::vector<int64_t> numels;
  std::vector<int> owners;
  for (size_t i = 0; i < unit.blocks.size(); ++i) {
    const int64_t b = unit.blocks[i];
    position_[b] = static_cast<int64_t>(i);
    numels.push_back(blocks_[b].numel);
    owners.push_back(owner(b));
  }
  unit.layout = OwnerMajorLayout(world_size_, numels, owners, /*with_flags=*/true);
  const auto device = blocks_[unit.blocks.front()].device;
  for (const int64_t b : unit.blocks) {
    TORCH_CHECK(blocks_[b].device == device,
                "DistributedShampoo: all parameters must be on one "
                "device, found ",
                blocks_[b].device, " and ", device);
  }
  const auto options = at::TensorOptions().dtype(config_.communication_dtype).device(device);
  unit.send = unit.layout.make_send(options);
  unit.receive = unit.layout.make_receive(options);
}

void Distributor::begin_step() {
  if (!distributed()) return;
  updated_.assign(blocks_.size(), false);
}

at::Tensor Distributor::slot(int64_t block) {
  TORCH_INTERNAL_ASSERT(distributed() && owns(block));
  const auto& unit = units_[blocks_[block].unit];
  return unit.layout.in_send(unit.send, position_[block]);
}

void Distributor::mark_updated(int64_t block) {
  TORCH_INTERNAL_ASSERT(distributed() && owns(block));
  updated_[block] = true;
}

namespace {

/// The error of a step's collective that failed on this rank: what failed, the likely causes.
std::string collective_failure(const char* what, int rank, const std::exception& e) {
  return fmt::format(
      "DistributedShampoo: {} failed on rank {} (another rank died, hung, or called step() a "
      "different number of times): {}",
      what, rank, e.what());
}

}  // namespace

int64_t Distributor::exchange(bool failed) {
  if (!distributed()) return 0;
  int64_t collectives = 0;
  received_updated_.assign(blocks_.size(), false);
  failed_ranks_.clear();
  std::vector<bool> rank_failed(world_size_, false);
  for (auto& unit : units_) {
    if (unit.blocks.empty()) continue;
    // This rank's status and flags, written with one copy. A failed rank marks no block updated.
    std::vector<float> flags{failed ? 1.0f : 0.0f};
    for (const int64_t b : unit.blocks) {
      if (owns(b)) flags.push_back(updated_[b] && !failed ? 1.0f : 0.0f);
    }
    const auto n = static_cast<int64_t>(flags.size());
    unit.send.narrow(0, 0, n).copy_(at::from_blob(flags.data(), {n}, at::kFloat));
    try {
      detail::start_all_gather(*group_, unit.receive, unit.send)->wait();
    } catch (const std::exception& e) {
      TORCH_CHECK(false, collective_failure("the AllGather of this step", global_rank_, e));
    }
    ++collectives;
    // Every rank's status and flags, read back with one copy.
    const int64_t max_count = unit.layout.header_size();
    const auto received_flags = unit.receive.view({world_size_, unit.layout.segment_size()})
                                    .narrow(1, 0, max_count)
                                    .to(at::kCPU, at::kFloat)
                                    .contiguous();
    const float* data = received_flags.data_ptr<float>();
    for (int r = 0; r < world_size_; ++r) {
      if (data[r * max_count] != 0.0f) rank_failed[r] = true;
    }
    for (const int64_t b : unit.blocks) {
      received_updated_[b] =
          data[owner(b) * max_count + unit.layout.flag(position_[b])] != 0.0f;
    }
  }
  for (int r = 0; r < world_size_; ++r) {
    if (rank_failed[r]) failed_ranks_.push_back(r);
  }
  if (!failed_ranks_.empty()) received_updated_.assign(blocks_.size(), false);
  return collectives;
}

Distributor::Agreement Distributor::agree(Readiness mine, const std::vector<int64_t>& values) {
  if (!distributed()) return {{mine}, {values}};
  // The device of the AllGather buffers (NCCL takes CUDA tensors), else the CPU.
  at::Device device = at::kCPU;
  for (const auto& unit : units_) {
    if (unit.send.defined()) {
      device = unit.send.device();
      break;
    }
  }
  // Rank r's words: its readiness, then its values; each rank fills its own, the sum is all.
  const auto width = static_cast<int64_t>(values.size()) + 1;
  auto mine_words = at::empty({width}, at::kLong);
  mine_words[0] = static_cast<int64_t>(mine);
  for (size_t i = 0; i < values.size(); ++i) mine_words[static_cast<int64_t>(i) + 1] = values[i];
  auto words = at::zeros({world_size_, width}, at::TensorOptions().dtype(at::kLong).device(device));
  words[rank_].copy_(mine_words);
  std::vector<at::Tensor> tensors{words};
  try {
    detail::start_all_reduce(*group_, tensors)->wait();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, collective_failure("the agreement before the step", global_rank_, e));
  }
  const auto host = words.to(at::kCPU).contiguous();
  const int64_t* data = host.data_ptr<int64_t>();
  Agreement all;
  for (int r = 0; r < world_size_; ++r) {
    const int64_t* row = data + r * width;
    TORCH_INTERNAL_ASSERT(row[0] >= 0 && row[0] <= 2, "agreement word ", row[0]);
    all.readiness.push_back(static_cast<Readiness>(row[0]));
    all.values.emplace_back(row + 1, row + width);
  }
  return all;
}

bool Distributor::received_updated(int64_t block) const { return received_updated_[block]; }

at::Tensor Distributor::received(int64_t block) const {
  const auto& unit = units_[blocks_[block].unit];
  return unit.layout.in_receive(unit.receive, position_[block]);
}

std::vector<std::vector<int64_t>> Distributor::gather_from_all_ranks(
    const std::vector<int64_t>& values) {
  if (!config_.process_group) return {values};
  return gather_int64(*config_.process_group, values);
}

int64_t Distributor::bytes_sent_per_step() const {
  int64_t bytes = 0;
  for (const auto& unit : units_) bytes += unit.send.defined() ? unit.send.nbytes() : 0;
  return bytes;
}

int64_t Distributor::bytes_received_per_step() const {
  int64_t bytes = 0;
  for (const auto& unit : units_) bytes += unit.receive.defined() ? unit.receive.nbytes() : 0;
  return bytes;
}

}  // namespace shampoo::detail
