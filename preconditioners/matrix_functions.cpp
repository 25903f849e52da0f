#include "preconditioners/matrix_functions.h"

#include "preconditioners/decomposition.h"
#include "preconditioners/kronecker_contractions.h"
#include "preconditioners/rows.h"
#include "shampoo/config.h"

#if SHAMPOO_WITH_CUDA
#include "preconditioners/cuda/cuda_eigh.h"
#endif

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <tuple>

namespace shampoo::detail {
namespace {

at::Tensor per_matrix_scalars(const std::vector<double>& values, const at::Tensor& like) {
  const auto n = static_cast<int64_t>(values.size());
  return host_to_device(at::tensor(values, at::TensorOptions().dtype(at::kDouble)), like.device(),
                        like.scalar_type())
      .view({n, 1, 1});
}

/// eigh of one matrix, NaN-checked; returns false when LAPACK fails or returns non-finite values.
bool try_eigh(const at::Tensor& matrix, at::Tensor& eigenvalues, at::Tensor& eigenvectors) {
  try {
    std::tie(eigenvalues, eigenvectors) = at::linalg_eigh(matrix);
  } catch (const c10::Error&) {
    return false;
  }
  // stacked_all_finite's one pass on the CPU (at::isfinite(...).all() took 0.85 ms for a 512×512
  // float32 matrix, a twentieth of its eigh).
  return stacked_all_finite(eigenvalues.reshape({1, -1}))[0] &&
         stacked_all_finite(eigenvectors.reshape({1, -1}))[0];
}

/// Decomposes every matrix of `stack` one at a time (LAPACK's batched results depend on the
/// batch; see kronecker_contractions.h), from an aligned copy, retried in float64 when allowed;
/// CUDA stacks go to cuSOLVER (preconditioners/cuda/cuda_eigh.h).

Decomposition decompose(const at::Tensor& stack, bool retry_double_precision) {
#if SHAMPOO_WITH_CUDA
  if (stack.is_cuda()) return decompose_cuda(stack, retry_double_precision);
#endif
  const int64_t n = stack.size(0);
  Decomposition out(n);
  out.eigenvalues = at::empty({n, stack.size(1)}, stack.options());
  out.eigenvectors = at::empty_like(stack);
  for (int64_t i = 0; i < n; ++i) {
    const auto matrix = aligned_matrix_operand(stack[i]);
    at::Tensor values, vectors;
    if (try_eigh(matrix, values, vectors)) {
      out.eigenvalues[i].copy_(values);
      out.eigenvectors[i].copy_(vectors);
      continue;
    }
    if (retry_double_precision && stack.scalar_type() != at::kDouble) {
      ++out.retried;
      if (try_eigh(matrix.to(at::kDouble), values, vectors)) {
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

/// Q·diag(f(λ))·Qᵀ of one matrix (`powers` [d]) written into `out` [d, d]: straight where `out` is
/// an aligned output of the product's dtype (a slot of a fresh stack is: the product rounds as
/// into a fresh matrix), else through a copy (e.g. a float64 retry into a float32 stack).
void reconstruct_into(at::Tensor out, const at::Tensor& eigenvectors, const at::Tensor& powers) {
  const auto scaled = (eigenvectors * powers.unsqueeze(0)).contiguous();
  const auto q = aligned_matrix_operand(eigenvectors);
  if (aligned_output(out) && out.scalar_type() == scaled.scalar_type()) {
    at::mm_out(out, scaled, q.t());
    return;
  }
  out.copy_(at::mm(scaled, q.t()));
}

/// Q·diag(f(λ))·Qᵀ of every matrix of a stack; `powers` [n, d].
at::Tensor reconstruct_stack(const at::Tensor& eigenvectors, const at::Tensor& powers) {
  return at::bmm(eigenvectors * powers.unsqueeze(1), eigenvectors.transpose(1, 2));
}

/// Where λ_min < ε: λ ← λ − λ_min, then λ ← λ + ε, in two roundings (docs/math.md step 3), so
/// the smallest eigenvalue becomes exactly ε. Adding (ε − λ_min) in one operation loses ε in
/// the rounding of λ_min when |λ_min| ≫ ε (a rank-deficient float32 factor with ε = 1e-12):
/// the smallest eigenvalue would become 0 and its power inf. Then λ^(−e). λ ascending, so
/// λ_min = λ[..., 0].
at::Tensor shifted_powers(const at::Tensor& eigenvalues, const at::Tensor& epsilons,
                          const at::Tensor& exponents) {
  const auto lambda_min = eigenvalues.narrow(-1, 0, 1);
  const auto shifted =
      at::where(lambda_min < epsilons, (eigenvalues - lambda_min) + epsilons, eigenvalues);
  return at::pow(shifted, -exponents);
}

/// docs/math.md, "Pseudo-inverse": λ^(−e) where λ > max(rtol·max(λ_max, 0), atol), else 0 (the
/// reference's PseudoInverseConfig; rtol < 0 means d·machine epsilon of `dtype`, the dtype the
/// reference's eigenvalues have: the factor dtype also after a float64 retry).
at::Tensor pseudo_inverse_powers(const at::Tensor& eigenvalues, const at::Tensor& exponents,
                                 const PseudoInverseConfig& settings, at::ScalarType dtype) {
  const double machine_epsilon = dtype == at::kDouble
                                     ? std::numeric_limits<double>::epsilon()
                                     : static_cast<double>(std::numeric_limits<float>::epsilon());
  const double rtol = settings.rank_rtol < 0.0
                          ? static_cast<double>(eigenvalues.size(-1)) * machine_epsilon
                          : settings.rank_rtol;
  const auto lambda_max = std::get<0>(eigenvalues.max(-1, /*keepdim=*/true)).clamp_min(0.0);
  const auto cutoff = (lambda_max * rtol).clamp_min(settings.rank_atol);
  return at::where(eigenvalues <= cutoff, at::zeros_like(eigenvalues),
                   at::pow(eigenvalues, -exponents));
}

/// f(λ) of step 3 (shift, then power) or of the pseudo-inverse.
at::Tensor root_powers(const at::Tensor& eigenvalues, const at::Tensor& epsilons,
                       const at::Tensor& exponents, const PseudoInverseConfig* pseudo_inverse,
                       at::ScalarType dtype) {
  if (pseudo_inverse != nullptr) {
    return pseudo_inverse_powers(eigenvalues, exponents, *pseudo_inverse, dtype);
  }
  return shifted_powers(eigenvalues, epsilons, exponents);
}

/// The eigh path of stacked_inverse_root for finite matrices.
StackedMatrixResult eigh_inverse_root(const at::Tensor& A, const std::vector<double>& epsilons,
                                      const std::vector<double>& exponents,
                                      bool retry_double_precision,
                                      const PseudoInverseConfig* pseudo_inverse) {
  const int64_t n = A.size(0);
  const int64_t d = A.size(1);
  StackedMatrixResult result;
  const auto eps = per_matrix_scalars(epsilons, A);  // [n, 1, 1]
  const auto eye = at::eye(d, A.options());
  // A + ε·I as A + 0 (the sum's rounding: −0 becomes +0, as in A + ε·I off the diagonal), then ε
  // added on the diagonal: the bits of A + eye·ε without its two stack-sized temporaries.
  auto regularized = at::add(A, 0.0);
  regularized.diagonal(0, 1, 2).add_(eps.view({n, 1}));
  auto decomposition = decompose(regularized, retry_double_precision);
  result.failed = decomposition.failed;
  result.retried_in_double = decomposition.retried;

  const auto eps_row = eps.view({n, 1});
  const auto exponent_row = per_matrix_scalars(exponents, A).view({n, 1});
  // CUDA: the powers and products of the whole stack at once (one matrix at a time cost
  // ~0.14 ms each on an H100, 100× the decomposition of a stack of small blocks); the matrices
  // retried in float64 and the identities are redone below. The CPU keeps one matrix at a time
  // (results independent of the stack, as the distributed engine needs).
  const bool batched = A.is_cuda();
  result.values =
      batched ? reconstruct_stack(decomposition.eigenvectors,
                                  root_powers(decomposition.eigenvalues, eps_row, exponent_row,
                                              pseudo_inverse, A.scalar_type()))
              : at::empty_like(A);
  for (int64_t i = 0; i < n; ++i) {
    if (result.failed[i]) continue;
    if (batched && exponents[i] != 0.0 && !decomposition.in_double[i]) continue;
    if (exponents[i] == 0.0) {
      result.values[i].copy_(eye);
    } else if (decomposition.in_double[i]) {
      const auto eps_d = eps_row[i].to(at::kDouble);
      const auto exp_d = exponent_row[i].to(at::kDouble);
      const auto powers_d = root_powers(decomposition.eigenvalues_double[i], eps_d, exp_d,
                                        pseudo_inverse, A.scalar_type());
      reconstruct_into(result.values[i], decomposition.eigenvectors_double[i], powers_d);
    } else {
      // Per matrix: vectorized pow and its scalar tail round differently, so the powers of a
      // matrix must not depend on where its eigenvalues sit in a larger tensor.
      const auto powers = root_powers(decomposition.eigenvalues[i].clone(), eps_row[i],
                                      exponent_row[i], pseudo_inverse, A.scalar_type());
      reconstruct_into(result.values[i], decomposition.eigenvectors[i], powers);
    }
  }
  return result;
}

/// Rows of the stack grouped by exponent (insertion order of first appearance).
std::vector<std::pair<double, std::vector<int64_t>>> rows_by_exponent(
    const std::vector<double>& exponents) {
  std::vector<std::pair<double, std::vector<int64_t>>> groups;
  for (int64_t i = 0; i < static_cast<int64_t>(exponents.size()); ++i) {
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == exponents[i]; });
    if (it == groups.end()) it = groups.insert(groups.end(), {exponents[i], {}});
    it->second.push_back(i);
  }
  return groups;
}

/// A's rows `rows`, without a copy when they are all of A in order.
at::Tensor select_matrices(const at::Tensor& A, const std::vector<int64_t>& rows) {
  if (static_cast<int64_t>(rows.size()) == A.size(0)) return A;
  return A.index_select(0, host_to_device(at::tensor(rows, at::TensorOptions().dtype(at::kLong)),
                                          A.device(), at::kLong));
}

template <typename T>
std::vector<T> pick(const std::vector<T>& values, const std::vector<int64_t>& rows) {
  std::vector<T> out;
  for (const int64_t r : rows) out.push_back(values[r]);
  return out;
}

/// The iterative solver on A's rows `rows`: writes the converged ones into `values`, returns
/// the others.
std::vector<int64_t> solve_rows(const at::Tensor& A, const std::vector<double>& epsilons,
                                const std::vector<int64_t>& rows, int64_t root,
                                const RootInvShampooConfig& settings, at::Tensor& values) {
  auto solved =
      iterative_inverse_root(select_matrices(A, rows), pick(epsilons, rows), root, settings);
  std::vector<int64_t> unsolved;
  for (size_t j = 0; j < rows.size(); ++j) {
    if (solved.converged[j]) {
      values[rows[j]].copy_(solved.values[static_cast<int64_t>(j)]);
    } else {
      unsolved.push_back(rows[j]);
    }
  }
  return unsolved;
}

/// The iterative path of stacked_inverse_root: one solver batch per exponent, eigh for what the
/// solver leaves unconverged and for non-integer roots.
StackedMatrixResult solver_inverse_root(const at::Tensor& A, const std::vector<double>& epsilons,
                                        const std::vector<double>& exponents,
                                        bool retry_double_precision,
                                        const RootInvShampooConfig& settings) {
  StackedMatrixResult result{at::empty_like(A), std::vector<bool>(A.size(0), false), 0, 0};
  std::vector<int64_t> by_eigh;
  for (const auto& [exponent, rows] : rows_by_exponent(exponents)) {
    const int64_t root = integer_root(exponent);
    if (exponent == 0.0 || root == 0) {
      by_eigh.insert(by_eigh.end(), rows.begin(), rows.end());
      continue;
    }
    auto s = settings;
    if (s.solver == RootSolver::kNewtonDB && !power_of_two_root(root)) {
      s.solver = RootSolver::kCoupledNewton;
    }
    TORCH_CHECK(s.solver != RootSolver::kNewtonSchulz || power_of_two_root(root),
                "RootSolver::kNewtonSchulz computes roots that are powers of two (>= 2), got the "
                "root ",
                root, " (exponent ", exponent, ")");
    auto unsolved = solve_rows(A, epsilons, rows, root, s, result.values);
    // TF32 cannot resolve a factor whose condition exceeds ~1e3 (its rounding makes it
    // indefinite): those go through the iteration again in float32 before eigh.
    if (s.tf32 && A.is_cuda() && !unsolved.empty()) {
      s.tf32 = false;
      unsolved = solve_rows(A, epsilons, unsolved, root, s, result.values);
    }
    result.solver_fallbacks += static_cast<int64_t>(unsolved.size());
    by_eigh.insert(by_eigh.end(), unsolved.begin(), unsolved.end());
  }
  if (by_eigh.empty()) return result;
  auto exact = eigh_inverse_root(select_matrices(A, by_eigh), pick(epsilons, by_eigh),
                                 pick(exponents, by_eigh), retry_double_precision, nullptr);
  result.retried_in_double = exact.retried_in_double;
  for (size_t j = 0; j < by_eigh.size(); ++j) {
    result.failed[by_eigh[j]] = exact.failed[j];
    if (!exact.failed[j]) result.values[by_eigh[j]].copy_(exact.values[static_cast<int64_t>(j)]);
  }
  return result;
}

}  // namespace

namespace {

/// Whether every entry of each row of `rows` [n, m] (contiguous, on the CPU) is finite: x − x is 0
/// for a finite x and NaN for ±inf and NaN. One read pass, the rows in parallel; at::isfinite's
/// four passes (==, abs, !=, all) took ~6% of a root step of the MLP workload (issue 28's perf).
template <typename T>
std::vector<bool> rows_all_finite_cpu(const at::Tensor& rows) {
  const int64_t n = rows.size(0);
  const int64_t m = rows.size(1);
  const T* data = rows.data_ptr<T>();
  std::vector<char> ok(static_cast<size_t>(n));
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = data + r * m;
      int bad = 0;
      for (int64_t i = 0; i < m; ++i) bad |= static_cast<int>(!(row[i] - row[i] == T(0)));
      ok[static_cast<size_t>(r)] = static_cast<char>(bad == 0);
    }
  });
  return {ok.begin(), ok.end()};
}

}  // namespace

