#include "preconditioners/matrix_functions.h"

#include <c10/util/Exception.h>

#include <tuple>

namespace shampoo::detail {
namespace {

at::Tensor per_matrix_scalars(const std::vector<double>& values, const at::Tensor& like) {
  const auto n = static_cast<int64_t>(values.size());
  return at::tensor(values, at::TensorOptions().dtype(at::kDouble))
      .to(like.options().dtype(like.scalar_type()))
      .view({n, 1, 1});
}

/// eigh of one matrix, NaN-checked; returns false when LAPACK fails or returns non-finite values.
bool try_eigh(const at::Tensor& matrix, at::Tensor& eigenvalues, at::Tensor& eigenvectors) {
  try {
    std::tie(eigenvalues, eigenvectors) = at::linalg_eigh(matrix);
  } catch (const c10::Error&) {
    return false;
  }
  return at::isfinite(eigenvalues).all().item<bool>() &&
         at::isfinite(eigenvectors).all().item<bool>();
}

/// Decomposes every matrix of `stack`: batched first (the common case: one call), falling back
/// to one matrix at a time, each retried in float64 when allowed, when the batch fails.
/// Returns eigenvalues [n, d] and eigenvectors [n, d, d]; rows of failed matrices are left as is.
/// Matrices decomposed in float64 keep float64 values in `*_double` so callers can finish their
/// computation in float64 before casting back.
struct Decomposition {
  at::Tensor eigenvalues;
  at::Tensor eigenvectors;
  std::vector<bool> failed;
  std::vector<bool> in_double;
  std::vector<at::Tensor> eigenvalues_double;
  std::vector<at::Tensor> eigenvectors_double;
  int64_t retried = 0;
};

Decomposition decompose(const at::Tensor& stack, bool retry_double_precision) {
  const int64_t n = stack.size(0);
  Decomposition out;
  out.failed.assign(n, false);
  out.in_double.assign(n, false);
  out.eigenvalues_double.resize(n);
  out.eigenvectors_double.resize(n);
  bool batch_ok = false;
  try {
    std::tie(out.eigenvalues, out.eigenvectors) = at::linalg_eigh(stack);
    const auto finite = at::logical_and(at::isfinite(out.eigenvalues).all(1),
                                        at::isfinite(out.eigenvectors).flatten(1).all(1));
    batch_ok = finite.all().item<bool>();
  } catch (const c10::Error&) {
    batch_ok = false;
  }
  if (batch_ok) return out;

  // Slow path: isolate the failing matrices. eigh of one matrix equals its row of the batched
  // result (LAPACK runs per matrix), so the healthy matrices get the same values either way.
  out.eigenvalues = at::empty({n, stack.size(1)}, stack.options());
  out.eigenvectors = at::empty_like(stack);
  for (int64_t i = 0; i < n; ++i) {
    at::Tensor values, vectors;
    if (try_eigh(stack[i], values, vectors)) {
      out.eigenvalues[i].copy_(values);
      out.eigenvectors[i].copy_(vectors);
      continue;
    }
    if (retry_double_precision && stack.scalar_type() != at::kDouble) {
      ++out.retried;
      if (try_eigh(stack[i].to(at::kDouble), values, vectors)) {
        out.in_double[i] = true;
        out.eigenvalues_double[i] = values;
        out.eigenvectors_double[i] = vectors;
        continue;
      }
    }
    out.failed[i] = true;
  }
  return out;
}

/// Q·diag(f(λ))·Qᵀ for one stack; `powers` [n, d].
at::Tensor reconstruct(const at::Tensor& eigenvectors, const at::Tensor& powers) {
  return at::matmul(eigenvectors * powers.unsqueeze(-2), eigenvectors.transpose(-2, -1));
}

/// λ ← λ + (ε − λ_min) where λ_min < ε, then λ^(−e). λ ascending, so λ_min = λ[..., 0].
at::Tensor shifted_powers(const at::Tensor& eigenvalues, const at::Tensor& epsilons,
                          const at::Tensor& exponents) {
  const auto lambda_min = eigenvalues.narrow(-1, 0, 1);
  const auto shift = at::where(lambda_min < epsilons, epsilons - lambda_min,
                               at::zeros_like(lambda_min));
  return at::pow(eigenvalues + shift, -exponents);
}

}  // namespace

std::vector<bool> stacked_all_finite(const at::Tensor& A) {
  const auto finite = at::isfinite(A).flatten(1).all(1).to(at::kCPU);
  std::vector<bool> out(finite.size(0));
  const auto* data = finite.data_ptr<bool>();
  for (size_t i = 0; i < out.size(); ++i) out[i] = data[i];
  return out;
}

StackedMatrixResult stacked_inverse_root(const at::Tensor& A, const std::vector<double>& epsilons,
                                         const std::vector<double>& exponents,
                                         bool retry_double_precision) {
  TORCH_INTERNAL_ASSERT(A.dim() == 3 && A.size(1) == A.size(2), "expected [n, d, d], got ",
                        A.sizes());
  const int64_t n = A.size(0);
  const int64_t d = A.size(1);
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(epsilons.size()) == n &&
                        static_cast<int64_t>(exponents.size()) == n);
  StackedMatrixResult result;
  result.failed.assign(n, false);
  if (n == 0) {
    result.values = at::empty_like(A);
    return result;
  }
  const auto finite = stacked_all_finite(A);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(finite[i], "inverse root: matrix ", i, " of the stack has non-finite entries");
  }

  const auto eps = per_matrix_scalars(epsilons, A);  // [n, 1, 1]
  const auto eye = at::eye(d, A.options());
  const auto regularized = A + eye * eps;
  auto decomposition = decompose(regularized, retry_double_precision);
  result.failed = decomposition.failed;
  result.retried_in_double = decomposition.retried;

  const auto eps_row = eps.view({n, 1});
  const auto exponent_row = per_matrix_scalars(exponents, A).view({n, 1});
  result.values =
      reconstruct(decomposition.eigenvectors,
                  shifted_powers(decomposition.eigenvalues, eps_row, exponent_row));
  for (int64_t i = 0; i < n; ++i) {
    if (decomposition.in_double[i]) {
      const auto eps_d = eps_row[i].to(at::kDouble);
      const auto exp_d = exponent_row[i].to(at::kDouble);
      const auto powers =
          shifted_powers(decomposition.eigenvalues_double[i].unsqueeze(0), eps_d.unsqueeze(0),
                         exp_d.unsqueeze(0));
      result.values[i].copy_(reconstruct(decomposition.eigenvectors_double[i].unsqueeze(0), powers)
                                 .squeeze(0));
    }
    if (exponents[i] == 0.0 && !result.failed[i]) {
      result.values[i].copy_(eye);
    }
  }
  return result;
}

