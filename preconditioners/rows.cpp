#include "preconditioners/rows.h"

#include <c10/util/Exception.h>

#include <numeric>

namespace shampoo::detail {

at::Tensor host_to_device(const at::Tensor& host, const at::Device& device, at::ScalarType dtype) {
  const auto typed = host.to(dtype);
  if (!device.is_cuda()) return typed.to(device);
  return typed.pin_memory().to(device, /*non_blocking=*/true);
}

at::Tensor Rows::index(const at::Device& device) const {
  return host_to_device(at::tensor(rows, at::TensorOptions().dtype(at::kLong)), device, at::kLong);
}

Rows Rows::every(int64_t n) {
  Rows r;
  r.rows.resize(n);
  std::iota(r.rows.begin(), r.rows.end(), 0);
  r.all = true;
  return r;
}

std::pair<Rows, RowScalars> select_rows(const Rows& rows, const RowScalars& scalars,
                                        const std::vector<bool>& selected) {
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(selected.size()) == rows.size());
  Rows out_rows;
  RowScalars out;
  for (int64_t i = 0; i < rows.size(); ++i) {
    if (!selected[i]) continue;
    out_rows.rows.push_back(rows.rows[i]);
    out.beta2.push_back(scalars.beta2[i]);
    out.factor_weight.push_back(scalars.factor_weight[i]);
    out.bias_correction2.push_back(scalars.bias_correction2[i]);
    out.epsilon.push_back(scalars.epsilon[i]);
    if (!scalars.relative_epsilon.empty()) {
      out.relative_epsilon.push_back(scalars.relative_epsilon[i]);
    }
    out.step.push_back(scalars.step[i]);
  }
  out_rows.all = rows.all && out_rows.size() == rows.size();
  return {std::move(out_rows), std::move(out)};
}

bool Rows::consecutive() const {
  for (int64_t i = 1; i < size(); ++i) {
    if (rows[i] != rows[0] + i) return false;
  }
  return size() > 0;
}

at::Tensor gather_rows(const at::Tensor& stacked, const Rows& rows) {
  if (rows.all) return stacked;
  if (rows.consecutive()) return stacked.narrow(0, rows.rows[0], rows.size());
  return stacked.index_select(0, rows.index(stacked.device()));
}

void scatter_rows(at::Tensor& stacked, const Rows& rows, const at::Tensor& values) {
  if (rows.all) {
    if (!values.is_same(stacked)) stacked.copy_(values);
    return;
  }
  if (rows.consecutive()) {
    auto target = stacked.narrow(0, rows.rows[0], rows.size());
    // Nothing to do when `values` is the view gather_rows gave (updated in place).
    if (values.data_ptr() != target.data_ptr() || values.strides() != target.strides()) {
      target.copy_(values);
    }
    return;
  }
  stacked.index_copy_(0, rows.index(stacked.device()), values);
}

at::Tensor row_scalars(const std::vector<double>& values, const at::TensorOptions& options,
                       int64_t dims) {
  std::vector<int64_t> shape(dims, 1);
  shape[0] = static_cast<int64_t>(values.size());
  return host_to_device(at::tensor(values, at::TensorOptions().dtype(at::kDouble)),
                        options.device(), c10::typeMetaToScalarType(options.dtype()))
      .view(shape);
}

const at::Tensor& checked_entry(const std::map<std::string, at::Tensor>& in, const std::string& key,
                                const std::string& owner) {
  const auto it = in.find(key);
  TORCH_CHECK(it != in.end(), "checkpoint: ", owner, " has no entry '", key,
              "' (the checkpoint was written with other options or for another model)");
  return it->second;
}

at::Tensor checked_state(const std::map<std::string, at::Tensor>& in, const std::string& key,
                         at::IntArrayRef shape, const at::TensorOptions& options,
                         const std::string& owner) {
  const auto& entry = checked_entry(in, key, owner);
  TORCH_CHECK(entry.sizes() == shape, "checkpoint: ", owner, " entry '", key, "' has shape ",
              entry.sizes(), ", expected ", shape);
  return entry.to(options);
}

}  // namespace shampoo::detail
