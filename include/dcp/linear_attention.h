// Causal linear attention over a packed stream of feature-mapped queries and keys (Katharopoulos et al. 2020,
// "Transformers are RNNs"), in three forms of the same operator as fla keeps them (fla/ops/linear_attn: naive,
// chunk, fused_recurrent): the masked quadratic reference (src/kernels/linear_attention/naive.cpp), the chunked
// scan (chunk.cpp) and the token-by-token recurrence (recurrent.cpp). Flexformer (dcp/flexformer.h) computes
// the features and normalises the result.
#pragma once

#include <torch/types.h>

#include <cstdint>

namespace dcp {

/// attention.mode: the three computations of the same operator.
enum class LinearAttentionForm {
  kQuadratic,  ///< masked phi(Q) phi(K)^T per sequence: the O(L^2) reference
  kChunk,      ///< chunked causal scan: O(T C F + T F Dv), working memory O(C^2 + F Dv) per head
  kRecurrent,  ///< token-by-token state update, as in decoding
};

/// Per-sequence state of causal linear attention: for every sequence and head, S = sum_s phi(k_s) v_s^T and
/// z = sum_s phi(k_s) over the tokens seen so far. Kept in fp32 (fp64 for fp64 inputs) whatever the input dtype.
struct LinearAttentionState {
  torch::Tensor s;  ///< [n_seq, heads, F, Dv]
  torch::Tensor z;  ///< [n_seq, heads, F]
};

/// Result of causal_linear_attention; y_t = numerator_t / denominator_t is the kernelised attention average.
struct LinearAttentionOutput {
  torch::Tensor numerator;          ///< [T, heads, Dv]: phi(q_t)^T S_t
  torch::Tensor denominator;        ///< [T, heads]: phi(q_t)^T z_t
  LinearAttentionState final_state; ///< each sequence's state after its last token; set only when requested
};

/// Causal linear attention over a packed stream of features, unnormalised (Katharopoulos et al. 2020; chunked
/// form as fla's naive_chunk_linear_attn). Sequence i is tokens [cu_seqlens[i], cu_seqlens[i+1]); each starts
/// from `initial` (null: zero state) and nothing crosses a boundary. S_t includes token t.
/// phi_q, phi_k: [T, heads, F]; v: [T, heads, Dv]; all of one dtype, float32 or float64, on one device.
/// cu_seqlens: [n_seq + 1] int64, non-decreasing from 0 to T (read on the host). chunk_size (>= 1) is used by
/// kChunk only. The three forms give the same result up to rounding.
/// Throws std::invalid_argument naming the argument for a bad shape, dtype, cu_seqlens, chunk_size or state.
LinearAttentionOutput causal_linear_attention(const torch::Tensor& phi_q, const torch::Tensor& phi_k,
                                              const torch::Tensor& v, const torch::Tensor& cu_seqlens,
                                              LinearAttentionForm form, int64_t chunk_size,
                                              const LinearAttentionState* initial = nullptr,
                                              bool return_final_state = false);

}  // namespace dcp
