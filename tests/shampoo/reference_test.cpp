// Reference test: an independent float64 implementation of full Shampoo steps, written from
// docs/math.md with plain ATen ops (no code of preconditioners/, grafting/, distributor/ or
// shampoo/), against which DistributedShampoo (float32 parameters, one process) is compared after
// every step within float32 tolerance. Also closed-form one-step cases that check both.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <shampoo/distributed_shampoo.h>
#include <shampoo/shampoo_options.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

#include "support/test_support.h"

namespace {

using shampoo::testing::all_close;
using shampoo::testing::tolerance_for;

// ----------------------------------------------------------------------------------------------
// The float64 reference (docs/math.md), deliberately written as directly as possible: one block at
// a time, one dim at a time, no fusing.
// ----------------------------------------------------------------------------------------------

/// docs/math.md "Blocking": drop size-1 dims, then merge from the last dim backwards while the
/// product stays <= max_dim and more than one dim (the target dimensionality) remains.
std::vector<int64_t> reference_merged_shape(at::IntArrayRef shape, int64_t max_dim, bool merge) {
  for (const int64_t s : shape) {
    if (s == 0) return {0};
  }
  std::vector<int64_t> squeezed;
  for (const int64_t s : shape) {
    if (s != 1) squeezed.push_back(s);
  }
  if (squeezed.empty()) return {1};
  if (!merge) return squeezed;
  std::vector<int64_t> reversed{squeezed.back()};
  for (int64_t i = static_cast<int64_t>(squeezed.size()) - 2; i >= 0; --i) {
    // Dims left if merging stopped here: those merged so far plus dims 0..i.
    const int64_t remaining = static_cast<int64_t>(reversed.size()) + i + 1;
    if (reversed.back() * squeezed[i] <= max_dim && remaining > 1) {
      reversed.back() *= squeezed[i];
    } else {
      reversed.push_back(squeezed[i]);
    }
  }
  return {reversed.rbegin(), reversed.rend()};
}

/// Chunks of at most max_dim along every dim, in row-major order of the chunk grid.
struct BlockRange {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
};

std::vector<BlockRange> reference_blocks(const std::vector<int64_t>& merged, int64_t max_dim) {
  std::vector<BlockRange> blocks{BlockRange{}};
  for (const int64_t n : merged) {
    std::vector<BlockRange> next;
    for (const auto& prefix : blocks) {
      for (int64_t start = 0; start < n; start += max_dim) {
        auto b = prefix;
        b.offsets.push_back(start);
        b.sizes.push_back(std::min(max_dim, n - start));
        next.push_back(std::move(b));
      }
    }
    blocks = std::move(next);
  }
  return blocks;
}

at::Tensor slice_block(const at::Tensor& t, const BlockRange& b) {
  at::Tensor out = t;
  for (size_t d = 0; d < b.sizes.size(); ++d) {
    out = out.narrow(static_cast<int64_t>(d), b.offsets[d], b.sizes[d]);
  }
  return out;
}

/// out[.., i, ..] = sum_j M[i, j] T[.., j, ..] along dim k (dim order preserved).
at::Tensor apply_along(const at::Tensor& t, const at::Tensor& m, int64_t k) {
  const auto moved = t.movedim(k, 0);
  const auto shape = moved.sizes().vec();
  return m.mm(moved.reshape({shape[0], -1})).reshape(shape).movedim(0, k);
}

/// G contracted with itself over every dim but k: an n_k × n_k matrix.
at::Tensor contract_all_but(const at::Tensor& g, int64_t k) {
  const auto m = g.movedim(k, 0).reshape({g.size(k), -1});
  return m.mm(m.t());
}

at::Tensor identity_matrix(int64_t n) { return at::eye(n, at::TensorOptions().dtype(at::kDouble)); }

enum class GraftKind { kNone, kSGD, kAdaGrad, kRMSprop, kAdam };

/// The option values the reference needs, read from the public ShampooOptions getters and
/// resolved here (−1 conventions) rather than through the library's helpers.
struct ReferenceConfig {
  double lr, beta1, beta2, beta3, epsilon, weight_decay, momentum, dampening;
  bool l2, nesterov, bias_correction, merge, eigenvalue_corrected;
  int64_t max_dim, frequency, start;
  GraftKind graft = GraftKind::kNone;
  double graft_beta2 = 1.0, graft_epsilon = 0.0;
  shampoo::InverseExponentOverride overrides;

