// Rotary position embeddings as the KV policies need them outside the model: undoing the rotation of recorded
// queries (Expected Attention fits its statistics before rotary) and the mean rotation over a range of future
// positions (kvpress ExpectedAttentionPress, n_future_positions). The convention is the model's
// (fused_rotary, dcp/fused_ops.h): dimension i and i + head_dim/2 rotate by position * theta^(-2i/head_dim),
// (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). fp64 here, so a tiny difference from the fp32 kernel remains.
#pragma once

#include <torch/types.h>

#include <cstdint>

namespace dcp {

/// x [T, heads, head_dim] rotated by `sign` x the rotary angle of positions[t] (sign 1: as the model rotates,
/// -1: its inverse), in fp64. positions [T] int64; head_dim even; theta > 0. Throws std::invalid_argument for
/// shapes that do not fit.
torch::Tensor kv_rotate(const torch::Tensor& x, const torch::Tensor& positions, double theta, double sign);

/// The mean rotation matrix over positions first .. first + count - 1: Rbar = (1/count) sum_t R(t), [head_dim,
/// head_dim] fp64, with R(t) x = the rotary of x at position t (so Rbar x is the mean of the rotated x). For a
/// pre-rotary query law N(mu, Sigma), the rotated queries of those positions have mean Rbar mu, and kvpress
/// models their covariance as Rbar Sigma Rbar^T. count >= 1, head_dim even, theta > 0; throws
/// std::invalid_argument otherwise.
torch::Tensor kv_mean_rotation(int64_t head_dim, int64_t first, int64_t count, double theta);

}  // namespace dcp