std::vector<bool> stacked_all_finite(const at::Tensor& A) {
  if (A.is_cpu() && A.dim() >= 2 &&
      (A.scalar_type() == at::kFloat || A.scalar_type() == at::kDouble)) {
    const auto rows = A.flatten(1).contiguous();
    return A.scalar_type() == at::kFloat ? rows_all_finite_cpu<float>(rows)
                                         : rows_all_finite_cpu<double>(rows);
  }
  const auto finite = at::isfinite(A).flatten(1).all(1).to(at::kCPU);
  std::vector<bool> out(finite.size(0));
  const auto* data = finite.data_ptr<bool>();
  for (size_t i = 0; i < out.size(); ++i) out[i] = data[i];
  return out;
}

std::vector<double> regularization(const at::Tensor& A, const std::vector<double>& epsilons,
                                   const std::vector<double>& relative) {
  const bool any = std::any_of(relative.begin(), relative.end(), [](double r) { return r != 0.0; });
  if (!any || A.size(0) == 0) return epsilons;
  TORCH_INTERNAL_ASSERT(relative.size() == epsilons.size() &&
                        static_cast<int64_t>(epsilons.size()) == A.size(0));
  const auto diagonals = A.diagonal(0, 1, 2)
                             .to(at::kCPU, at::kDouble, /*non_blocking=*/false, /*copy=*/false)
                             .contiguous();
  const int64_t n = diagonals.size(0);
  const int64_t d = diagonals.size(1);
  const double* data = diagonals.data_ptr<double>();
  std::vector<double> out(epsilons);
  for (int64_t i = 0; i < n; ++i) {
    if (relative[i] == 0.0) continue;
    double trace = 0.0;
    for (int64_t j = 0; j < d; ++j) trace += data[i * d + j];
    // A factor is positive semidefinite; a trace below 0 is rounding of an all-but-zero factor.
    out[i] += relative[i] * std::max(trace, 0.0);
  }
  return out;
}

