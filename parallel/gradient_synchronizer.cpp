#include "parallel/gradient_synchronizer.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <map>
#include <tuple>

#include "parallel/grad_ready_hooks.h"

namespace shampoo {
namespace {

/// Orders tensors by dtype and device (c10::Device has no ordering).
using KindKey = std::tuple<int, int, int>;
KindKey kind_of(const at::Tensor& t) {
  return {static_cast<int>(t.scalar_type()), static_cast<int>(t.device().type()),
          static_cast<int>(t.device().index())};
}

/// Every parameter is a dense floating-point leaf tensor that requires grad.
void check_params(const std::vector<at::Tensor>& params) {
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    TORCH_CHECK(p.defined() && p.is_leaf() && p.requires_grad(),
                "GradientSynchronizer: "
                "parameter ",
                i, " must be a leaf tensor that requires grad");
    TORCH_CHECK(p.is_floating_point() && p.layout() == at::kStrided,
                "GradientSynchronizer: "
                "parameter ",
                i, " must be a dense floating-point tensor");
  }
}

/// Copies rank 0's parameter values to every rank: one broadcast per dtype/device.
void broadcast_from_rank_zero(const std::vector<at::Tensor>& params, c10d::ProcessGroup& group) {
  std::map<KindKey, std::vector<at::Tensor>> by_kind;
  for (const auto& p : params) by_kind[kind_of(p)].push_back(p);
  at::NoGradGuard no_grad;
  for (auto& [kind, tensors] : by_kind) {
    std::vector<at::Tensor> flat_parts;
    for (const auto& t : tensors) flat_parts.push_back(t.detach().reshape(-1));
    std::vector<at::Tensor> buffer{at::cat(flat_parts)};
    c10d::BroadcastOptions broadcast;
    broadcast.rootRank = 0;
    group.getBackend(buffer[0].device().type())->broadcast(buffer, broadcast)->wait();
    int64_t offset = 0;
    for (auto& t : tensors) {
      t.detach().copy_(buffer[0].narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

/// The parameters (indices) of each bucket, buckets in the order they are opened: parameters in
/// reverse registration order (gradients arrive roughly last layer first), one dtype and device
/// per bucket, a bucket closed when the next parameter would take it over `cap_bytes`.
std::vector<std::vector<int64_t>> bucket_members(const std::vector<at::Tensor>& params,
                                                 int64_t cap_bytes) {
  std::vector<std::vector<int64_t>> members;
  std::vector<int64_t> bytes;  // per bucket
  std::map<KindKey, int64_t> open;
  for (int64_t i = static_cast<int64_t>(params.size()) - 1; i >= 0; --i) {
    const auto& p = params[i];
    const auto key = kind_of(p);
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
    : params_(std::move(params)), group_(std::move(group)), options_(options) {
  TORCH_CHECK(group_, "GradientSynchronizer: process group is null");
  TORCH_CHECK(options_.bucket_cap_bytes() > 0, "GradientSynchronizerOptions.bucket_cap_bytes: got ",
              options_.bucket_cap_bytes(), ", expected > 0");
  check_params(params_);
  if (options_.broadcast_parameters()) broadcast_from_rank_zero(params_, *group_);

  bucket_of_.assign(params_.size(), -1);
  for (auto& members : bucket_members(params_, options_.bucket_cap_bytes())) {
    Bucket bucket;
    int64_t offset = static_cast<int64_t>(members.size());  // flags first
    for (const int64_t i : members) {
      bucket.offsets.push_back(offset);
      offset += params_[i].numel();
      bucket_of_[i] = num_buckets();
    }
    const auto& first = params_[members.front()];
    bucket.buffer = at::zeros({offset}, first.options().requires_grad(false));
    bucket.params = std::move(members);
    buckets_.push_back(std::move(bucket));
  }
  arrived_.assign(params_.size(), false);
  for (size_t i = 0; i < params_.size(); ++i) {
    hook_handles_.push_back(detail::add_grad_ready_callback(
        params_[i], [this, i](const at::Tensor&) { on_grad_ready(static_cast<int64_t>(i)); }));
  }
}

GradientSynchronizer::~GradientSynchronizer() {
  for (size_t i = 0; i < params_.size(); ++i) {
    detail::remove_grad_ready_callback(params_[i], hook_handles_[i]);
  }
  // Never leave an all-reduce running on buffers about to be freed.
  for (auto& bucket : buckets_) {
    if (bucket.work) {
      try {
        bucket.work->wait();
      } catch (...) {  // NOLINT(bugprone-empty-catch): destructor, the error was reported before
      }
    }
  }
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
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(mutex_);
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
  // Finish, in order, the buckets whose all-reduce already completed (overlapping backward).
  while (from_hook && next_to_finish_ < next_to_launch_ &&
         buckets_[next_to_finish_].work->isCompleted()) {
    finish(buckets_[next_to_finish_++]);
  }
}

void GradientSynchronizer::launch(Bucket& bucket) {
  at::NoGradGuard no_grad;
  const auto count = static_cast<int64_t>(bucket.params.size());
  for (int64_t k = 0; k < count; ++k) {
    const auto& p = params_[bucket.params[k]];
    const auto& grad = p.grad();
    auto values = bucket.buffer.narrow(0, bucket.offsets[k], p.numel());
    if (grad.defined() && arrived_[bucket.params[k]]) {
      values.copy_(grad.reshape(-1));
      bucket.buffer[k].fill_(1);
    } else {
      values.zero_();
      bucket.buffer[k].fill_(0);
    }
  }
  std::vector<at::Tensor> tensors{bucket.buffer};
  bucket.work = group_->getBackend(bucket.buffer.device().type())->allreduce(tensors);
  bucket.launched = true;
}

void GradientSynchronizer::finish(Bucket& bucket) {
  bucket.work->wait();
  at::NoGradGuard no_grad;
  const auto world = static_cast<double>(group_->getSize());
  const auto count = static_cast<int64_t>(bucket.params.size());
  const auto flags = bucket.buffer.narrow(0, 0, count).to(at::kCPU, at::kDouble).contiguous();
  const double* present = flags.data_ptr<double>();
  std::vector<at::Tensor> updated;
  for (int64_t k = 0; k < count; ++k) {
    auto& p = params_[bucket.params[k]];
    if (present[k] == 0.0) continue;  // no rank had a gradient
    const auto average =
        bucket.buffer.narrow(0, bucket.offsets[k], p.numel()).view(p.sizes()) / world;
    if (p.grad().defined()) {
      p.mutable_grad().copy_(average);
    } else {
      p.mutable_grad() = average;
    }
    updated.push_back(p);
  }
  if (bucket_ready_ && !updated.empty()) bucket_ready_(updated);
}

void GradientSynchronizer::synchronize() {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& bucket : buckets_) bucket.ready = static_cast<int64_t>(bucket.params.size());
  launch_ready_buckets(/*from_hook=*/false);
  while (next_to_finish_ < num_buckets()) finish(buckets_[next_to_finish_++]);
  started_in_backward_ = started_this_iteration_;
  started_this_iteration_ = 0;
  for (auto& bucket : buckets_) {
    bucket.ready = 0;
    bucket.launched = false;
    bucket.work.reset();
  }
  arrived_.assign(params_.size(), false);
  next_to_launch_ = 0;
  next_to_finish_ = 0;
}

}  // namespace shampoo
