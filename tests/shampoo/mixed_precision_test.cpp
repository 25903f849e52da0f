// Parameters as models really hold them: bf16 and fp16 parameters (stepped in float32, rounded
// into the parameter) and channels_last conv weights (blocked by their logical shape, updated in
// their layout) train with every preconditioner family, merged and at world 2; the sharded
// optimizer accepts them too.
#include <shampoo/shampoo.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>

#include <mutex>

#include "support/test_support.h"

namespace {

using shampoo::DistributedOptions;
using shampoo::DistributedShampoo;
using shampoo::ShampooOptions;
using shampoo::testing::bit_equal;
using shampoo::testing::run_ranks;
using shampoo::testing::snapshot;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

struct Family {
  std::string name;
  shampoo::PreconditionerConfig config;
  double lr;
};

std::vector<Family> families() {
  shampoo::RootInvShampooConfig root_inverse;
  return {{"root_inverse", root_inverse, 0.01},
          {"eigendecomposed", shampoo::EigendecomposedShampooConfig{}, 0.01},
          {"eigenvalue_corrected", shampoo::EigenvalueCorrectedShampooConfig{}, 0.01},
          {"spectral_descent", shampoo::SpectralDescentConfig{}, 0.01},
          {"sign_descent", shampoo::SignDescentConfig{}, 0.002},
          {"sgd_preconditioner", shampoo::SGDPreconditionerConfig{}, 0.05},
          {"adagrad_preconditioner", shampoo::AdaGradPreconditionerConfig{}, 0.01},
          {"rmsprop_preconditioner", shampoo::RMSpropPreconditionerConfig{}, 0.002},
          {"adam_preconditioner", shampoo::AdamPreconditionerConfig{}, 0.01},
          {"root_inverse_kl", shampoo::RootInvKLShampooConfig{}, 0.01},
          {"eigendecomposed_kl", shampoo::EigendecomposedKLShampooConfig{}, 0.01}};
}

enum class Layout { kBf16, kFp16, kChannelsLast, kBf16ChannelsLast };

std::string layout_name(Layout layout) {
  switch (layout) {
    case Layout::kBf16:
      return "bf16";
    case Layout::kFp16:
      return "fp16";
    case Layout::kChannelsLast:
      return "channels_last";
    case Layout::kBf16ChannelsLast:
      return "bf16_channels_last";
  }
  return "?";
}

at::ScalarType dtype_of(Layout layout) {
  switch (layout) {
    case Layout::kBf16:
    case Layout::kBf16ChannelsLast:
      return at::kBFloat16;
    case Layout::kFp16:
      return at::kHalf;
    case Layout::kChannelsLast:
      return at::kFloat;
  }
  return at::kFloat;
}

bool channels_last(Layout layout) {
  return layout == Layout::kChannelsLast || layout == Layout::kBf16ChannelsLast;
}

/// A small conv net as raw tensors: conv [6, 2, 3, 3] (no padding) -> tanh -> linear [3, 96] + b.
struct Net {
  at::Tensor conv, linear, bias;
  std::vector<at::Tensor> params() const { return {conv, linear, bias}; }
};

Net make_net(Layout layout) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(17);
  Net net;
  auto conv = at::randn({6, 2, 3, 3}, gen) * 0.3;
  auto linear = at::randn({3, 96}, gen) * 0.1;
  auto bias = at::zeros({3});
  const auto dtype = dtype_of(layout);
  net.conv = channels_last(layout) ? conv.to(dtype).contiguous(at::MemoryFormat::ChannelsLast)
                                   : conv.to(dtype);
  net.linear = linear.to(dtype);
  net.bias = bias.to(dtype);
  for (auto* p : {&net.conv, &net.linear, &net.bias}) p->requires_grad_();
  return net;
}

struct Batch {
  at::Tensor inputs;  // [N, 2, 6, 6]
  at::Tensor labels;
};

Batch make_batch(int rank, int world) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const auto inputs = at::randn({32, 2, 6, 6}, gen);
  const auto labels =
      (inputs.mean({1, 2, 3}) * 3.0).clamp(-1.0, 1.0).add(1.0).round().to(at::kLong);
  const int64_t size = 32 / world;
  return {inputs.narrow(0, rank * size, size), labels.narrow(0, rank * size, size)};
}

