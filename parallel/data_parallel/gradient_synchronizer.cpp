#include "parallel/data_parallel/gradient_synchronizer.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <tuple>

#include "parallel/communication/collectives.h"
#include "parallel/communication/process_group.h"
#include "parallel/data_parallel/grad_ready_hooks.h"
#include "parallel/data_parallel/spread_grad_norm.h"
#include "parallel/optimizers/capabilities.h"
#include "parallel/optimizers/parameter_owners.h"

namespace shampoo {
namespace {

constexpr int kFrozen = -2;  // owner() of a parameter that requires no gradient

/// Orders tensors by owner, dtype and device (c10::Device has no ordering).
using BucketKey = std::tuple<int, int, int, int>;
BucketKey bucket_key(const at::Tensor& t, int owner) {
  return {owner, static_cast<int>(t.scalar_type()), static_cast<int>(t.device().type()),
          static_cast<int>(t.device().index())};
}

/// Every parameter is a dense floating-point leaf tensor.
void check_params(const std::vector<at::Tensor>& params) {
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    TORCH_CHECK(p.defined() && p.is_leaf(), "GradientSynchronizer: parameter ", i,
                " must be a leaf tensor (a module's parameter), got a computed tensor");
    TORCH_CHECK(p.is_floating_point() && p.layout() == at::kStrided,
                "GradientSynchronizer: parameter ", i,
                " must be a dense floating-point tensor, got ", p.scalar_type(), " ", p.layout());
  }
}

/// The ranks must pass the same parameters and freeze the same ones: one small AllGather, and an
/// error on every rank (never a hang in a later collective) when they differ.
void check_ranks_agree(const std::vector<at::Tensor>& params, c10d::ProcessGroup& group) {
  int64_t numel = 0;
  std::vector<int64_t> frozen;
  detail::Fingerprint shapes;  // the buckets follow the list
  for (size_t i = 0; i < params.size(); ++i) {
    numel += params[i].numel();
    if (!params[i].requires_grad()) frozen.push_back(static_cast<int64_t>(i));
    shapes.add(static_cast<int64_t>(params[i].scalar_type())).add_list(params[i].sizes());
  }
  const std::vector<int64_t> mine{
      static_cast<int64_t>(params.size()), numel,
      static_cast<int64_t>(frozen.size()), frozen.empty() ? -1 : frozen.front(),
      detail::fingerprint(frozen),         shapes.value()};
  const auto all = detail::gather_int64(group, mine);
  const int rank = group.getRank();
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    TORCH_CHECK(all[r][0] == mine[0] && all[r][1] == mine[1], "GradientSynchronizer: rank ", r,
                " has ", all[r][0], " parameters with ", all[r][1], " elements, rank ", rank,
                " has ", mine[0], " with ", mine[1], "; every rank must pass the same parameters");
    TORCH_CHECK(all[r][2] == mine[2] && all[r][4] == mine[4],
                "GradientSynchronizer: the parameters that need no gradient (requires_grad false) "
                "differ between ranks: rank ",
                r, " has ", all[r][2], all[r][3] >= 0 ? " (the first is parameter " : "",
                all[r][3] >= 0 ? std::to_string(all[r][3]) + ")" : std::string(), ", rank ", rank,
                " has ", mine[2], mine[3] >= 0 ? " (the first is parameter " : "",
                mine[3] >= 0 ? std::to_string(mine[3]) + ")" : std::string(),
                "; every rank must freeze the same parameters, or gradients would be averaged "
                "(or reduced to their owner) over different sets");
    TORCH_CHECK(all[r][5] == mine[5], "GradientSynchronizer: rank ", r,
                " passes as many parameters with as many elements as rank ", rank,
                ", but in other shapes or dtypes, or in another order; every rank must pass the "
                "same parameters in the same order, or gradients would be averaged with other "
                "parameters' gradients");
  }
}