StackedMatrixResult stacked_inverse_root(const at::Tensor& A, const std::vector<double>& epsilons,
                                         const std::vector<double>& exponents,
                                         bool retry_double_precision,
                                         const RootInvShampooConfig* iterative,
                                         const PseudoInverseConfig* pseudo_inverse) {
  TORCH_INTERNAL_ASSERT(A.dim() == 3 && A.size(1) == A.size(2), "expected [n, d, d], got ",
                        A.sizes());
  const int64_t n = A.size(0);
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(epsilons.size()) == n &&
                        static_cast<int64_t>(exponents.size()) == n);
  if (n == 0) return StackedMatrixResult{at::empty_like(A), {}, 0, 0};
  const auto finite = stacked_all_finite(A);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(finite[i], "inverse root: matrix ", i, " of the stack has non-finite entries");
  }
  TORCH_INTERNAL_ASSERT(iterative == nullptr || pseudo_inverse == nullptr,
                        "the pseudo-inverse needs eigh roots");
  if (iterative == nullptr)
    return eigh_inverse_root(A, epsilons, exponents, retry_double_precision, pseudo_inverse);
  return solver_inverse_root(A, epsilons, exponents, retry_double_precision, *iterative);
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

StackedEigendecomposition stacked_eigendecomposition_qr(const at::Tensor& A,
                                                        const at::Tensor& previous_basis) {
  TORCH_INTERNAL_ASSERT(A.dim() == 3 && A.sizes() == previous_basis.sizes());
  const int64_t n = A.size(0);
  const auto finite = stacked_all_finite(A);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(finite[i], "eigenbasis (QR): matrix ", i, " of the stack has non-finite entries");
  }
  // Orthogonal iteration needs the columns by descending eigenvalue (Gram-Schmidt keeps the
  // dominant directions first); the stored bases are ascending, as eigh returns them.
  StackedEigendecomposition result;
  result.eigenvectors = at::empty_like(A);
  result.eigenvalues = at::empty({n, A.size(1)}, A.options());
  for (int64_t i = 0; i < n; ++i) {
    const auto a = aligned_matrix_operand(A[i]);
    const auto previous = aligned_matrix_operand(previous_basis[i].flip(-1));
    const auto [q, r] = at::linalg_qr(at::mm(a, previous));
    // Order the columns by their Rayleigh quotients (ascending), as eigh orders eigenvalues;
    // the quotients are the eigenvalue estimates.
    const auto aligned_q = aligned_matrix_operand(q);
    const auto rayleigh = (aligned_q * at::mm(a, aligned_q)).sum(0);
    const auto order = rayleigh.argsort(/*stable=*/true, /*dim=*/0);
    result.eigenvectors[i].copy_(aligned_q.index_select(1, order));
    result.eigenvalues[i].copy_(rayleigh.index_select(0, order));
  }
  const auto vectors_ok = stacked_all_finite(result.eigenvectors);
  const auto values_ok = stacked_all_finite(result.eigenvalues.unsqueeze(-1));
  result.failed.assign(n, false);
  for (int64_t i = 0; i < n; ++i) result.failed[i] = !vectors_ok[i] || !values_ok[i];
  return result;
}

