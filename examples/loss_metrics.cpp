#include "examples/loss_metrics.h"

#include <ATen/ops/from_blob.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>

#include <numeric>
#include <vector>

namespace shampoo::examples {

LossMetrics::LossMetrics(int64_t window_size) : window_size_(window_size) {
  TORCH_CHECK(window_size >= 1, "--window-size: got ", window_size, ", expected >= 1");
}

void LossMetrics::update(double loss) {
  ++iteration_;
  loss_sum_ += loss;
  last_loss_ = loss;
  window_.push_back(loss);
  if (static_cast<int64_t>(window_.size()) > window_size_) window_.pop_front();
}

IterationLosses LossMetrics::local() const {
  IterationLosses losses;
  losses.loss = last_loss_;
  if (iteration_ > 0) {
    losses.lifetime_loss = loss_sum_ / static_cast<double>(iteration_);
    // Summed in order each time (not a running sum), so the value depends only on the window.
    losses.window_loss =
        std::accumulate(window_.begin(), window_.end(), 0.0) / static_cast<double>(window_.size());
  }
  return losses;
}

IterationLosses LossMetrics::global(const c10::intrusive_ptr<c10d::ProcessGroup>& group) const {
  const IterationLosses mine = local();
  if (!group || group->getSize() == 1) return mine;
  std::vector<at::Tensor> buffer{
      at::tensor({mine.loss, mine.lifetime_loss, mine.window_loss}, at::kDouble)};
  group->allreduce(buffer)->wait();
  const auto world = static_cast<double>(group->getSize());
  const auto sums = buffer[0].accessor<double, 1>();
  return IterationLosses{sums[0] / world, sums[1] / world, sums[2] / world};
}

LossMetrics LossMetrics::mean_over_ranks(
    const c10::intrusive_ptr<c10d::ProcessGroup>& group) const {
  LossMetrics mean(*this);
  if (!group || group->getSize() == 1) return mean;
  // Every rank has run the same iterations, so the windows have the same length.
  std::vector<double> values{loss_sum_, last_loss_};
  values.insert(values.end(), window_.begin(), window_.end());
  std::vector<at::Tensor> buffer{at::tensor(values, at::kDouble)};
  group->allreduce(buffer)->wait();
  const auto world = static_cast<double>(group->getSize());
  const auto sums = buffer[0].accessor<double, 1>();
  mean.loss_sum_ = sums[0] / world;
  mean.last_loss_ = sums[1] / world;
  for (size_t i = 0; i < mean.window_.size(); ++i) mean.window_[i] = sums[2 + i] / world;
  return mean;
}

void LossMetrics::save(torch::serialize::OutputArchive& archive) const {
  const std::vector<double> window(window_.begin(), window_.end());
  archive.write("iteration", at::tensor(iteration_, at::kLong));
  archive.write("loss_sum", at::tensor(loss_sum_, at::kDouble));
  archive.write("last_loss", at::tensor(last_loss_, at::kDouble));
  archive.write("window", at::tensor(window, at::kDouble));
}

void LossMetrics::load(torch::serialize::InputArchive& archive) {
  at::Tensor iteration, loss_sum, last_loss, window;
  archive.read("iteration", iteration);
  archive.read("loss_sum", loss_sum);
  archive.read("last_loss", last_loss);
  archive.read("window", window);
  iteration_ = iteration.item<int64_t>();
  loss_sum_ = loss_sum.item<double>();
  last_loss_ = last_loss.item<double>();
  window_.clear();
  const auto values = window.to(at::kCPU, at::kDouble).contiguous();  // may be mapped to a GPU
  for (int64_t i = 0; i < values.numel(); ++i) window_.push_back(values.data_ptr<double>()[i]);
  while (static_cast<int64_t>(window_.size()) > window_size_) window_.pop_front();
}

}  // namespace shampoo::examples