/// The parameters (indices) of each bucket, buckets in the order they are opened: parameters in
/// reverse registration order (gradients arrive roughly last layer first), one owner, dtype and
/// device per bucket, a bucket closed when the next parameter would take it over `cap_bytes`.
std::vector<std::vector<int64_t>> bucket_members(const std::vector<at::Tensor>& params,
                                                 const std::vector<int>& owners,
                                                 int64_t cap_bytes) {
  std::vector<std::vector<int64_t>> members;
  std::vector<int64_t> bytes;  // per bucket
  std::map<BucketKey, int64_t> open;
  for (int64_t i = static_cast<int64_t>(params.size()) - 1; i >= 0; --i) {
    const auto& p = params[i];
    const auto key = bucket_key(p, owners[i]);
    const int64_t size = p.numel() * static_cast<int64_t>(p.element_size());
    auto it = open.find(key);
    if (it == open.end() || bytes[it->second] + size > cap_bytes) {
      members.emplace_back();
      bytes.push_back(0);
      it = open.insert_or_assign(key, static_cast<int64_t>(members.size()) - 1).first;
    }
    members[it->second].push_back(i);
    bytes[it->second] += size;
  }
  return members;
}

}  // namespace

GradientSynchronizer::GradientSynchronizer(std::vector<at::Tensor> params,
                                           c10::intrusive_ptr<c10d::ProcessGroup> group,
                                           GradientSynchronizerOptions options)
    : group_(std::move(group)), options_(options) {
  TORCH_CHECK(group_, "GradientSynchronizer: process group is null");
  detail::check_settings_agree(
      *group_, "GradientSynchronizer: ",
      {detail::SharedSetting::number("GradientSynchronizerOptions.bucket_cap_bytes",
                                     options_.bucket_cap_bytes()),
       detail::SharedSetting::flag("GradientSynchronizerOptions.broadcast_parameters",
                                   options_.broadcast_parameters())});
  TORCH_CHECK(options_.bucket_cap_bytes() > 0, "GradientSynchronizerOptions.bucket_cap_bytes: got ",
              options_.bucket_cap_bytes(), ", expected > 0");
  check_params(params);
  check_ranks_agree(params, *group_);
  if (options_.broadcast_parameters()) {
    detail::broadcast_from_rank_zero(*group_, params,
                                     "GradientSynchronizer: ", "the broadcast of the parameters");
  }

  synchronized_of_.assign(params.size(), -1);
  given_ = params;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].requires_grad()) continue;
    synchronized_of_[i] = static_cast<int64_t>(params_.size());
    given_index_.push_back(static_cast<int64_t>(i));
    params_.push_back(params[i]);
  }
  owners_.assign(params_.size(), kEveryRank);
  build_buckets();
  arrived_.assign(params_.size(), false);
  accumulated_.assign(params_.size(), false);
  for (size_t i = 0; i < params_.size(); ++i) add_hook(i);
}

void GradientSynchronizer::add_hook(size_t i) {
  hook_handles_.push_back(detail::add_grad_ready_callback(
      params_[i], [this, i](const at::Tensor&) { on_grad_ready(static_cast<int64_t>(i)); }));
}

GradientSynchronizer::~GradientSynchronizer() {
  for (size_t i = 0; i < params_.size(); ++i) {
    detail::remove_grad_ready_callback(params_[i], hook_handles_[i]);
  }
  // Never leave a collective running on buffers about to be freed.
  for (auto& bucket : buckets_) {
    if (bucket.work) {
      try {
        bucket.work->wait();
      } catch (...) {  // NOLINT(bugprone-empty-catch): destructor, the error was reported before
      }
    }
  }
}

void GradientSynchronizer::build_buckets() {
  buckets_.clear();
  bucket_of_.assign(params_.size(), -1);
  for (auto& members : bucket_members(params_, owners_, options_.bucket_cap_bytes())) {
    Bucket bucket;
    int64_t offset = static_cast<int64_t>(members.size());  // flags first
    for (const int64_t i : members) {
      bucket.offsets.push_back(offset);
      offset += params_[i].numel();
      bucket_of_[i] = num_buckets();
    }
    const auto& first = params_[members.front()];
    bucket.root = owners_[members.front()];
    bucket.numel = offset;
    bucket.options = first.options().requires_grad(false);
    // All-reduce buffers are kept (no allocation per step); a reduce buffer lives only while its
    // bucket is in flight, so that a rank holds no gradient memory of what it does not own.
    if (bucket.root == kEveryRank) {
      bucket.buffer = at::zeros({offset}, bucket.options);
    }
    bucket.params = std::move(members);
    buckets_.push_back(std::move(bucket));
  }
}

