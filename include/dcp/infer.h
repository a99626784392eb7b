// Inference: attention through a KV cache, chunked prefill and token-by-token decoding, text generation.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dcp/kv_cache.h"
#include "dcp/kv_observations.h"
#include "dcp/kv_policy.h"
#include "dcp/model.h"

namespace dcp {

/// The cache a model's layers fill: layers = n_layers, kv_heads = the model's K/V heads (cfg.kv_heads(): n_heads
/// without grouped-query attention), head_dim = value_dim = d_model / n_heads, dtype =
/// compute_dtype(model->precision), the parameters' device.
KvCacheSpec kv_cache_spec(const Transformer& model);

/// Exact softmax attention of a chunk of T new tokens of `layer` over [every cached entry of each head, with its
/// log-weight bias, not causal | the chunk itself, causal], i.e. softmax(scale q.K^T + bias) V; the cache is only
/// read (KvCacheAttention appends afterwards). Heads may hold different numbers of entries. q: [T, heads,
/// head_dim], k: [T, kv_heads, head_dim], v: [T, kv_heads, value_dim] in the cache dtype, k after rotary, heads a
/// multiple of the cache's kv_heads (grouped-query attention: query head j reads KV head j / (heads / kv_heads)),
/// value_dim == head_dim; T >= 1. The cache part runs per head as fp32 (fp64 for fp64) matmuls over blocks of keys, the chunk
/// part through tiled_attention_forward (reference_attention off the CPU) with `options`, and merge_attention
/// combines the two exactly (spec section 2: attention is a ratio of sums that add over disjoint key sets).
/// Returns out [T, heads, head_dim] in q's dtype and lse [T, heads] fp32 (fp64). Throws std::invalid_argument for
/// shapes, dtypes or a layer that do not fit the cache.
AttentionResult kv_cache_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                   const KvCache& cache, int64_t layer, const AttentionOptions& options = {});

/// The plain twin of kv_cache_attention for tests: per head the whole [cache | chunk] key set concatenated, one
/// explicitly masked softmax in fp64 (bias added to the cache columns, the chunk's columns causal). scale 0 =
/// 1/sqrt(head_dim). Same arguments, results and errors.
AttentionResult reference_kv_cache_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                             const KvCache& cache, int64_t layer, double scale = 0);

/// The AttentionWrapper of one forward of a chunk through a KV cache (set as PackedBatch::attention): block
/// `layer` attends with kv_cache_attention over the cache and the chunk, then appends the chunk's k and v at
/// `positions` (so the chunk never sees itself twice). One object per forward: it carries that chunk's absolute
/// positions. Only for softmax blocks: throws std::invalid_argument naming the layer when the block's backend is
/// not SoftmaxAttention, and when the batch is not one sequence of positions.numel() tokens. Inference only: the
/// cache keeps no autograd history. With `observations` (a policy asked for them) each layer's queries are
/// recorded there after the append (KvObservations::observe); without, nothing extra runs.
class KvCacheAttention : public AttentionWrapper {
 public:
  /// positions: [T] int64 absolute positions of the chunk (those the block rotated q and k with).
  KvCacheAttention(std::shared_ptr<KvCache> cache, torch::Tensor positions,
                   std::shared_ptr<KvObservations> observations = nullptr);
  torch::Tensor forward(const AttentionBackend& inner, int64_t layer, const torch::Tensor& q, const torch::Tensor& k,
                        const torch::Tensor& v, const torch::Tensor& cu_seqlens) const override;

 private:
  std::shared_ptr<KvCache> cache_;
  torch::Tensor positions_;
  std::shared_ptr<KvObservations> observations_;
};

/// One sequence decoded through a KV cache by a softmax model: a prompt runs in chunks of `chunk_tokens` (chunk
/// t attends to the cache plus itself causally), then tokens one at a time; positions are absolute, 0 for the
/// first token of the sequence (as in training, where they restart at 0 per sample; beyond the trained
/// data.max_seq_len the model extrapolates). After every chunk and every token the policy (default
/// FullKvPolicy) may commit to the cache. Without compression the logits equal model->forward over the whole
/// sequence up to floating-point rounding (tests/unit/test_kv_cache.cpp). Runs without autograd.
class DecodeSession {
 public:
  /// Throws std::invalid_argument for chunk_tokens < 1 or a model whose blocks are not all SoftmaxAttention.
  DecodeSession(Transformer model, int64_t chunk_tokens = 512, std::shared_ptr<KvPolicy> policy = nullptr);

  /// Runs `tokens` (ids in [0, kVocabSize), at least one) after what the cache holds, in chunks; returns fp32
  /// logits [tokens.size(), kVocabSize], row i predicting the token after tokens[i].
  torch::Tensor prefill(const std::vector<int64_t>& tokens);
  /// Runs one token; returns its fp32 logits [kVocabSize].
  torch::Tensor decode(int64_t token);
  /// Empties the cache: the next token is at position 0 again.
  void reset();

  /// The cache (e.g. to save() or load() it between calls; positions continue from its next_position()).
  KvCache& cache() { return *cache_; }
  const KvCache& cache() const { return *cache_; }
  int64_t chunk_tokens() const { return chunk_tokens_; }

 private:
  torch::Tensor run(const std::vector<int64_t>& tokens, bool prefill);

  Transformer model_;
  int64_t chunk_tokens_;
  std::shared_ptr<KvPolicy> policy_;
  std::shared_ptr<KvCache> cache_;
  std::shared_ptr<KvObservations> observations_;  // null unless the policy needs() something
};

struct GenerateOptions {
  int64_t max_new_tokens = 200;
  double temperature = 1.0;   ///< 0 = greedy
  int64_t top_k = 0;          ///< 0 = no top-k filtering
  uint64_t seed = 0;
  int64_t context = 1024;     ///< tokens the model sees (the training max_seq_len)
  int64_t chunk_tokens = 512; ///< softmax models: prefill chunk of the KV cache (kv.chunk_tokens)
  /// softmax models: the KV cache's compression policy (null = keep everything); flexformer models have none
  std::shared_ptr<KvPolicy> kv_policy;
  /// Called with each byte as soon as it is sampled (e.g. to print it), before the next one runs; may be empty.
  std::function<void(char)> on_byte;
};

/// Samples `max_new_tokens` bytes after BOS + `prompt` and returns them (raw bytes; may be invalid UTF-8 where
/// the model emits it). The model sees the last `context` tokens (a window, positions 0.. inside it), as it was
/// trained. Softmax models decode through a KV cache (DecodeSession: the window prefilled in chunks of
/// chunk_tokens, then one token per step); flexformer models recurrently from per-layer states
/// (FlexformerDecoding). When the window slides (the sequence is longer than `context`) positions restart at 0,
/// so the cache or the states are rebuilt from the new window: the same computation as recomputing the window
/// for every token (equal logits up to rounding; tests compare greedy outputs token for token), cheap per token
/// until the window is full and a full window's prefill per token after that. Throws std::invalid_argument for a
/// negative max_new_tokens or temperature, a negative top_k, context < 1 or chunk_tokens < 1, and for a
/// temperature so small that logits / temperature overflow; std::runtime_error when the model's logits are not
/// finite (NaN or inf weights).
std::string generate(Transformer& model, const std::string& prompt, const GenerateOptions& opt);

}  // namespace dcp