/// Cross-entropy in float32 of the net run in its parameters' dtype.
at::Tensor loss_of(const Net& net, const Batch& batch) {
  const auto x = batch.inputs.to(net.conv.scalar_type());
  const auto h = at::tanh(at::conv2d(x, net.conv)).reshape({x.size(0), -1});
  const auto logits = at::linear(h, net.linear, net.bias).to(at::kFloat);
  return torch::nn::functional::cross_entropy(logits, batch.labels);
}

/// Two param groups, weights and the bias, that differ in lr only (one virtual group when
/// merged); spectral descent takes matrices only, so its bias gets the Adam preconditioner.
std::vector<torch::optim::OptimizerParamGroup> groups_for(const Net& net, const Family& family) {
  const auto base = ShampooOptions::reference_defaults(family.lr)
                        .betas({0.9, 0.999})
                        .epsilon(1e-8)
                        .precondition_frequency(5)
                        .max_preconditioner_dim(32)
                        .preconditioner(family.config);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{net.conv, net.linear},
                      std::make_unique<ShampooOptions>(base));
  auto bias = ShampooOptions(base).lr(family.lr * 0.5);
  if (std::holds_alternative<shampoo::SpectralDescentConfig>(family.config)) {
    bias.preconditioner(shampoo::AdamPreconditionerConfig{});
  }
  groups.emplace_back(std::vector<at::Tensor>{net.bias}, std::make_unique<ShampooOptions>(bias));
  return groups;
}

class MixedPrecision : public ::testing::TestWithParam<std::tuple<Family, Layout, int>> {};

TEST_P(MixedPrecision, LossFallsOver30Steps) {
  const auto [family, layout, world] = GetParam();
  std::mutex mutex;
  std::vector<std::vector<at::Tensor>> finals(world);
  run_ranks(world, [&](int rank, const Group& group) {
    auto net = make_net(layout);
    const auto batch = make_batch(rank, world);
    std::unique_ptr<shampoo::GradientSynchronizer> sync;
    DistributedOptions distributed;
    if (world > 1) {
      sync = std::make_unique<shampoo::GradientSynchronizer>(net.params(), group);
      distributed.process_group(group);
    }
    DistributedShampoo optimizer(groups_for(net, family), ShampooOptions::reference_defaults(), distributed);
    EXPECT_EQ(optimizer.stats().virtual_groups,
              std::holds_alternative<shampoo::SpectralDescentConfig>(family.config) ? 2 : 1);
    const double first = loss_of(net, make_batch(0, 1)).item<double>();
    for (int step = 0; step < 30; ++step) {
      optimizer.zero_grad();
      loss_of(net, batch).backward();
      if (sync) sync->synchronize();
      optimizer.step();
    }
    const double last = loss_of(net, make_batch(0, 1)).item<double>();
    EXPECT_LT(last, 0.9 * first) << family.name << " " << layout_name(layout) << " rank " << rank;
    EXPECT_EQ(net.conv.scalar_type(), dtype_of(layout));
    EXPECT_EQ(net.conv.is_contiguous(at::MemoryFormat::ChannelsLast), channels_last(layout));
    std::lock_guard<std::mutex> lock(mutex);
    finals[rank] = snapshot(net.params());
  });
  for (int rank = 1; rank < world; ++rank) {
    EXPECT_TRUE(bit_equal(finals[rank], finals[0])) << "rank " << rank << " differs from rank 0";
  }
}

INSTANTIATE_TEST_SUITE_P(Families, MixedPrecision,
                         ::testing::Combine(::testing::ValuesIn(families()),
                                            ::testing::Values(Layout::kBf16, Layout::kFp16,
                                                              Layout::kChannelsLast,
                                                              Layout::kBf16ChannelsLast),
                                            ::testing::Values(1, 2)),
                         [](const auto& info) {
                           return std::get<0>(info.param).name + "_" +
                                  layout_name(std::get<1>(info.param)) + "_world" +
                                  std::to_string(std::get<2>(info.param));
                         });

/// Copies of `params` in another layout (values equal), with gradients set alike.
std::vector<at::Tensor> relayout(const std::vector<at::Tensor>& params, bool to_channels_last) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) {
    auto q = p.detach().clone(p.dim() == 4 && to_channels_last ? at::MemoryFormat::ChannelsLast
                                                               : at::MemoryFormat::Contiguous);
    out.push_back(q.requires_grad_());
  }
  return out;
}