StackedMatrixResult stacked_eigenbasis_qr(const at::Tensor& A, const at::Tensor& previous_basis) {
  auto decomposition = stacked_eigendecomposition_qr(A, previous_basis);
  StackedMatrixResult result;
  result.values = std::move(decomposition.eigenvectors);
  // A basis is usable when its vectors are finite (the Rayleigh quotients are not used).
  const auto ok = stacked_all_finite(result.values);
  result.failed.assign(ok.size(), false);
  for (size_t i = 0; i < ok.size(); ++i) result.failed[i] = !ok[i];
  return result;
}

StackedEigendecomposition stacked_eigendecomposition(const at::Tensor& A,
                                                     bool retry_double_precision) {
  TORCH_INTERNAL_ASSERT(A.dim() == 3 && A.size(1) == A.size(2));
  const int64_t n = A.size(0);
  StackedEigendecomposition result;
  if (n == 0) {
    result.eigenvalues = at::empty({0, A.size(1)}, A.options());
    result.eigenvectors = at::empty_like(A);
    return result;
  }
  const auto finite = stacked_all_finite(A);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(finite[i], "eigendecomposition: matrix ", i,
                " of the stack has non-finite entries");
  }
  auto decomposition = decompose(A, retry_double_precision);
  result.failed = decomposition.failed;
  result.retried_in_double = decomposition.retried;
  result.eigenvalues = decomposition.eigenvalues;
  result.eigenvectors = decomposition.eigenvectors;
  // Cast back to the stack's dtype: the reference keeps eigenvalues and vectors in that dtype.
  for (int64_t i = 0; i < n; ++i) {
    if (!decomposition.in_double[i]) continue;
    result.eigenvalues[i].copy_(decomposition.eigenvalues_double[i]);
    result.eigenvectors[i].copy_(decomposition.eigenvectors_double[i]);
  }
  return result;
}

