// SoftmaxAttention: the exact backend a block calls, over the tiled operator or its reference twin
// (include/dcp/attention_backend.h).
#include "dcp/attention_backend.h"

namespace dcp {

SoftmaxAttention::SoftmaxAttention(Impl impl, AttentionOptions options) : impl_(impl), options_(options) {}

torch::Tensor SoftmaxAttention::forward(const torch::Tensor& q, const torch::Tensor& k_in, const torch::Tensor& v_in,
                                        const torch::Tensor& cu_seqlens) const {
  // Grouped-query attention: each K/V head serves its group of query heads (a transient copy per group member;
  // the operators index one K/V head per query head).
  const torch::Tensor k = expand_kv_heads(k_in, q.size(1)), v = expand_kv_heads(v_in, q.size(1));
  if (impl_ == Impl::tiled) return tiled_attention(q, k, v, cu_seqlens, cu_seqlens, /*causal=*/true, options_);
  return reference_attention(q, k, v, cu_seqlens, cu_seqlens, /*causal=*/true, 0, /*with_lse=*/false).out;
}

}  // namespace dcp