static_assert(GradientSynchronizer::kEveryRank == ParameterOwners::kEveryRank);

void GradientSynchronizer::shard_gradients(const torch::optim::Optimizer& optimizer) {
  const ParameterOwners* found = detail::capabilities_of(optimizer).owners;
  TORCH_CHECK(found != nullptr,
              "GradientSynchronizer::shard_gradients: this optimizer does not say which rank "
              "steps each parameter; shard gradients for a ShardedOptimizer, a DistributedShampoo "
              "built with DistributedOptions::shard_by_parameter(true), or an InBackwardOptimizer");
  const ParameterOwners& owners = *found;
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(next_to_launch_ == 0 &&
                  std::none_of(arrived_.begin(), arrived_.end(), [](bool a) { return a; }),
              "GradientSynchronizer::shard_gradients: called during a backward pass; call it "
              "between iterations");
  const auto owners_group = owners.owners_group();
  TORCH_CHECK(owners_group,
              "GradientSynchronizer::shard_gradients: the optimizer has no process "
              "group (a single-process optimizer owns every parameter on every rank); build it "
              "over the synchronizer's process group");
  TORCH_CHECK(
      owners_group->getSize() == group_->getSize() && owners_group->getRank() == group_->getRank(),
      "GradientSynchronizer::shard_gradients: the optimizer's process group has size ",
      owners_group->getSize(), " (this rank is ", owners_group->getRank(),
      " there), the synchronizer's has size ", group_->getSize(), " (rank ", group_->getRank(),
      "); they must be groups of the same ranks");
  std::vector<int> owners_now(params_.size(), kEveryRank);
  std::vector<int64_t> listing;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto owner = owners.owner_of(params_[i]);
    if (owner.has_value()) {
      TORCH_CHECK(*owner == kEveryRank || (*owner >= 0 && *owner < group_->getSize()),
                  "GradientSynchronizer::shard_gradients: the owner of parameter ", given_index_[i],
                  " is rank ", *owner, ", outside the group of ", group_->getSize(), " ranks");
      owners_now[i] = *owner;
    }
    listing.push_back(owners_now[i]);
  }
  // Every rank computes the owners from the same inputs; a mismatch (different models, options
  // or world sizes) would pair reduces of different buckets, so it is an error on every rank.
  const auto all = detail::gather_int64(*group_, {detail::fingerprint(listing)});
  for (int r = 0; r < group_->getSize(); ++r) {
    TORCH_CHECK(all[r][0] == all[0][0], "GradientSynchronizer::shard_gradients: rank ", r,
                " assigns the parameters to other owners than rank 0 (the optimizers differ "
                "between ranks: parameters, options or process groups)");
  }
  owners_ = std::move(owners_now);
  sharded_ = true;
  owners_source_ = &owners;
  build_buckets();
}

int GradientSynchronizer::owner(size_t index) const {
  TORCH_CHECK(index < synchronized_of_.size(), "GradientSynchronizer::owner: parameter ", index,
              " out of range (", synchronized_of_.size(), " parameters)");
  const int64_t i = synchronized_of_[index];
  return i < 0 ? kFrozen : owners_[i];
}

bool GradientSynchronizer::holds(int64_t param) const {
  return owners_[param] == kEveryRank || owners_[param] == group_->getRank();
}

void GradientSynchronizer::set_bucket_ready_callback(
    std::function<void(const std::vector<at::Tensor>&)> callback) {
  bucket_ready_ = std::move(callback);
}

GradientSynchronizer::NoSync::NoSync(GradientSynchronizer& owner)
    : owner_(owner), previous_(owner.enabled_) {
  owner_.enabled_ = false;
}

GradientSynchronizer::NoSync::~NoSync() { owner_.enabled_ = previous_; }

