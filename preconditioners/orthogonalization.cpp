#include "preconditioners/orthogonalization.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace shampoo::detail {

at::Tensor newton_schulz(const at::Tensor& blocks, int64_t num_iterations,
                         const std::array<double, 3>& coefficients) {
  TORCH_INTERNAL_ASSERT(blocks.dim() == 3, "newton_schulz: expected [n, m, k], got ",
                        blocks.sizes());
  const auto [a, b, c] = coefficients;
  // Frobenius normalization bounds the spectral norm by 1, inside the iteration's basin; the
  // clamp keeps a zero matrix at zero.
  const auto norms = at::linalg_vector_norm(blocks, 2, {1, 2}, /*keepdim=*/true).clamp_min(1e-8);
  auto x = blocks / norms;
  const bool wide = blocks.size(1) < blocks.size(2);
  if (wide) x = x.transpose(1, 2);
  for (int64_t i = 0; i < num_iterations; ++i) {
    // With X tall, Xᵀ·X is the smaller Gram matrix; the update X·(b·B + c·B²) equals
    // b·(XXᵀ)X + c·(XXᵀ)²X.
    auto gram = at::bmm(x.transpose(1, 2), x);
    gram = at::baddbmm(gram, gram, gram, /*beta=*/b, /*alpha=*/c);
    x = at::baddbmm(x, x, gram, /*beta=*/a, /*alpha=*/1.0);
  }
  return wide ? x.transpose(1, 2).contiguous() : x;
}

at::Tensor svd_orthogonalize(const at::Tensor& blocks, bool scale_by_nuclear_norm) {
  const auto [u, s, vh] = at::linalg_svd(blocks, /*full_matrices=*/false);
  auto out = at::bmm(u, vh);
  if (scale_by_nuclear_norm) out.mul_(s.sum(-1).view({-1, 1, 1}));
  return out;
}

namespace {

at::Tensor orthogonalize_batch(const at::Tensor& blocks, const SpectralDescentConfig& s) {
  if (s.method == OrthogonalizationMethod::kSVD) {
    return svd_orthogonalize(blocks, s.scale_by_nuclear_norm);
  }
  return newton_schulz(blocks, s.num_iterations, s.coefficients);
}

}  // namespace

at::Tensor stacked_orthogonalize(const at::Tensor& blocks, const SpectralDescentConfig& settings) {
  TORCH_INTERNAL_ASSERT(blocks.dim() == 3, "stacked_orthogonalize: expected [n, m, k], got ",
                        blocks.sizes());
  at::Tensor out;
  if (blocks.is_cuda()) {
    out = orthogonalize_batch(blocks, settings);
  } else {
    out = at::empty_like(blocks, at::MemoryFormat::Contiguous);
    for (int64_t i = 0; i < blocks.size(0); ++i) {
      // A fresh (64-byte-aligned) allocation per matrix: its result depends on its values only.
      const auto member = blocks.narrow(0, i, 1).clone(at::MemoryFormat::Contiguous);
      out.narrow(0, i, 1).copy_(orthogonalize_batch(member, settings));
    }
  }
  if (settings.scale == OrthogonalizationScale::kSqrtAspectRatio) {
    const double rows = static_cast<double>(blocks.size(1));
    const double cols = static_cast<double>(blocks.size(2));
    out.mul_(std::sqrt(std::max(1.0, rows / cols)));
  }
  return out;
}

}  // namespace shampoo::detail
