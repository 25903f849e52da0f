#pragma once
/// The eigendecompositions of a stack of symmetric matrices, as the matrix functions use them:
/// eigenvalues [n, d] ascending and eigenvectors [n, d, d] in columns; rows of failed matrices
/// are left as they are. Matrices decomposed in float64 (the retry) keep float64 values in
/// `*_double`, so callers finish their computation in float64 before casting back.

#include <ATen/ATen.h>

#include <vector>

namespace shampoo::detail {

struct Decomposition {
  /// For a stack of n matrices: nothing failed, nothing in float64 yet.
  explicit Decomposition(int64_t n)
      : failed(n, false), in_double(n, false), eigenvalues_double(n), eigenvectors_double(n) {}

  at::Tensor eigenvalues;
  at::Tensor eigenvectors;
  std::vector<bool> failed;
  std::vector<bool> in_double;
  std::vector<at::Tensor> eigenvalues_double;
  std::vector<at::Tensor> eigenvectors_double;
  int64_t retried = 0;
};

}  // namespace shampoo::detail