  explicit ReferenceConfig(const shampoo::ShampooOptions& o) {
    lr = o.lr();
    std::tie(beta1, beta2) = o.betas();
    beta3 = o.beta3() == -1.0 ? beta1 : o.beta3();
    epsilon = o.epsilon();
    weight_decay = o.weight_decay();
    l2 = o.weight_decay_type() == shampoo::WeightDecayType::kL2;
    momentum = o.momentum();
    dampening = o.dampening();
    nesterov = o.use_nesterov();
    bias_correction = o.use_bias_correction();
    merge = o.use_merge_dims();
    max_dim = o.max_preconditioner_dim();
    frequency = o.precondition_frequency();
    start = o.start_preconditioning_step() == -1 ? frequency : o.start_preconditioning_step();
    eigenvalue_corrected =
        std::holds_alternative<shampoo::EigenvalueCorrectedShampooConfig>(o.preconditioner());
    overrides = o.inverse_exponent_override();
    const auto& g = o.grafting();
    if (std::holds_alternative<shampoo::SGDGraftingConfig>(g)) {
      graft = GraftKind::kSGD;
    } else if (const auto* a = std::get_if<shampoo::AdaGradGraftingConfig>(&g)) {
      graft = GraftKind::kAdaGrad;
      graft_epsilon = a->epsilon;
    } else if (const auto* r = std::get_if<shampoo::RMSpropGraftingConfig>(&g)) {
      graft = GraftKind::kRMSprop;
      graft_beta2 = r->beta2;
      graft_epsilon = r->epsilon;
    } else if (const auto* m = std::get_if<shampoo::AdamGraftingConfig>(&g)) {
      graft = GraftKind::kAdam;
      graft_beta2 = m->beta2;
      graft_epsilon = m->epsilon;
    }
  }

  /// e_k: 1/(2·order) unless overridden for (order, k) or (order, kAllDims).
  double exponent(int64_t order, int64_t k) const {
    double e = 1.0 / (2.0 * static_cast<double>(order));
    const auto it = overrides.find(order);
    if (it == overrides.end()) return e;
    if (const auto d = it->second.find(k); d != it->second.end()) return d->second;
    if (const auto a = it->second.find(shampoo::kAllDims); a != it->second.end()) return a->second;
    return e;
  }
};

struct ReferenceBlockState {
  BlockRange range;
  std::vector<at::Tensor> factors;  // L_k, start at 0
  std::vector<at::Tensor> roots;    // L_k^(−e_k) (root-inverse), start as identity
  std::vector<at::Tensor> bases;    // Q_k (eigenvalue-corrected), start as identity
  at::Tensor corrections;           // D (eigenvalue-corrected), block shape
  at::Tensor graft_moment;          // V, block shape
  at::Tensor filtered;              // M, block shape
  at::Tensor momentum;              // B, block shape
};

class ReferenceShampoo {
 public:
  ReferenceShampoo(const std::vector<at::Tensor>& params, const shampoo::ShampooOptions& options)
      : config_(options) {
    for (const auto& p : params) {
      params_.push_back(p.detach().to(at::kDouble).clone());
      merged_.push_back(reference_merged_shape(p.sizes(), config_.max_dim, config_.merge));
      std::vector<ReferenceBlockState> blocks;
      for (const auto& range : reference_blocks(merged_.back(), config_.max_dim)) {
        ReferenceBlockState s;
        s.range = range;
        const auto zeros = at::zeros(range.sizes, at::TensorOptions().dtype(at::kDouble));
        for (const int64_t n : range.sizes) {
          s.factors.push_back(at::zeros({n, n}, zeros.options()));
          s.roots.push_back(identity_matrix(n));
          s.bases.push_back(identity_matrix(n));
        }
        s.corrections = zeros.clone();
        s.graft_moment = zeros.clone();
        s.filtered = zeros.clone();
        s.momentum = zeros.clone();
        blocks.push_back(std::move(s));
      }
      blocks_.push_back(std::move(blocks));
    }
  }

  void step(const std::vector<at::Tensor>& grads) {
    ++t_;
    for (size_t i = 0; i < params_.size(); ++i) {
      const auto w = params_[i].view(merged_[i]);
      const auto g = grads[i].to(at::kDouble).reshape(merged_[i]);
      for (auto& block : blocks_[i]) {
        auto w_block = slice_block(w, block.range);
        step_block(block, w_block, slice_block(g, block.range).clone());
      }
    }
  }

  const std::vector<at::Tensor>& params() const { return params_; }

 private:
  double factor_weight() const { return config_.beta2 < 1.0 ? 1.0 - config_.beta2 : 1.0; }
  double factor_bias_correction() const {
    return config_.bias_correction && config_.beta2 < 1.0 ? 1.0 - std::pow(config_.beta2, t_) : 1.0;
  }
  bool amortized_step() const {
    return (t_ % config_.frequency == 0 && t_ > config_.start) || t_ == config_.start;
  }

