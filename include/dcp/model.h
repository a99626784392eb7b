// Decoder-only byte-level transformer over packed variable-length micro-batches.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <vector>

#include "dcp/attention_backend.h"
#include "dcp/config.h"
#include "dcp/data.h"
#include "dcp/precision.h"
#include "dcp/sp_layout.h"

namespace dcp {

/// Several samples packed as one flat token stream; sample i occupies [cu_seqlens[i], cu_seqlens[i+1]).
/// Under sequence parallelism a rank holds the pieces SpLayout::shard gives it (one contiguous shard under
/// Ulysses, two zigzag chunks under a ring): T_local = T_padded / sp_size tokens, while cu_seqlens still
/// describes the whole padded stream (padding is one extra segment at the end, fewer than
/// SpLayout::pad_multiple() tokens, with target -100 so it never reaches the loss).
struct PackedBatch {
  torch::Tensor tokens;      ///< [T_local] int64 input token ids
  torch::Tensor targets;     ///< [T_local] int64 next-token targets; -100 = padding, ignored by the loss
  torch::Tensor positions;   ///< [T_local] int64 position inside its sample (restarts at 0 for every sample)
  torch::Tensor cu_seqlens;  ///< [segments + 1] int64 cumulative lengths of the whole stream, cu_seqlens[0] = 0
  std::vector<int64_t> sample_ids;
  /// Wraps every block's own attention backend for this batch: a sequence-parallel shard carries the wrapper
  /// that exchanges q, k, v across its group, decoding one that carries recurrent states. Null: each block
  /// calls its backend directly.
  std::shared_ptr<const AttentionWrapper> attention;
  int64_t num_tokens() const { return tokens.numel(); }
};

/// Packs the given samples in order (CPU tensors). Throws std::invalid_argument for an empty id list and
/// std::out_of_range for an id outside corpus.samples().
PackedBatch make_batch(const Corpus& corpus, const std::vector<int64_t>& sample_ids);

/// Member `sp_rank`'s tokens of the packed stream of `sample_ids` under `layout`: the stream is padded to a
/// multiple of layout.pad_multiple(), the rank's pieces (SpLayout::shard) follow each other in its tokens, and
/// it reads only those from the corpus; make_batch is make_shard(..., 0, 1). Throws std::invalid_argument for
/// empty ids or sp_rank outside [0, sp_size), std::out_of_range for an unknown id.
PackedBatch make_shard(const Corpus& corpus, const std::vector<int64_t>& sample_ids, int64_t sp_rank,
                       const SpLayout& layout);
/// The Ulysses layout: make_shard(corpus, sample_ids, sp_rank, SpLayout{sp_size, sp_size}), one contiguous shard.
PackedBatch make_shard(const Corpus& corpus, const std::vector<int64_t>& sample_ids, int64_t sp_rank,
                       int64_t sp_size);

/// Builds the backend named by `attention.backend` for one layer of `model` (a new object per call: a
/// flexformer backend has its own parameters). Throws ConfigError for an unknown name or a bad attention.*
/// value, std::invalid_argument when d_model is not divisible by n_heads.
std::shared_ptr<AttentionBackend> make_attention_backend(const AttentionConfig& cfg, const ModelConfig& model);

/// Runs `fn(x)` without keeping its activations and recomputes it during backward (activation checkpointing).
/// Gradients of parameters used by `fn` accumulate into their .grad as without checkpointing. `fn` must be
/// deterministic (no dropout); besides `x` and module parameters it may only read tensors that do not require
/// grad. `fn` is kept until backward, so it must own (capture by value) everything it reads. Like PyTorch's
/// reentrant checkpoint, parameter grads reach .grad only through backward(), not through autograd::grad().
/// Runs `fn(x)` plainly when grad mode is off or `x` does not require grad. x: any shape.
torch::Tensor recompute(const std::function<torch::Tensor(const torch::Tensor&)>& fn, const torch::Tensor& x);

/// The torch dtype of a precision's matmuls and activations: kBFloat16 or kFloat.
torch::ScalarType compute_dtype(Precision precision);

/// Root-mean-square layer norm (Zhang & Sennrich 2019) with a learned gain: fused_rms_norm (dcp/fused_ops.h).
struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(int64_t dim, double eps = 1e-6);
  /// [..., dim] -> [..., dim] in x's dtype; the statistics and the gain are applied in fp32, then one cast.
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;
  double eps;
};
TORCH_MODULE(RMSNorm);