at::Tensor stacked_inverse_root_from_eigendecomposition(const at::Tensor& eigenvalues,
                                                        const at::Tensor& eigenvectors,
                                                        const std::vector<double>& epsilons,
                                                        const std::vector<double>& exponents,
                                                        const PseudoInverseConfig* pseudo_inverse) {
  const int64_t n = eigenvectors.size(0);
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(epsilons.size()) == n &&
                        static_cast<int64_t>(exponents.size()) == n);
  const auto dtype = eigenvalues.scalar_type();
  const auto eps_row = per_matrix_scalars(epsilons, eigenvalues).view({n, 1});
  const auto exponent_row = per_matrix_scalars(exponents, eigenvalues).view({n, 1});
  const auto eye = at::eye(eigenvectors.size(1), eigenvectors.options());
  const bool batched = eigenvectors.is_cuda();
  auto out = batched
                 ? reconstruct_stack(eigenvectors, root_powers(eigenvalues, eps_row, exponent_row,
                                                               pseudo_inverse, dtype))
                 : at::empty_like(eigenvectors);
  // The CPU computes one matrix at a time, as eigh_inverse_root: a result must not depend on the
  // rest of the stack.
  for (int64_t i = 0; i < n; ++i) {
    if (exponents[i] == 0.0) {
      out[i].copy_(eye);
    } else if (!batched) {
      const auto powers =
          root_powers(eigenvalues[i].clone(), eps_row[i], exponent_row[i], pseudo_inverse, dtype);
      reconstruct_into(out[i], eigenvectors[i], powers);
    }
  }
  return out;
}

}  // namespace shampoo::detail