  void step_block(ReferenceBlockState& s, at::Tensor& w, at::Tensor g) {
    const auto& c = config_;
    const int64_t order = g.dim();
    // 1. L2 weight decay.
    if (c.l2 && c.weight_decay != 0.0) g = g + c.weight_decay * w;

    // 2. Statistics from the unfiltered G, every step.
    for (int64_t k = 0; k < order; ++k) {
      s.factors[k] = c.beta2 * s.factors[k] + factor_weight() * contract_all_but(g, k);
    }
    double graft_bc2 = 1.0;
    switch (c.graft) {
      case GraftKind::kAdaGrad:
        s.graft_moment = s.graft_moment + g * g;
        break;
      case GraftKind::kRMSprop:
        s.graft_moment = c.graft_beta2 * s.graft_moment + (1.0 - c.graft_beta2) * g * g;
        break;
      case GraftKind::kAdam:
        s.graft_moment = c.graft_beta2 * s.graft_moment + (1.0 - c.graft_beta2) * g * g;
        graft_bc2 = 1.0 - std::pow(c.graft_beta2, t_);
        break;
      default:
        break;
    }

    // 3. Amortized computation (and, eigenvalue-corrected, the corrections in the new bases).
    const double bc2 = factor_bias_correction();
    if (amortized_step()) {
      for (int64_t k = 0; k < order; ++k) {
        const int64_t n = g.size(k);
        const auto a = s.factors[k] / bc2 + c.epsilon * identity_matrix(n);
        auto [lambda, q] = at::linalg_eigh(a);
        if (c.eigenvalue_corrected) {
          s.bases[k] = q;
          continue;
        }
        const double e = c.exponent(order, k);
        if (e == 0.0) continue;  // dim not preconditioned: the root stays identity
        const double lambda_min = lambda.min().item<double>();
        if (lambda_min < c.epsilon) lambda = (lambda - lambda_min) + c.epsilon;  // two steps
        s.roots[k] = (q * lambda.pow(-e).unsqueeze(0)).mm(q.t());
      }
    }
    if (c.eigenvalue_corrected) {
      const auto rotated = rotate_in(s, g);
      s.corrections = c.beta2 * s.corrections + factor_weight() * rotated * rotated;
    }

    // 4. Filtering.
    at::Tensor filtered = g;
    if (c.beta1 != 0.0) {
      at::Tensor before;
      if (c.beta3 != c.beta1) before = s.filtered + (1.0 - c.beta3) * (g - s.filtered);
      s.filtered = s.filtered + (1.0 - c.beta1) * (g - s.filtered);
      filtered = c.beta3 != c.beta1 ? before : s.filtered.clone();
      if (c.bias_correction) {
        filtered = filtered / (1.0 - c.beta3 * std::pow(c.beta1, t_ - 1));
      }
    }

    // 5. Preconditioning (with grafting).
    at::Tensor graft_direction;
    if (c.graft == GraftKind::kSGD) {
      graft_direction = filtered;
    } else if (c.graft != GraftKind::kNone) {
      graft_direction = filtered / ((s.graft_moment / graft_bc2).sqrt() + c.graft_epsilon);
    }
    at::Tensor p;
    if (t_ < c.start && c.graft != GraftKind::kNone) {
      p = graft_direction;
    } else {
      if (c.eigenvalue_corrected) {
        p = rotate_out(s, rotate_in(s, filtered) / ((s.corrections / bc2).sqrt() + c.epsilon));
      } else {
        p = filtered;
        for (int64_t k = 0; k < order; ++k) p = apply_along(p, s.roots[k], k);
      }
      if (c.graft != GraftKind::kNone) {
        p = p * (graft_direction.norm().item<double>() / (p.norm().item<double>() + 1e-16));
      }
    }

    // 6. Decoupled weight decay.
    if (!c.l2 && c.weight_decay != 0.0) p = p + c.weight_decay * w;

    // 7. Momentum.
    if (c.momentum != 0.0) {
      s.momentum = c.momentum * s.momentum + (1.0 - c.dampening) * p;
      p = c.nesterov ? (1.0 - c.dampening) * p + c.momentum * s.momentum : s.momentum.clone();
    }

    // 8. The update, in place through the block view.
    w.add_(p, -c.lr);
  }

