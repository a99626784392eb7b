// Fused elementwise operators of the transformer block, each one pass over its rows forward and one backward,
// with fp32 arithmetic whatever the storage dtype (fp32 or bf16), on AVX-512 (F, BW, VL). Each has a plain twin,
// the same formula as differentiable ATen ops (*_reference), which the fused one calls on CPUs without AVX-512
// and on non-CPU tensors; tests/unit/test_fused_ops.cpp compares the two. The fused ones are custom autograd
// Functions, parallel over rows (at::parallel_for).
#pragma once

#include <torch/types.h>

namespace dcp {

/// RMSNorm (Zhang & Sennrich 2019): y = x / sqrt(mean(x^2) + eps) * weight, the statistic and the product in
/// fp32, y rounded once to x's dtype. x [..., d] fp32 or bf16 (last dimension contiguous), weight [d] fp32.
/// Returns y with x's shape and dtype; gradients reach x (its dtype) and weight (fp32). Throws
/// std::invalid_argument for a weight of another width or an unsupported dtype.
torch::Tensor fused_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor rms_norm_reference(const torch::Tensor& x, const torch::Tensor& weight, double eps);

/// Rotary position embedding (Su et al. 2021, RoFormer) in the rotate_half layout: dimension i < D/2 is rotated
/// with i + D/2 by angle position * theta^(-2i/D); angles, cos, sin and the products in fp32, one rounding to x's
/// dtype. x [T, heads, D] fp32 or bf16 (last dimension contiguous, other strides free: views of a qkv
/// projection), positions [T] int64. Returns a contiguous [T, heads, D] of x's dtype. Throws
/// std::invalid_argument for an odd D, mismatched T or an unsupported dtype.
torch::Tensor fused_rotary(const torch::Tensor& x, const torch::Tensor& positions, double theta);
torch::Tensor rotary_reference(const torch::Tensor& x, const torch::Tensor& positions, double theta);

/// SwiGLU's gate (Shazeer 2020): silu(gate) * up = gate * sigmoid(gate) * up, in fp32, rounded once to the
/// input's dtype, on one [rows, 2F] projection whose first F columns are the gate and the last F the up
/// projection (fp32 or bf16; last dimension contiguous). Returns a contiguous [rows, F]; the gradient is one
/// [rows, 2F] tensor, so the projection's backward needs no concatenation. Throws std::invalid_argument for an
/// odd width or an unsupported dtype.
torch::Tensor fused_swiglu(const torch::Tensor& gate_up);
torch::Tensor swiglu_reference(const torch::Tensor& gate_up);

/// Summed next-token cross-entropy: sum over rows with target != -100 of logsumexp(logits[r]) -
/// logits[r][target[r]], nats, as an fp32 scalar; the log-sum-exp in fp32 whatever the logits' dtype (fp32 or
/// bf16, so bf16 logits need no fp32 copy), the sum over rows in fp64. logits [rows, classes], targets [rows]
/// int64. The gradient reaches logits in their dtype. Throws std::invalid_argument for mismatched shapes, a
/// target outside [0, classes) other than -100, or an unsupported dtype.
torch::Tensor fused_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets);
torch::Tensor cross_entropy_reference(const torch::Tensor& logits, const torch::Tensor& targets);

}  // namespace dcp