StackedMatrixResult stacked_eigenbasis(const at::Tensor& A, bool retry_double_precision) {
  TORCH_INTERNAL_ASSERT(A.dim() == 3 && A.size(1) == A.size(2));
  StackedMatrixResult result;
  const int64_t n = A.size(0);
  result.failed.assign(n, false);
  if (n == 0) {
    result.values = at::empty_like(A);
    return result;
  }
  const auto finite = stacked_all_finite(A);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(finite[i], "eigenbasis: matrix ", i, " of the stack has non-finite entries");
  }
  auto decomposition = decompose(A, retry_double_precision);
  result.failed = decomposition.failed;
  result.retried_in_double = decomposition.retried;
  result.values = decomposition.eigenvectors;
  for (int64_t i = 0; i < n; ++i) {
    if (decomposition.in_double[i]) {
      result.values[i].copy_(decomposition.eigenvectors_double[i]);
    }
  }
  return result;
}

StackedMatrixResult stacked_eigenbasis_qr(const at::Tensor& A, const at::Tensor& previous_basis) {
  TORCH_INTERNAL_ASSERT(A.dim() == 3 && A.sizes() == previous_basis.sizes());
  StackedMatrixResult result;
  const int64_t n = A.size(0);
  result.failed.assign(n, false);
  const auto finite = stacked_all_finite(A);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(finite[i], "eigenbasis (QR): matrix ", i, " of the stack has non-finite entries");
  }
  // Orthogonal iteration needs the columns by descending eigenvalue (Gram-Schmidt keeps the
  // dominant directions first); the stored bases are ascending, as eigh returns them.
  const auto power = at::bmm(A, previous_basis.flip(-1));
  auto [q, r] = at::linalg_qr(power);
  // Order the columns by their Rayleigh quotients (ascending), as eigh orders eigenvalues.
  const auto rayleigh = at::bmm(q.transpose(1, 2), at::bmm(A, q)).diagonal(0, 1, 2);
  const auto order = rayleigh.argsort(/*stable=*/true, /*dim=*/1);
  q = at::gather(q, 2, order.unsqueeze(1).expand_as(q));
  const auto ok = stacked_all_finite(q);
  for (int64_t i = 0; i < n; ++i) result.failed[i] = !ok[i];
  result.values = q;
  return result;
}

}  // namespace shampoo::detail