  static at::Tensor rotate_in(const ReferenceBlockState& s, at::Tensor x) {
    for (int64_t k = 0; k < x.dim(); ++k) x = apply_along(x, s.bases[k].t(), k);
    return x;
  }
  static at::Tensor rotate_out(const ReferenceBlockState& s, at::Tensor x) {
    for (int64_t k = 0; k < x.dim(); ++k) x = apply_along(x, s.bases[k], k);
    return x;
  }

  ReferenceConfig config_;
  int64_t t_ = 0;
  std::vector<at::Tensor> params_;
  std::vector<std::vector<int64_t>> merged_;
  std::vector<std::vector<ReferenceBlockState>> blocks_;
};

// ----------------------------------------------------------------------------------------------
// Test driver.
// ----------------------------------------------------------------------------------------------

/// The tensors here are tiny: ATen's intra-op threads only add contention (on a loaded 2-core
/// machine they made the suite fifty times slower).
class SingleThreadedAten : public ::testing::Environment {
 public:
  void SetUp() override { at::set_num_threads(1); }
};
[[maybe_unused]] ::testing::Environment* const kSingleThreadedAten =
    ::testing::AddGlobalTestEnvironment(new SingleThreadedAten);

at::Generator make_generator(uint64_t seed) {
  return at::make_generator<at::CPUGeneratorImpl>(seed);
}

at::Tensor randn(at::IntArrayRef shape, at::Generator& gen, at::ScalarType dtype = at::kFloat) {
  return at::randn(shape, gen, at::TensorOptions().dtype(dtype));
}

/// How a case runs: parameter and factor dtypes, epsilon, and (from the parameter dtype) the
/// tolerance of the comparison.
///
/// float64: the logic check. Everything in float64, compared at float64 tolerance, with a small
/// epsilon (1e-6) so that the handling of the null space (the eigenvalue shift) matters.
///
/// float32 parameters: the factors of these small random problems are rank deficient (a vector's
/// factor is a sum of t outer products; an 8×12 block's right factor has rank 8 after one step)
/// or, with precondition_frequency > 1, stale, so the gradient has components along eigenvalues
/// that are ~epsilon, where the root is ~epsilon^(−e). Float32 round-off of relative size
/// u = 6e-8 (in the root, which is cast to the parameter dtype, and in the filtered gradient) is
/// amplified there by up to (λmax/epsilon)^e; with float32 factors the eigenvalues near epsilon
/// themselves are only known to ~u·λmax. With epsilon 1e-6 and λmax ~ 10..100 that gives errors
/// of 1e-4..1e-2 in the step: float32 arithmetic, not the algorithm (the float64 variants of the
/// same cases agree to 1e-7). So the float32 cases use epsilon 1e-3 (float64 factors) and 1e-2
/// (float32 factors, the default dtype), still far below the eigenvalues that carry the
/// gradient; these values pass with at least 2× margin over several seeds.
struct Precision {
  std::string suffix;
  at::ScalarType param_dtype;
  at::ScalarType factor_dtype;
  double epsilon;
};

const Precision kFloat64{"f64", at::kDouble, at::kDouble, 1e-6};
const Precision kFloat32WithFloat64Factors{"f32_f64factors", at::kFloat, at::kDouble, 1e-3};
const Precision kFloat32{"f32", at::kFloat, at::kFloat, 1e-2};

struct ReferenceCase {
  std::string name;
  std::vector<std::vector<int64_t>> shapes;
  shampoo::ShampooOptions options = shampoo::ShampooOptions::reference_defaults();
  at::ScalarType param_dtype = at::kFloat;
  int steps = 10;
};

void PrintTo(const ReferenceCase& c, std::ostream* os) { *os << c.name; }

/// Runs DistributedShampoo and the reference side by side on fixed random gradients (different
/// every step), asserting after every step that the parameters agree.
void run_and_compare(const ReferenceCase& c, uint64_t seed) {
  auto gen = make_generator(seed);
  std::vector<at::Tensor> params;
  for (const auto& shape : c.shapes) params.push_back(randn(shape, gen, c.param_dtype));
  for (auto& p : params) p.requires_grad_(true);
  std::vector<at::Tensor> initial;
  for (const auto& p : params) initial.push_back(p.detach().clone());
  const auto tol = tolerance_for(c.param_dtype);

  ReferenceShampoo reference(params, c.options);
  shampoo::DistributedShampoo optimizer(params, c.options);
  for (int step = 1; step <= c.steps; ++step) {
    std::vector<at::Tensor> grads;
    for (auto& p : params) {
      const auto g = randn(p.sizes(), gen, c.param_dtype);
      p.mutable_grad() = g.clone();
      grads.push_back(g.to(at::kDouble));
    }
    optimizer.step();
    reference.step(grads);
    for (size_t i = 0; i < params.size(); ++i) {
      ASSERT_TRUE(all_close(params[i], reference.params()[i], tol))
          << c.name << ", step " << step << ", parameter " << i << " of shape "
          << params[i].sizes();
    }
  }
  // The parameters moved well beyond the tolerance, so the comparison is not vacuous.
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_FALSE(all_close(params[i], initial[i], tolerance_for(at::kFloat)))
        << c.name << ", parameter " << i << " did not move";
  }
}