void GradientSynchronizer::on_grad_ready(int64_t param) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Remembered also while accumulating: the sum of earlier micro-batches is synchronized even
  // when the last one gives this parameter no gradient.
  accumulated_[param] = true;
  if (!enabled_) return;
  if (arrived_[param]) return;
  arrived_[param] = true;
  ++buckets_[bucket_of_[param]].ready;
  launch_ready_buckets(/*from_hook=*/true);
}

void GradientSynchronizer::launch_ready_buckets(bool from_hook) {
  // Buckets start in index order on every rank, so the collectives always match up.
  while (next_to_launch_ < num_buckets() &&
         buckets_[next_to_launch_].ready ==
             static_cast<int64_t>(buckets_[next_to_launch_].params.size())) {
    launch(buckets_[next_to_launch_++]);
    if (from_hook) ++started_this_iteration_;
  }
  // Finish, in order, the buckets whose collective already completed (overlapping backward).
  while (from_hook && next_to_finish_ < next_to_launch_ &&
         buckets_[next_to_finish_].work->isCompleted()) {
    finish(buckets_[next_to_finish_++]);
  }
}

void GradientSynchronizer::launch(Bucket& bucket) {
  at::NoGradGuard no_grad;
  if (!bucket.buffer.defined()) bucket.buffer = at::empty({bucket.numel}, bucket.options);
  const auto count = static_cast<int64_t>(bucket.params.size());
  const bool reduce = bucket.root != kEveryRank;
  const bool keep = !reduce || bucket.root == group_->getRank();
  auto flags = bucket.buffer.narrow(0, 0, count);
  flags.zero_();
  for (int64_t k = 0; k < count; ++k) {
    const int64_t i = bucket.params[k];
    auto& p = params_[i];
    const auto& grad = p.grad();
    auto values = bucket.buffer.narrow(0, bucket.offsets[k], p.numel());
    if (grad.defined() && accumulated_[i]) {
      values.view(p.sizes()).copy_(grad);
      flags[k].fill_(1);
    } else {
      values.zero_();
    }
    // Packed: a rank that does not own the bucket needs none of its gradients any more.
    if (!keep && grad.defined()) p.mutable_grad().reset();
  }
  std::vector<at::Tensor> tensors{bucket.buffer};
  bucket.work = reduce ? detail::start_reduce(*group_, tensors, bucket.root)
                       : detail::start_all_reduce(*group_, tensors);
}

void GradientSynchronizer::finish(Bucket& bucket) {
  bucket.work->wait();
  at::NoGradGuard no_grad;
  const bool reduce = bucket.root != kEveryRank;
  std::vector<at::Tensor> ready;
  if (!reduce || bucket.root == group_->getRank()) {
    const auto world = static_cast<double>(group_->getSize());
    const auto count = static_cast<int64_t>(bucket.params.size());
    const auto flags = bucket.buffer.narrow(0, 0, count).to(at::kCPU, at::kDouble).contiguous();
    const double* present = flags.data_ptr<double>();
    for (int64_t k = 0; k < count; ++k) {
      auto& p = params_[bucket.params[k]];
      if (present[k] == 0.0) {  // no rank had a gradient
        if (reduce) ready.push_back(p);
        continue;
      }
      const auto average =
          bucket.buffer.narrow(0, bucket.offsets[k], p.numel()).view(p.sizes()) / world;
      if (p.grad().defined()) {
        p.mutable_grad().copy_(average);
      } else {
        p.mutable_grad() = average;
      }
      ready.push_back(p);
    }
  } else {
    for (const int64_t i : bucket.params) ready.push_back(params_[i]);
  }
  if (reduce) bucket.buffer = at::Tensor();
  // A sharded bucket is announced on every rank (owners and the others alike), so that
  // collectives run from the callback match up; an all-reduced one when any rank had a gradient.
  if (bucket_ready_ && !ready.empty()) bucket_ready_(ready);
}