TEST(ChannelsLast, StepsBitForBitLikeContiguousParameters) {
  for (const auto& family : families()) {
    for (const int world : {1, 2}) {
      run_ranks(world, [&](int, const Group& group) {
        const auto net = make_net(Layout::kChannelsLast);
        const auto strided = relayout(net.params(), /*to_channels_last=*/true);
        const auto dense = relayout(net.params(), /*to_channels_last=*/false);
        ASSERT_FALSE(strided[0].is_contiguous());
        DistributedOptions distributed;
        if (world > 1) distributed.process_group(group);
        const Net a{strided[0], strided[1], strided[2]};
        const Net b{dense[0], dense[1], dense[2]};
        DistributedShampoo opt_a(groups_for(a, family), ShampooOptions::reference_defaults(), distributed);
        DistributedShampoo opt_b(groups_for(b, family), ShampooOptions::reference_defaults(), distributed);
        for (int step = 0; step < 6; ++step) {
          shampoo::testing::set_random_grads(dense, 90 + step);
          for (size_t i = 0; i < dense.size(); ++i) {
            strided[i].mutable_grad() =
                dense[i].grad().clone(strided[i].dim() == 4 ? at::MemoryFormat::ChannelsLast
                                                            : at::MemoryFormat::Contiguous);
          }
          opt_a.step();
          opt_b.step();
        }
        EXPECT_TRUE(strided[0].is_contiguous(at::MemoryFormat::ChannelsLast));
        EXPECT_TRUE(bit_equal(snapshot(strided), snapshot(dense))) << family.name;
      });
    }
  }
}

TEST(LowPrecisionParameters, OneStepIsTheFloat32StepRounded) {
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    for (const auto& family : families()) {
      auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
      const std::vector<at::Tensor> values{at::randn({6, 5}, gen), at::randn({4}, gen)};
      std::vector<at::Tensor> low, high;
      for (const auto& v : values) {
        low.push_back(v.to(dtype).requires_grad_());
        high.push_back(v.to(dtype).to(at::kFloat).requires_grad_());
      }
      auto options = ShampooOptions::reference_defaults(family.lr).epsilon(1e-8).preconditioner(family.config);
      if (std::holds_alternative<shampoo::SpectralDescentConfig>(family.config)) {
        low.pop_back();  // matrices only
        high.pop_back();
      }
      DistributedShampoo opt_low(low, options);
      DistributedShampoo opt_high(high, options);
      shampoo::testing::set_random_grads(low, 8);
      for (size_t i = 0; i < low.size(); ++i) high[i].mutable_grad() = low[i].grad().to(at::kFloat);
      opt_low.step();
      opt_high.step();
      for (size_t i = 0; i < low.size(); ++i) {
        EXPECT_EQ(low[i].scalar_type(), dtype);
        EXPECT_TRUE(bit_equal(low[i].detach(), high[i].detach().to(dtype)))
            << family.name << " " << dtype << " parameter " << i;
      }
      // The state is float32 (as the float32 run's): the same checkpoint size.
      EXPECT_EQ(opt_low.stats().state_bytes, opt_high.stats().state_bytes) << family.name;
    }
  }
}

TEST(LowPrecisionParameters, ShardedOptimizerAndGradientShardingAcceptThem) {
  for (const auto layout : {Layout::kBf16, Layout::kChannelsLast}) {
    run_ranks(2, [&](int rank, const Group& group) {
      auto net = make_net(layout);
      const auto batch = make_batch(rank, 2);
      shampoo::GradientSynchronizer sync(net.params(), group);
      shampoo::ShardedOptimizer optimizer(
          net.params(),
          shampoo::group_optimizer_factory<torch::optim::Adam>(torch::optim::AdamOptions(0.01)),
          group);
      sync.shard_gradients(optimizer);
      const double first = loss_of(net, make_batch(0, 1)).item<double>();
      for (int step = 0; step < 30; ++step) {
        optimizer.zero_grad();
        loss_of(net, batch).backward();
        sync.synchronize();
        optimizer.step();
      }
      EXPECT_LT(loss_of(net, make_batch(0, 1)).item<double>(), 0.9 * first) << layout_name(layout);
      EXPECT_EQ(net.conv.is_contiguous(at::MemoryFormat::ChannelsLast), channels_last(layout));
    });
  }
}

}  // namespace
