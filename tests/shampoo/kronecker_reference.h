#pragma once
// What the float64 references of the Kronecker families share (eigendecomposed_families_test,
// kl_shampoo_test): plain ATen helpers written from docs/math.md (no code of preconditioners/ or
// shampoo/), the settings a reference reads from ShampooOptions, the reference cases' parameters
// and the loop that compares the optimizer with a reference after every step; and an options
// archive without some entries, as written before those entries existed.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <shampoo/shampoo.h>

#include <algorithm>
#include <functional>
#include <ostream>
#include <string>
#include <variant>
#include <vector>

#include "shampoo/option_fields.h"
#include "support/test_support.h"

namespace shampoo::testing::kronecker {

inline at::TensorOptions f64() { return at::TensorOptions().dtype(at::kDouble); }

/// out[.., i, ..] = Σ_j M[i, j]·T[.., j, ..] along dim k.
inline at::Tensor apply_along(const at::Tensor& t, const at::Tensor& m, int64_t k) {
  const auto moved = t.movedim(k, 0);
  const auto shape = moved.sizes().vec();
  return m.mm(moved.reshape({shape[0], -1})).reshape(shape).movedim(0, k);
}

/// G contracted with itself over every dim but k.
inline at::Tensor contract_all_but(const at::Tensor& g, int64_t k) {
  const auto m = g.movedim(k, 0).reshape({g.size(k), -1});
  return m.mm(m.t());
}

/// The settings a reference reads: lr, β2, ε, frequency, exponents, QR or eigh, the pseudo-inverse.
struct ReferenceConfig {
  double lr, beta2, epsilon;
  int64_t frequency;
  bool qr = false;
  bool pseudo_inverse = false;
  double rank_atol = 0.0, rank_rtol = 0.0;
  InverseExponentOverride overrides;

  explicit ReferenceConfig(const ShampooOptions& o)
      : lr(o.lr()),
        beta2(std::get<1>(o.betas())),
        epsilon(o.epsilon()),
        frequency(o.precondition_frequency()),
        overrides(o.inverse_exponent_override()) {
    std::visit(
        [&](const auto& c) {
          if constexpr (requires { c.eigenbasis_method; }) {
            qr = c.eigenbasis_method == EigenbasisMethod::kQR;
          }
          if constexpr (requires { c.rank_deficient_stability; }) {
            if (const auto* p = std::get_if<PseudoInverseConfig>(&c.rank_deficient_stability)) {
              pseudo_inverse = true;
              rank_atol = p->rank_atol;
              rank_rtol = p->rank_rtol;
            }
          }
        },
        o.preconditioner());
  }

  double exponent(int64_t order, int64_t k) const {
    const auto it = overrides.find(order);
    if (it != overrides.end()) {
      if (const auto d = it->second.find(k); d != it->second.end()) return d->second;
      if (const auto a = it->second.find(kAllDims); a != it->second.end()) return a->second;
    }
    return 1.0 / (2.0 * static_cast<double>(order));
  }

  /// Whether step t recomputes the roots or decompositions.
  bool amortized(int64_t t) const {
    return (t % frequency == 0 && t > frequency) || t == frequency;
  }
  /// The factor weight and the bias correction of step t.
  double weight() const { return beta2 < 1.0 ? 1.0 - beta2 : 1.0; }
  double bias_correction(int64_t t) const {
    return beta2 < 1.0 ? 1.0 - std::pow(beta2, static_cast<double>(t)) : 1.0;
  }

  /// f(λ): the two-step shift where λ_min < ε, then λ^(−e); or the pseudo-inverse powers.
  at::Tensor powers(const at::Tensor& lambda, double e) const {
    if (pseudo_inverse) {
      const double cutoff =
          std::max(rank_rtol * std::max(lambda.max().item<double>(), 0.0), rank_atol);
      return at::where(lambda <= cutoff, at::zeros_like(lambda), lambda.pow(-e));
    }
    auto shifted = lambda;
    const double lambda_min = lambda.min().item<double>();
    if (lambda_min < epsilon) shifted = (lambda - lambda_min) + epsilon;
    return shifted.pow(-e);
  }

  /// Q·diag(f(λ))·Qᵀ with λ, Q the eigendecomposition of A + ε·I.
  at::Tensor root(const at::Tensor& a, double e) const {
    const auto [lambda, q] = at::linalg_eigh(a + epsilon * at::eye(a.size(0), f64()));
    return (q * powers(lambda, e)).mm(q.t());
  }
};

/// One reference run: the optimizer's options and the dtype of its parameters.
struct ReferenceCase {
  std::string name;
  ShampooOptions options = ShampooOptions::reference_defaults();
  at::ScalarType dtype;
};
inline void PrintTo(const ReferenceCase& c, std::ostream* os) { *os << c.name; }

/// The reference cases' common options: one block per parameter, no filtering.
inline ShampooOptions reference_base() {
  return ShampooOptions::reference_defaults(0.05)
      .betas({0.0, 0.95})
      .epsilon(1e-3)
      .max_preconditioner_dim(8)
      .use_merge_dims(false);
}

/// A matrix, a vector and a 3-D tensor.
inline std::vector<at::Tensor> reference_params(at::ScalarType dtype) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  std::vector<at::Tensor> params;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{6, 5}, {7}, {3, 4, 2}}) {
    params.push_back(at::randn(shape, gen).to(dtype).requires_grad_());
  }
  return params;
}

/// Seven steps of DistributedShampoo with `c.options` against `Reference` (constructed from the
/// parameters and options; step(gradients), param(i)), compared after every step within the
/// dtype's tolerance; the parameters moved and amortized computations ran without failing.
template <typename Reference>
void expect_matches_reference(const ReferenceCase& c) {
  auto params = reference_params(c.dtype);
  const auto initial = snapshot(params);
  DistributedShampoo opt(params, c.options);
  Reference reference(params, c.options);
  for (int step = 1; step <= 7; ++step) {
    set_random_grads(params, 300 + step);
    std::vector<at::Tensor> grads;
    for (const auto& p : params) grads.push_back(p.grad().detach().clone());
    opt.step();
    reference.step(grads);
    for (size_t i = 0; i < params.size(); ++i) {
      ASSERT_TRUE(
          all_close(params[i].detach(), reference.param(i).to(c.dtype), tolerance_for(c.dtype)))
          << c.name << " step " << step << " parameter " << i;
    }
  }
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_FALSE(params[i].detach().equal(initial[i])) << "parameter " << i << " did not move";
  }
  EXPECT_GT(opt.stats().amortized_computations, 0);
  EXPECT_EQ(opt.stats().failed_amortized_computations, 0);
}

/// `written` serialized without the rank-deficient stability entries (an archive written before
/// they existed), read into options whose preconditioner starts as `start`.
inline ShampooOptions without_stability_entries(const ShampooOptions& written,
                                                const PreconditionerConfig& start) {
  torch::serialize::OutputArchive full;
  written.serialize(full);
  std::stringstream bytes;
  full.save_to(bytes);
  torch::serialize::InputArchive full_in;
  full_in.load_from(bytes);
  torch::serialize::OutputArchive out;
  for (const auto& field : detail::option_fields()) {
    for (const auto& key : field.archive_keys) {
      if (key.find("rank_deficient") != std::string::npos ||
          key.find("pseudo_inverse") != std::string::npos) {
        continue;
      }
      c10::IValue value;
      EXPECT_TRUE(full_in.try_read(key, value)) << key;
      out.write(key, value);
    }
  }
  return read_options(out, ShampooOptions::reference_defaults().preconditioner(start));
}

}  // namespace shampoo::testing::kronecker