/// Pre-norm block: x + Attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)) (Shazeer 2020), rotary positions
/// (Su et al. 2021, RoFormer) on q and k; grouped-query attention (Ainslie et al. 2023, GQA) when n_kv_heads <
/// n_heads: k and v have n_kv_heads heads, query head h reads K/V head h / (n_heads / n_kv_heads).
struct BlockImpl : torch::nn::Module {
  /// Throws std::invalid_argument unless d_model is divisible by n_heads and n_heads by cfg.kv_heads(), or when
  /// `attention` is null. wqkv's output is [q | k | v]: d_model rows, then kv_heads x head_dim rows twice.
  /// A backend that is a torch::nn::Module becomes submodule "attention".
  BlockImpl(const ModelConfig& cfg, std::shared_ptr<AttentionBackend> attention);
  /// x: [T, d_model] fp32 or bf16; positions: [T] int64; cu_seqlens: [n+1] int64. Returns [T, d_model] in x's
  /// dtype. The block computes in x's dtype: each fp32 weight is cast to it for its matmul (the cast's backward
  /// gives the fp32 parameter an fp32 gradient), q, k, v reach the backend in it; the norms' statistics and the
  /// rotary angles stay fp32.
  /// `wrapper` null: the block's backend is called directly; else wrapper->forward(*attention, layer, ...).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& cu_seqlens,
                        const AttentionWrapper* wrapper = nullptr, int64_t layer = 0);

  int64_t n_heads, n_kv_heads, head_dim;
  double rope_theta;
  RMSNorm attn_norm{nullptr}, mlp_norm{nullptr};
  torch::nn::Linear wqkv{nullptr}, wo{nullptr}, w_gate{nullptr}, w_up{nullptr}, w_down{nullptr};
  std::shared_ptr<AttentionBackend> attention;  ///< this block's own backend
};
TORCH_MODULE(Block);

/// Byte embeddings -> n_layers Blocks -> RMSNorm -> linear head over kVocabSize. Every block gets its own
/// attention backend from make_attention_backend(attn, cfg). Parameters are fp32 whatever the precision.
struct TransformerImpl : torch::nn::Module {
  explicit TransformerImpl(const ModelConfig& cfg, const AttentionConfig& attn = {},
                           Precision precision = Precision::kFp32);

  /// Returns fp32 logits [T, kVocabSize]. With Precision::kBf16 the embedding output is cast to bf16 once, the
  /// blocks, the final norm and the head matmul run in bf16 and the logits are cast back to fp32. The first
  /// `recompute_layers` blocks recompute their activations in backward instead of keeping them. Throws
  /// std::invalid_argument if recompute_layers is outside [0, n_layers]. tokens and positions are moved to the
  /// parameters' device; cu_seqlens is read on the host.
  torch::Tensor forward(const PackedBatch& batch, int64_t recompute_layers = 0);
  /// forward() without the final cast: logits [T, kVocabSize] in the compute dtype (bf16 under kBf16).
  torch::Tensor logits_in_compute_dtype(const PackedBatch& batch, int64_t recompute_layers = 0);

  /// Sum over all tokens of the next-token cross-entropy (nats, computed in fp32 by fused_cross_entropy on the
  /// compute-dtype logits; targets -100 are ignored), as an fp32 scalar; callers divide by the global number of
  /// target tokens.
  torch::Tensor loss_sum(const PackedBatch& batch, int64_t recompute_layers = 0);

  ModelConfig cfg;
  /// The dtype of matmuls and activations (docs/config.md "Precision"); may be changed between forwards.
  Precision precision;
  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  RMSNorm final_norm{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Transformer);

/// Applies rotary position embeddings: x [T, heads, head_dim], positions [T] int64 -> same shape and dtype.
/// Dimension i is rotated with i + head_dim/2 by angle position * theta^(-2i/head_dim), computed in fp32
/// (fused_rotary, dcp/fused_ops.h). Throws std::invalid_argument for an odd head_dim.
torch::Tensor apply_rotary(const torch::Tensor& x, const torch::Tensor& positions, double theta);

}  // namespace dcp