void GradientSynchronizer::synchronize() {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& bucket : buckets_) bucket.ready = static_cast<int64_t>(bucket.params.size());
  launch_ready_buckets(/*from_hook=*/false);
  while (next_to_finish_ < num_buckets()) finish(buckets_[next_to_finish_++]);
  adopt_unfrozen();
  started_in_backward_ = started_this_iteration_;
  started_this_iteration_ = 0;
  for (auto& bucket : buckets_) {
    bucket.ready = 0;
    bucket.work.reset();
  }
  arrived_.assign(params_.size(), false);
  accumulated_.assign(params_.size(), false);
  next_to_launch_ = 0;
  next_to_finish_ = 0;
}

void GradientSynchronizer::adopt_unfrozen() {
  // A parameter frozen when the synchronizer was built that has a gradient now: a layer
  // unfrozen later (requires_grad on, then added to the optimizer). Its gradient of this pass is
  // averaged here, and it is synchronized like the others from the next pass on.
  std::vector<int64_t> positions;
  for (size_t pos = 0; pos < given_.size(); ++pos) {
    if (synchronized_of_[pos] < 0 && given_[pos].grad().defined()) {
      positions.push_back(static_cast<int64_t>(pos));
    }
  }
  if (positions.empty()) return;
  const auto all = detail::gather_int64(
      *group_,
      {static_cast<int64_t>(positions.size()), positions.front(), detail::fingerprint(positions)});
  for (int r = 0; r < group_->getSize(); ++r) {
    TORCH_CHECK(all[r] == all[0],
                "GradientSynchronizer: parameters frozen at construction have "
                "gradients now (a layer was unfrozen): rank ",
                r, " has ", all[r][0], " such (the first is parameter ", all[r][1],
                "), rank 0 has ", all[0][0], " (the first is parameter ", all[0][1],
                "); every rank must unfreeze the same parameters");
  }
  at::NoGradGuard no_grad;
  const auto world = static_cast<double>(group_->getSize());
  std::vector<at::Tensor> ready;
  for (const int64_t pos : positions) {
    auto& p = given_[pos];
    std::vector<at::Tensor> sum{p.grad().detach().clone()};
    detail::start_all_reduce(*group_, sum)->wait();
    p.mutable_grad().copy_(sum[0] / world);
    const auto index = params_.size();
    synchronized_of_[pos] = static_cast<int64_t>(index);
    given_index_.push_back(pos);
    params_.push_back(p);
    // An optimizer that does not know the parameter yet (a group added through the base
    // class is registered at its next step) gets it all-reduced on every rank.
    std::optional<int> owner;
    if (owners_source_ != nullptr) owner = owners_source_->owner_of(p);
    owners_.push_back(owner.value_or(kEveryRank));
    add_hook(index);
    if (!holds(static_cast<int64_t>(index))) p.mutable_grad() = at::Tensor();
    ready.push_back(p);
  }
  arrived_.assign(params_.size(), false);
  accumulated_.assign(params_.size(), false);
  build_buckets();
  if (bucket_ready_) bucket_ready_(ready);
}

double GradientSynchronizer::clip_grad_norm_(double max_norm, double norm_type) {
  // Each gradient's norm counted on the rank that owns it (replicated ones on rank 0).
  const int rank = group_->getRank();
  std::vector<detail::SpreadGradient> gradients;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& p = params_[i];
    const bool counted = owners_[i] == kEveryRank ? rank == 0 : owners_[i] == rank;
    const auto& grad = p.grad();
    gradients.push_back({counted ? grad : at::Tensor(),
                         holds(static_cast<int64_t>(i)) ? grad : at::Tensor(), p.options()});
  }
  return detail::clip_spread_grad_norm_(*group_, gradients, max_norm, norm_type,
                                        "GradientSynchronizer::clip_grad_norm_");
}

int64_t GradientSynchronizer::gradient_bytes() const {
  int64_t bytes = 0;
  for (const auto& p : params_) {
    if (p.grad().defined()) bytes += static_cast<int64_t>(p.grad().nbytes());
  }
  return bytes;
}

int64_t GradientSynchronizer::buffer_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t bytes = 0;
  for (const auto& bucket : buckets_) {
    if (bucket.buffer.defined()) bytes += static_cast<int64_t>(bucket.buffer.nbytes());
  }
  return bytes;
}

}  // namespace shampoo