struct ShapeSet {
  std::string name;
  std::vector<std::vector<int64_t>> shapes;
  int64_t max_preconditioner_dim;
  bool merge = true;
};

using Modifier = std::function<shampoo::ShampooOptions(shampoo::ShampooOptions)>;

struct OptionCombo {
  std::string name;
  Modifier modify;
};

shampoo::ShampooOptions base_options(const ShapeSet& s, const Precision& precision) {
  return shampoo::ShampooOptions::reference_defaults(0.05)
      .epsilon(precision.epsilon)
      .factor_matrix_dtype(precision.factor_dtype)
      .max_preconditioner_dim(s.max_preconditioner_dim)
      .use_merge_dims(s.merge);
}

void add_cases(
    std::vector<ReferenceCase>& out, const std::vector<OptionCombo>& combos,
    const std::vector<ShapeSet>& shape_sets, const Precision& precision,
    const Modifier& finish = [](auto o) { return o; }) {
  for (const auto& combo : combos) {
    for (const auto& s : shape_sets) {
      out.push_back({combo.name + "_" + s.name + "_" + precision.suffix, s.shapes,
                     finish(combo.modify(base_options(s, precision))), precision.param_dtype});
    }
  }
}

// Blockings (docs/math.md "Blocking") the cases run on.
const ShapeSet kVector17{"vector17", {{17}}, 1024};
const ShapeSet kMatrix8x12{"matrix8x12", {{8, 12}}, 12};     // 96 > 12: stays a matrix
const ShapeSet kTensor4x5x6{"tensor4x5x6", {{4, 5, 6}}, 6};  // no product fits: three dims
const ShapeSet kUnmerged4x5x6{"unmerged4x5x6", {{4, 5, 6}}, 1024, /*merge=*/false};
const ShapeSet kMerged2x3x4{"merged2x3x4", {{2, 3, 4}}, 12};            // -> (2, 12)
const ShapeSet kSqueezed1x5x1x6{"squeezed1x5x1x6", {{1, 5, 1, 6}}, 5};  // -> (5, 6): 5x5, 5x1
const ShapeSet kBlocked10x7{"blocked10x7", {{10, 7}}, 4};               // 4x4 4x3 4x4 4x3 2x4 2x3
const ShapeSet kBlocked3x7x2{"blocked3x7x2", {{3, 7, 2}}, 6};           // 3x6x2, 3x1x2 (order 3)
const ShapeSet kBlockedVector17{"blocked_vector17", {{17}}, 8};         // 8, 8, 1
const ShapeSet kSeveralParams{"several_params", {{17}, {8, 12}, {4, 5, 6}, {3, 1, 4}}, 6};

const std::vector<OptionCombo> kRootInverseCombos = {
    {"defaults", [](auto o) { return o; }},  // betas (0.9, 1), no grafting
    {"adam_grafting_freq2_start3",
     [](auto o) {
       return o.betas({0.9, 0.99})
           .precondition_frequency(2)
           .start_preconditioning_step(3)
           .grafting(shampoo::AdamGraftingConfig{0.999, 1e-8});
     }},
    {"adagrad_grafting_betas0_1",
     [](auto o) {
       return o.betas({0.0, 1.0}).grafting(shampoo::AdaGradGraftingConfig{1e-10});
     }},
    {"rmsprop_grafting_beta3_start2",
     [](auto o) {
       return o.betas({0.9, 0.99})
           .beta3(0.5)
           .start_preconditioning_step(2)
           .grafting(shampoo::RMSpropGraftingConfig{0.99, 1e-8});
     }},
    {"sgd_grafting_no_bias_correction",
     [](auto o) {
       return o.betas({0.9, 0.99})
           .use_bias_correction(false)
           .grafting(shampoo::SGDGraftingConfig{});
     }},
    {"no_bias_correction_beta3",
     [](auto o) {
       return o.betas({0.9, 0.99}).beta3(0.95).use_bias_correction(false);
     }},
    {"l2_nesterov_dampening",
     [](auto o) {
       return o.betas({0.0, 0.99})
           .weight_decay(0.01)
           .weight_decay_type(shampoo::WeightDecayType::kL2)
           .momentum(0.9)
           .use_nesterov(true)
           .dampening(0.1);
     }},
    {"decoupled_momentum_adam_grafting",
     [](auto o) {
       return o.betas({0.9, 0.999})
           .weight_decay(0.01)
           .weight_decay_type(shampoo::WeightDecayType::kDecoupled)
           .momentum(0.9)
           .dampening(0.1)
           .grafting(shampoo::AdamGraftingConfig{});
     }},
    {"exponent_override",
     [](auto o) {
       return o.betas({0.9, 0.99})
           .inverse_exponent_override(
               {{1, {{shampoo::kAllDims, 0.25}}}, {2, {{0, 0.0}}}, {3, {{1, 0.5}}}});
     }},
    {"freq3_default_start",  // start −1 = 3: identity roots for two steps, then stale roots
     [](auto o) {
       return o.betas({0.9, 0.99}).precondition_frequency(3);
     }},
};

