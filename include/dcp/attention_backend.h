// The attention interfaces a transformer block calls: an AttentionBackend attends over a packed stream (causal
// inside each sample, nothing across samples), an AttentionWrapper calls a block's backend for one batch
// (sequence parallelism exchanges q, k, v around it, decoding carries caches or states), and SoftmaxAttention is
// the exact backend over the kernels of dcp/attention_kernels.h. The model builds blocks on them (dcp/model.h);
// dist's Ulysses and ring attention and infer's KV-cache attention implement AttentionWrapper.
#pragma once

#include <torch/types.h>

#include <cstdint>

#include "dcp/attention_kernels.h"

namespace dcp {

/// Attention over a packed stream: causal inside each sample, nothing across samples. Each block owns one; a
/// backend with parameters is also a torch::nn::Module and is registered as the block's "attention" submodule.
class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  /// q: [T, heads, head_dim], k, v: [T, kv_heads, head_dim] (rotary already applied) holding all heads of the
  /// layer, kv_heads dividing heads (grouped-query attention: query head h reads K/V head h / (heads /
  /// kv_heads); a backend without GQA support receives kv_heads == heads, the config refuses otherwise);
  /// cu_seqlens: [n + 1] int64. Returns [T, heads, head_dim].
  virtual torch::Tensor forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                const torch::Tensor& cu_seqlens) const = 0;
  /// The same on heads [head_offset, head_offset + heads) of the layer only: under Ulysses sequence
  /// parallelism a rank attends over a slice of the heads, and a backend with per-head parameters must
  /// override this to use that slice's. The default, for backends without them, is forward().
  virtual torch::Tensor forward_heads(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                      const torch::Tensor& cu_seqlens, int64_t /*head_offset*/) const {
    return forward(q, k, v, cu_seqlens);
  }
};

/// How blocks call their own backend for one batch (PackedBatch::attention): sequence parallelism exchanges
/// q, k, v across ranks around it, decoding carries per-layer states.
class AttentionWrapper {
 public:
  virtual ~AttentionWrapper() = default;
  /// Attention of block `layer`, whose backend is `inner`; shapes as AttentionBackend::forward.
  virtual torch::Tensor forward(const AttentionBackend& inner, int64_t layer, const torch::Tensor& q,
                                const torch::Tensor& k, const torch::Tensor& v,
                                const torch::Tensor& cu_seqlens) const = 0;
};

/// Exact causal softmax attention (scores scaled by 1/sqrt(head_dim)), by one of two implementations of the same
/// operator (include/dcp/attention_kernels.h): `tiled`, the FlashAttention-2 style operator (memory linear in the
/// sample length, CPU tensors only), or `reference`, per sample the whole [heads, L, L] score tensor (any
/// device). fp32, fp64 and bf16 inputs; softmax statistics in fp32 (fp64). K/V with fewer heads than q (GQA)
/// are expanded per group first (expand_kv_heads). Throws std::invalid_argument unless cu_seqlens runs from 0 to
/// T, and for `tiled` on a non-CPU tensor.
class SoftmaxAttention : public AttentionBackend {
 public:
  enum class Impl { tiled, reference };
  explicit SoftmaxAttention(Impl impl = Impl::tiled, AttentionOptions options = {});
  torch::Tensor forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& cu_seqlens) const override;
  Impl impl() const { return impl_; }
  /// The operator's options (score scale, tiles); a KV-cache decoder attends with the same ones.
  const AttentionOptions& options() const { return options_; }

 private:
  Impl impl_;
  AttentionOptions options_;
};

}  // namespace dcp
