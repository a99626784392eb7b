// Checks shared by the tiled operator and its reference twin: shapes, dtypes and the cu_seqlens of a packed
// query and key stream (the conventions of include/dcp/attention_kernels.h).
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dcp {

/// Host copies of cu_seqlens_q and cu_seqlens_k, checked.
struct VarlenBounds {
  std::vector<int64_t> q, k;  ///< [n + 1] each
  int64_t samples() const { return static_cast<int64_t>(q.size()) - 1; }
  int64_t q_len(int64_t i) const { return q[i + 1] - q[i]; }
  int64_t k_len(int64_t i) const { return k[i + 1] - k[i]; }
};

/// Validates q [Tq, H, D], k, v [Tk, H, D] (same dtype, device, H and D; last dim contiguous) and the two
/// cu_seqlens (same count, non-decreasing, from 0 to Tq / Tk). `who` prefixes the message. Throws
/// std::invalid_argument naming the tensor and the value.
VarlenBounds check_varlen(const std::string& who, const torch::Tensor& q, const torch::Tensor& k,
                          const torch::Tensor& v, const torch::Tensor& cu_seqlens_q,
                          const torch::Tensor& cu_seqlens_k);

/// scale, or 1/sqrt(head_dim) when it is 0; throws std::invalid_argument for a non-finite or negative scale.
double attention_scale(const std::string& who, double scale, int64_t head_dim);

}  // namespace dcp