std::vector<ReferenceCase> root_inverse_cases() {
  const std::vector<ShapeSet> all_shapes = {
      kVector17,        kMatrix8x12,  kTensor4x5x6,  kUnmerged4x5x6,   kMerged2x3x4,
      kSqueezed1x5x1x6, kBlocked10x7, kBlocked3x7x2, kBlockedVector17, kSeveralParams};
  std::vector<ReferenceCase> out;
  add_cases(out, kRootInverseCombos, all_shapes, kFloat64);
  add_cases(out, kRootInverseCombos, all_shapes, kFloat32WithFloat64Factors);
  // With float32 factors, not "freq3_default_start" on vectors: roots computed at step 3 from a
  // rank-3 17×17 factor meet gradients that lie mostly in its null space, so the step is
  // dominated by eigenvalues epsilon + O(u·λmax) (float32 eigh): 1e-3 relative error in the step,
  // 2× over tolerance. The same case passes with float64 factors and in float64.
  std::vector<OptionCombo> fresh_roots;
  std::vector<OptionCombo> stale_roots;
  for (const auto& combo : kRootInverseCombos) {
    (combo.name == "freq3_default_start" ? stale_roots : fresh_roots).push_back(combo);
  }
  add_cases(out, fresh_roots, all_shapes, kFloat32);
  add_cases(out, stale_roots,
            {kMatrix8x12, kTensor4x5x6, kUnmerged4x5x6, kMerged2x3x4, kSqueezed1x5x1x6,
             kBlocked10x7, kBlocked3x7x2},
            kFloat32);
  return out;
}

// Eigenvalue-corrected Shampoo on 2-D blocks whose first basis is computed from one gradient G:
// rotated into the singular vectors of G, G is diagonal, so off the diagonal it is pure round-off,
// and D there is that round-off squared; rotated / (sqrt(D) + eps) turns it into O(0.1) entries
// (float32) that the exact reference does not have. Those cases run in float64 only; in float32
// the 2-D shapes run with grafting until step 3, when the factors hold three gradients.
const ShapeSet kMatrix6x6{"matrix6x6", {{6, 6}}, 8};
const ShapeSet kBlocked8x8{"blocked8x8", {{8, 8}}, 4};

const OptionCombo kSoapFreq1{"soap_betas09_099", [](auto o) { return o.betas({0.9, 0.99}); }};
const OptionCombo kSoapGrafting{"soap_adam_grafting_start3_decoupled", [](auto o) {
                                  return o.betas({0.9, 0.999})
                                      .precondition_frequency(2)
                                      .start_preconditioning_step(3)
                                      .weight_decay(0.01)
                                      .grafting(shampoo::AdamGraftingConfig{0.999, 1e-8});
                                }};
// No grafting and start −1 = 2: step 1 runs before the first basis update, so the bases are the
// identity and the step is AdaGrad on the raw gradient (docs/math.md: "with no basis update it
// reduces to Adam/AdaGrad"; steps before start without grafting still precondition, step 5).
const OptionCombo kSoapBeforeStart{"soap_adagrad_freq2_no_grafting", [](auto o) {
                                     return o.betas({0.0, 1.0}).precondition_frequency(2);
                                   }};

