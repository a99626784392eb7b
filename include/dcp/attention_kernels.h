// Exact softmax attention over packed variable-length sequences: the IO-aware tiled operator (FlashAttention-2,
// Dao 2023; FlashAttention, Dao et al. 2022) and its plain reference twin, plus the exact merge of partial
// results over disjoint key blocks (the (out, lse) form that KV caches and ring attention combine).
//
// Conventions shared by every function here:
// - q [Tq, heads, head_dim], k and v [Tk, heads, head_dim], one dtype among fp32, fp64 and bf16, on the CPU for
//   the tiled operator; the last dimension must be contiguous (other strides are free: views of a packed qkv
//   projection are fine).
// - cu_seqlens_q [n + 1] and cu_seqlens_k [n + 1], int64 on any device (read on the host): sample i has queries
//   [cu_seqlens_q[i], cu_seqlens_q[i+1]) and keys [cu_seqlens_k[i], cu_seqlens_k[i+1]); no attention across
//   samples. Both start at 0 and end at Tq and Tk.
// - causal: query r of sample i (0-based inside the sample, Lq = its query count, Lk = its key count) attends
//   keys c <= r + (Lk - Lq), FlashAttention's bottom-right alignment: with Lq == Lk the usual causal mask, with a
//   longer key side the queries are the last Lq positions (a prefill chunk after a cache). Not causal: every key
//   of the sample.
// - scores are scale * q.k with scale = 1/sqrt(head_dim) unless AttentionOptions::scale is set.
// - lse [Tq, heads]: natural log of sum_c exp(scale * q.k_c) over the keys a query attends; fp32 (fp64 for fp64
//   inputs). A query with no key gets out = 0 and lse = -inf.
#pragma once

#include <torch/types.h>

#include <cstdint>

namespace dcp {

/// Tunables of the tiled operator. Defaults were measured on a Sapphire Rapids core (docs/attention.md).
struct AttentionOptions {
  double scale = 0;       ///< score scale; 0 = 1/sqrt(head_dim)
  int64_t tile_q = 64;    ///< queries per tile (multiple of 32 on the AMX path: rounded up there), >= 1
  int64_t tile_k = 128;   ///< keys per tile (same rule), >= 1
  /// Use the portable C++ loops even where AVX-512 / AMX kernels exist (tests compare the two).
  bool portable = false;
};

/// Output and per-query logsumexp of attention (see the file comment for shapes and dtypes).
struct AttentionResult {
  torch::Tensor out;  ///< [Tq, heads, head_dim], dtype of q
  torch::Tensor lse;  ///< [Tq, heads], fp32 (fp64 for fp64 inputs); -inf for a query without keys
};

/// Gradients of attention with respect to q, k and v.
struct AttentionGrads {
  torch::Tensor dq;  ///< [Tq, heads, head_dim], dtype of q
  torch::Tensor dk;  ///< [Tk, heads, head_dim]
  torch::Tensor dv;  ///< [Tk, heads, head_dim]
};

/// Tiled forward outside autograd (FlashAttention-2 Algorithm 1): per (sample, head, query tile) it walks the
/// key tiles with a running row max and row sum (online softmax, Milakov & Gimelshein 2018), skips tiles above
/// the causal diagonal and masks the diagonal ones; no [L, L] tensor exists. Parallel over (sample, head, query
/// tile range) with at::parallel_for, long samples split so that one of them keeps every thread busy.
/// Accumulation and softmax statistics are fp32 whatever the input dtype (bf16 inputs run their products on AMX
/// tiles where the CPU has them, with probabilities rounded to bf16 as on GPUs). Throws std::invalid_argument
/// for mismatched shapes, dtypes, devices, cu_seqlens that do not run from 0 to Tq / Tk, or bad options.
AttentionResult tiled_attention_forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                        const torch::Tensor& cu_seqlens_q, const torch::Tensor& cu_seqlens_k,
                                        bool causal, const AttentionOptions& options = {});

/// Tiled backward (FlashAttention-2 Algorithm 2): recomputes each score tile from q, k, v and lse, with
/// D_i = rowsum(dout * out), and accumulates dq, dk, dv in fp32; `out` and `lse` are the forward's (or, for
/// a query block attended by several key blocks, the merged ones: then each block's call yields its exact share
/// of the gradients). dout: [Tq, heads, head_dim], dtype of q. Throws as tiled_attention_forward.
AttentionGrads tiled_attention_backward(const torch::Tensor& dout, const torch::Tensor& q, const torch::Tensor& k,
                                        const torch::Tensor& v, const torch::Tensor& out, const torch::Tensor& lse,
                                        const torch::Tensor& cu_seqlens_q, const torch::Tensor& cu_seqlens_k,
                                        bool causal, const AttentionOptions& options = {});

/// The tiled operator as a differentiable function (a custom autograd Function around the two above; the
/// backward is not itself differentiable). Returns out [Tq, heads, head_dim].
torch::Tensor tiled_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& cu_seqlens_q, const torch::Tensor& cu_seqlens_k, bool causal,
                              const AttentionOptions& options = {});

/// The reference twin: per sample, the whole [heads, Lq, Lk] score tensor, masked, softmax in fp32 (fp64 for
/// fp64), written with differentiable ATen ops (any device). Memory O(heads * Lq * Lk) for the longest sample.
/// Same conventions and errors as tiled_attention_forward; out and lse are differentiable. with_lse false skips
/// the logsumexp (its [heads, Lq, Lk] temporary) and leaves lse undefined.
AttentionResult reference_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                    const torch::Tensor& cu_seqlens_q, const torch::Tensor& cu_seqlens_k,
                                    bool causal, double scale = 0, bool with_lse = true);

/// Grouped-query attention (Ainslie et al. 2023, GQA) for the operators above, which take as many K/V heads as
/// query heads: x [T, kv_heads, head_dim] (k or v) repeated to [T, heads, head_dim], head h = K/V head
/// h / (heads / kv_heads) (Llama's repeat_kv, torch repeat_interleave: differentiable, its backward sums each
/// group's gradients). Returns x itself when kv_heads == heads. Throws std::invalid_argument when heads is not a
/// multiple of kv_heads.
torch::Tensor expand_kv_heads(const torch::Tensor& x, int64_t heads);

/// Exact attention over the union of two disjoint key sets from the two partial results of the same queries:
/// lse = logaddexp(a.lse, b.lse), out = a.out * exp(a.lse - lse) + b.out * exp(b.lse - lse) (in the dtype of
/// lse, then cast to out's dtype). A query that attends no key in one part (lse -inf) takes the other's result;
/// none in both gives out 0, lse -inf. Differentiable. Throws std::invalid_argument for mismatched shapes.
AttentionResult merge_attention(const AttentionResult& a, const AttentionResult& b);

}  // namespace dcp