std::vector<ReferenceCase> eigenvalue_corrected_cases() {
  const auto soap = [](auto o) {
    return o.preconditioner(shampoo::EigenvalueCorrectedShampooConfig{});
  };
  std::vector<ReferenceCase> out;
  const std::vector<ShapeSet> shapes = {kMatrix6x6, kTensor4x5x6, kBlocked8x8};
  add_cases(out, {kSoapFreq1, kSoapGrafting, kSoapBeforeStart}, shapes, kFloat64, soap);
  for (const auto* precision : {&kFloat32, &kFloat32WithFloat64Factors}) {
    add_cases(out, {kSoapFreq1}, {kTensor4x5x6}, *precision, soap);
    add_cases(out, {kSoapGrafting}, shapes, *precision, soap);
  }
  return out;
}

class RootInverseReference : public ::testing::TestWithParam<ReferenceCase> {};

TEST_P(RootInverseReference, MatchesFloat64ReferenceEveryStep) {
  run_and_compare(GetParam(), /*seed=*/20260);
}

INSTANTIATE_TEST_SUITE_P(ShapesOptionsPrecisions, RootInverseReference,
                         ::testing::ValuesIn(root_inverse_cases()),
                         [](const auto& info) { return info.param.name; });

// Eigenvectors are defined only up to sign (and order among equal eigenvalues), so the bases are
// not compared; the parameters after every step are invariant to that choice.
class EigenvalueCorrectedReference : public ::testing::TestWithParam<ReferenceCase> {};

TEST_P(EigenvalueCorrectedReference, MatchesFloat64ReferenceEveryStep) {
  run_and_compare(GetParam(), /*seed=*/4242);
}

INSTANTIATE_TEST_SUITE_P(ShapesOptionsPrecisions, EigenvalueCorrectedReference,
                         ::testing::ValuesIn(eigenvalue_corrected_cases()),
                         [](const auto& info) { return info.param.name; });

// ----------------------------------------------------------------------------------------------
// Closed forms of one step (start = frequency = 1, beta1 = 0, betas (0, 1), no grafting).
// ----------------------------------------------------------------------------------------------

/// Values k/16 with |k| < 64: products and sums of a few dozen of them are exact in float32, so
/// the factors of the optimizer hold exactly the matrices of the closed form.
at::Tensor dyadic(at::IntArrayRef shape, at::Generator& gen) {
  return (randn(shape, gen) * 16).round().clamp(-63, 63) / 16;
}

class ClosedForm : public ::testing::TestWithParam<at::ScalarType> {
 protected:
  /// One step of the optimizer (float32 parameters, factors in GetParam()) and of the reference
  /// from `w0` with gradient `g`; both are checked against `expected`, the reference at float64
  /// tolerance.
  /// Root-inverse options of the closed forms: start = frequency = 1, betas (0, 1).
  shampoo::ShampooOptions one_step_options(double lr, double epsilon, int64_t max_dim) const {
    return shampoo::ShampooOptions::reference_defaults(lr)
        .betas({0.0, 1.0})
        .epsilon(epsilon)
        .precondition_frequency(1)
        .start_preconditioning_step(1)
        .max_preconditioner_dim(max_dim)
        .factor_matrix_dtype(GetParam());
  }

  /// One step of the optimizer (float32 parameters) and of the reference from `w0` with gradient
  /// `g`; both are checked against `expected`, the reference at float64 tolerance.
  void check_one_step(const at::Tensor& w0, const at::Tensor& g,
                      const shampoo::ShampooOptions& options, const at::Tensor& expected) {
    auto param = w0.clone().requires_grad_(true);
    ReferenceShampoo reference({param}, options);
    shampoo::DistributedShampoo optimizer({param}, options);
    param.mutable_grad() = g.clone();
    optimizer.step();
    reference.step({g.to(at::kDouble)});
    EXPECT_TRUE(all_close(reference.params()[0], expected, tolerance_for(at::kDouble)))
        << "float64 reference vs closed form";
    EXPECT_TRUE(all_close(param, expected, tolerance_for(at::kFloat)))
        << "DistributedShampoo vs closed form";
    EXPECT_FALSE(all_close(param, w0, tolerance_for(at::kFloat))) << "parameter did not move";
  }
};

// epsilon 1e-3 in both: the other eigenvalues of the factors are exactly epsilon, so the float32
// root carries epsilon^(−e) ≫ 1 there and cancels it only to float32 round-off (see Precision);
// the closed forms hold for any epsilon.

// A vector g: L = g gᵀ has eigenvector g with eigenvalue ‖g‖², the other eigenvalues of L + εI are
// ε (no shift), so (L + εI)^(−1/2) g = g / sqrt(‖g‖² + ε).
TEST_P(ClosedForm, VectorOneStepIsNormalizedGradient) {
  auto gen = make_generator(7);
  const auto w0 = randn({17}, gen);
  const auto g = dyadic({17}, gen);
  const double lr = 0.1, epsilon = 1e-3;
  const auto gd = g.to(at::kDouble);
  const auto expected =
      w0.to(at::kDouble) - lr * gd / std::sqrt(gd.dot(gd).item<double>() + epsilon);
  check_one_step(w0, g, one_step_options(lr, epsilon, 1024), expected);
}

// A rank-1 G = u vᵀ: L = G Gᵀ = ‖v‖² u uᵀ and R = Gᵀ G = ‖u‖² v vᵀ, both with the single nonzero
// eigenvalue s = ‖u‖²‖v‖² = ‖G‖_F², so (L + εI)^(−1/4) u = (s + ε)^(−1/4) u and likewise for v:
// L^(−1/4) G R^(−1/4) = u vᵀ (s + ε)^(−1/2) = G / sqrt(‖G‖_F² + ε).
TEST_P(ClosedForm, RankOneMatrixOneStepIsNormalizedGradient) {
  auto gen = make_generator(11);
  const auto w0 = randn({8, 12}, gen);
  // Dyadic u and v: G = u vᵀ is exactly rank 1 in float32 (a rounded outer product is not, and
  // ε^(−1/2) would amplify the rounding).
  const auto g = at::outer(dyadic({8}, gen), dyadic({12}, gen));
  const double lr = 0.1, epsilon = 1e-3;
  const auto gd = g.to(at::kDouble);
  const auto expected =
      w0.to(at::kDouble) - lr * gd / std::sqrt(gd.pow(2).sum().item<double>() + epsilon);
  // max_preconditioner_dim 12 keeps the 8x12 parameter a matrix (8·12 > 12).
  check_one_step(w0, g, one_step_options(lr, epsilon, 12), expected);
}

// Eigenvalue-corrected, one step before the first basis update (start −1 = frequency = 2, no
// grafting): the bases are the identity and D = G² (β2 = 1), so P = G / (sqrt(G²) + ε) = G / (|G| +
// ε) elementwise, AdaGrad's first step (docs/math.md: steps before start without grafting
// precondition, step 5; with no basis update eigenvalue-corrected Shampoo reduces to AdaGrad).
TEST_P(ClosedForm, EigenvalueCorrectedBeforeFirstBasisIsAdaGrad) {
  auto gen = make_generator(13);
  const auto w0 = randn({6, 6}, gen);
  const auto g = dyadic({6, 6}, gen) + 1.0 / 32;  // no exact zeros
  const double lr = 0.1, epsilon = 1e-3;
  const auto options = shampoo::ShampooOptions::reference_defaults(lr)
                           .betas({0.0, 1.0})
                           .epsilon(epsilon)
                           .precondition_frequency(2)
                           .max_preconditioner_dim(8)
                           .factor_matrix_dtype(GetParam())
                           .preconditioner(shampoo::EigenvalueCorrectedShampooConfig{});
  const auto gd = g.to(at::kDouble);
  const auto expected = w0.to(at::kDouble) - lr * gd / (gd.abs() + epsilon);
  check_one_step(w0, g, options, expected);
}

INSTANTIATE_TEST_SUITE_P(FactorDtypes, ClosedForm, ::testing::Values(at::kFloat, at::kDouble),
                         [](const auto& info) {
                           return std::string(info.param == at::kFloat ? "f32" : "f64") +
                                  "_factors";
                         });

// Sanity of the reference blocking itself (docs/math.md examples).
TEST(ReferenceBlocking, MatchesNumericsExamples) {
  EXPECT_EQ(reference_merged_shape({1, 2, 5, 1}, 10, true), (std::vector<int64_t>{10}));
  EXPECT_EQ(reference_merged_shape({32, 3, 64, 64}, 8192, true), (std::vector<int64_t>{96, 4096}));
  EXPECT_EQ(reference_merged_shape({10, 5}, 1024, true), (std::vector<int64_t>{50}));
  EXPECT_EQ(reference_merged_shape({1, 1}, 1024, true), (std::vector<int64_t>{1}));
  EXPECT_EQ(reference_merged_shape({3, 0, 2}, 1024, true), (std::vector<int64_t>{0}));
  EXPECT_EQ(reference_merged_shape({4, 5, 6}, 1024, false), (std::vector<int64_t>{4, 5, 6}));
  const auto blocks = reference_blocks({1000, 3000}, 1024);
  ASSERT_EQ(blocks.size(), 3u);
  EXPECT_EQ(blocks[2].sizes, (std::vector<int64_t>{1000, 952}));
  EXPECT_EQ(blocks[2].offsets, (std::vector<int64_t>{0, 2048}));
}

}  // namespace
