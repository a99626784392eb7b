// Inference: attention through a KV cache, chunked prefill and token-by-token decoding, text generation.
#pragma once

#include <ATen/core/Generator.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dcp/kv_cache.h"
#include "dcp/kv_observations.h"
#include "dcp/kv_policy.h"
#include "dcp/linear_attention.h"
#include "dcp/model.h"

namespace dcp {

/// The cache a model's layers fill: layers = n_layers, kv_heads = the model's K/V heads (cfg.kv_heads(): n_heads
/// without grouped-query attention), head_dim = value_dim = d_model / n_heads, dtype =
/// compute_dtype(model->precision), the parameters' device.
KvCacheSpec kv_cache_spec(const Transformer& model);

/// Exact softmax attention of a chunk of T new tokens of `layer` over [every cached entry of each head, with its
/// log-weight bias, not causal | the chunk itself, causal], i.e. softmax(scale q.K^T + bias) V; the cache is only
/// read. It is the twin of kv_chunk_decode_attention and what kv_chunk_attention_append runs off the CPU and, on
/// the CPU, over an empty layer (and for chunks of more than 64 tokens where the decode kernel is portable only). Heads may hold different numbers of entries. q: [T, heads,
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

/// Which loops the decode kernel (kv_decode_attention) runs. All compute the same three passes in fp32 (scores,
/// exp and sum, weighted values); their sums are ordered differently, so they agree to fp32 rounding, not bit for
/// bit (tests/unit/test_serve_batching.cpp forces each and compares it with the fp64 reference).
enum class DecodeAttentionPath {
  kAuto,        ///< kAvx512Bf16 for bf16 caches where the CPU has AVX512-BF16, kAvx512 for fp32 and bf16 caches
                ///< where it has AVX-512 (F, BW, VL), else kPortable
  kPortable,    ///< plain C++ loops (any CPU; fp64 caches always)
  kAvx512,      ///< 16 key rows at a time in 16-lane fp32 FMAs, one transposing lane reduction per 16 rows, a
                ///< vectorised exp (fp32 and bf16 caches)
  kAvx512Bf16,  ///< kAvx512 with the scores by vdpbf16ps from the bf16 query and keys (bf16 caches)
};
/// "auto", "portable", "avx512", "avx512-bf16".
const char* to_string(DecodeAttentionPath path);
/// The path `requested` resolves to for a cache of `dtype` on this CPU. Throws std::invalid_argument naming the
/// path, the dtype and what is missing when a forced path cannot run (kAvx512 on fp64, or on a CPU without AVX-512;
/// kAvx512Bf16 on other than bf16, or on a CPU without AVX512-BF16).
DecodeAttentionPath resolve_decode_attention_path(torch::ScalarType dtype, DecodeAttentionPath requested);

/// The decode step's attention for N sequences at once (continuous batching): for sequence i and head h, the one
/// new token's softmax(scale q.K^T + bias) V over [every entry of caches[i]'s (layer, h), with its log-weight
/// bias | the token's own k and v], i.e. kv_cache_attention for T = 1, computed per (sequence, head) in one
/// parallel loop over raw rows (no tensor per head) in fp32 (fp64 for fp64), in an order that does not depend
/// on the other sequences: a sequence's output is the same bits alone or among others. The caches are only read.
/// q: [N, heads, head_dim], k: [N, kv_heads, head_dim], v: [N, kv_heads, value_dim], CPU, the caches' dtype;
/// caches: N caches of one spec on the CPU; heads a multiple of kv_heads (grouped-query attention: query head h
/// reads KV head h / (heads / kv_heads)). scale 0 = 1/sqrt(head_dim). Returns out [N, heads,
/// value_dim] in q's dtype. `threads`: the OpenMP threads the pairs are spread over, each pair to whichever thread is
/// free (0 = at::get_num_threads(); a call that reads less than 2^20 values, summed over query heads of
/// (cached entries + 1) x (head_dim + value_dim), runs on the calling thread, where waking threads costs about what they
/// save). `path` chooses the loops (DecodeAttentionPath; every path of one call gives a sequence the
/// same bits alone or among others). Throws std::invalid_argument for shapes, dtypes, devices, null or mismatched
/// caches, a layer that does not fit and a forced path that cannot run. Twin: kv_cache_attention
/// (tests/unit/test_serve_batching.cpp compares both with reference_kv_cache_attention).
torch::Tensor kv_decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  const std::vector<const KvCache*>& caches, int64_t layer, double scale = 0,
                                  DecodeAttentionPath path = DecodeAttentionPath::kAuto, int64_t threads = 0);

/// A chunk's attention by the decode kernel, for a chunk whose k and v were just appended to `cache`
/// (KvCache::append, which gives them bias 0): the chunk is the last T rows of every head of `layer`, and its token
/// t attends, as kv_decode_attention's one token, over that head's rows before the chunk (with their log-weight
/// biases), the chunk's tokens before t and its own k_t, v_t: what kv_cache_attention computes over the cache as
/// it was before the chunk plus the chunk's causal part, in the decode kernel's order of sums (fp32; fp64 for fp64
/// caches) instead of per-block matmuls and an (out, lse) merge. Each token reads its rows in place (bf16 rows are
/// not converted; on the AVX-512 paths once per query block of tokens, below), with no per-chunk conversion of the
/// whole cache, which the chunks of kv_cache_attention pay (bench/results/cpu2_202612_serve_chunk_paths.md). q [T,
/// heads, head_dim], k [T, kv_heads, head_dim], v [T, kv_heads, value_dim] as kv_decode_attention's (T tokens of
/// one sequence in place of N sequences); returns [T, heads, value_dim] in q's dtype. Throws std::invalid_argument
/// as kv_decode_attention does, and naming the layer and head when a head holds fewer than T rows. Twin:
/// reference_kv_cache_attention over the cache before the append (tests/unit/test_serve_batching.cpp).
/// On the AVX-512 paths the tokens go `query_block` at a time (1..16; 0 = kChunkQueryBlock) through each head: each
/// block of key and value rows is read from memory once for the block's tokens instead of once per token; every
/// token's sums keep one token's order, so the result is the same bits for every query_block (and thread count).
/// The portable loops take one token at a time whatever query_block says. Throws std::invalid_argument for
/// query_block outside [0, 16].
torch::Tensor kv_chunk_decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                        const KvCache& cache, int64_t layer, double scale = 0,
                                        DecodeAttentionPath path = DecodeAttentionPath::kAuto, int64_t threads = 0,
                                        int64_t query_block = 0);

/// kv_chunk_decode_attention's tokens per block by default (measured: bench/chunk_attention.cpp --query-blocks).
constexpr int64_t kChunkQueryBlock = 16;

/// A chunk of T >= 1 tokens of one sequence through its cache, as a forward's layer does it: the chunk's attention
/// over `cache` as it was before the chunk plus its causal part, and the chunk appended at `positions` ([T] int64,
/// KvCache::append). On the CPU, unless the layer's cache is empty, the chunk is appended first and attends by
/// kv_chunk_decode_attention (on `threads`, 0 = at::get_num_threads(); measured faster than kv_cache_attention at
/// 29 of 30 points from 32 to 512 tokens over 1-8K entries on the AVX-512 paths, bench/chunk_attention.cpp; where
/// the kernel is portable only, chunks of at most 64 tokens); else (an empty layer: the tiled kernel alone, the
/// model's own forward bitwise; off the CPU) by kv_cache_attention, then appended. Throws std::invalid_argument for
/// threads < 0 before anything is appended. KvCacheAttention and DecodeSession::step_batch both call it, so a session's
/// chunk gives the same bits alone and in a batch. Returns out [T, heads, value_dim] in q's dtype. Throws as the
/// functions it calls.
torch::Tensor kv_chunk_attention_append(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                        KvCache& cache, int64_t layer, const torch::Tensor& positions,
                                        const AttentionOptions& options, int64_t threads = 0);

/// The AttentionWrapper of one forward of a chunk through a KV cache (set as PackedBatch::attention): block
/// `layer` attends over the cache and the chunk and appends the chunk's k and v at `positions`: on the CPU a chunk
/// of one token attends with kv_decode_attention and is appended after, longer ones go through
/// kv_chunk_attention_append (on the CPU over a non-empty layer append then kv_chunk_decode_attention, else
/// kv_cache_attention then append; either way the chunk is seen once). One object per forward: it carries that chunk's absolute
/// positions. Only for softmax blocks: throws std::invalid_argument naming the layer when the block's backend is
/// not SoftmaxAttention, and when the batch is not one sequence of positions.numel() tokens. Inference only: the
/// cache keeps no autograd history. With `observations` (a policy asked for them) each layer's queries are
/// recorded there after the append (KvObservations::observe); without, nothing extra runs. With `compress` (a
/// policy whose compresses_by_layer() is true) each layer is compressed right after that, by
/// compress->after_layer(cache, layer, step): `step` is this chunk's KvStep (the caller then skips after_step).
class KvCacheAttention : public AttentionWrapper {
 public:
  /// positions: [T] int64 absolute positions of the chunk (those the block rotated q and k with).
  KvCacheAttention(std::shared_ptr<KvCache> cache, torch::Tensor positions,
                   std::shared_ptr<KvObservations> observations = nullptr, KvPolicy* compress = nullptr,
                   KvStep step = {});
  torch::Tensor forward(const AttentionBackend& inner, int64_t layer, const torch::Tensor& q, const torch::Tensor& k,
                        const torch::Tensor& v, const torch::Tensor& cu_seqlens) const override;

 private:
  std::shared_ptr<KvCache> cache_;
  torch::Tensor positions_;
  std::shared_ptr<KvObservations> observations_;
  KvPolicy* compress_;  // null: the caller runs after_step after the forward
  KvStep step_;
};

/// The length of the next prefill chunk of a sequence that has run `seen` tokens (the cache's next_position()) and
/// has `remaining` (>= 1) prompt tokens left: min(remaining, chunk_tokens), and with chunk_pairs > 0 also at most
/// the largest c with c (seen + c) <= chunk_pairs, the (query, key) pairs of the chunk's attention when no entry
/// was evicted (an upper bound under compression), and at least 1. The attention-aware form of Sarathi-Serve's
/// token budget (Agrawal et al. 2024): chunks shrink as the context grows, so each costs about the same.
/// Throws std::invalid_argument for seen < 0, remaining < 1, chunk_tokens < 1 or chunk_pairs < 0.
int64_t prefill_chunk_length(int64_t seen, int64_t remaining, int64_t chunk_tokens, int64_t chunk_pairs);

/// One sequence decoded through a KV cache by a softmax model: a prompt runs in chunks of `chunk_tokens` (chunk
/// t attends to the cache plus itself causally), then tokens one at a time; positions are absolute, 0 for the
/// first token of the sequence (as in training, where they restart at 0 per sample; beyond the trained
/// data.max_seq_len the model extrapolates). After every chunk and every token the policy (default
/// FullKvPolicy) may commit to the cache: layer by layer inside the forward when its compresses_by_layer() (each
/// layer right after it appended the chunk; the same edits as after_step after the forward, with a lower peak),
/// else after_step after the forward. Without compression the logits equal model->forward over the whole
/// sequence up to floating-point rounding (tests/unit/test_kv_cache.cpp). Runs without autograd.
class DecodeSession {
 public:
  /// chunk_pairs > 0 bounds each chunk's attention too (prefill_chunk_length). Throws std::invalid_argument for
  /// chunk_tokens < 1, chunk_pairs < 0 or a model whose blocks are not all SoftmaxAttention.
  DecodeSession(Transformer model, int64_t chunk_tokens = 512, std::shared_ptr<KvPolicy> policy = nullptr,
                int64_t chunk_pairs = 0);

  /// Runs `tokens` (ids in [0, kVocabSize), at least one) after what the cache holds, in chunks; returns fp32
  /// logits [tokens.size(), kVocabSize], row i predicting the token after tokens[i].
  torch::Tensor prefill(const std::vector<int64_t>& tokens);
  /// Runs one token; returns its fp32 logits [kVocabSize].
  torch::Tensor decode(int64_t token);
  /// Empties the cache: the next token is at position 0 again.
  void reset();

  /// One step of several sessions of one model in a single forward (continuous batching, Yu et al. 2022,
  /// "Orca"; chunked prefill beside decoding as in Agrawal et al. 2024, "Sarathi-Serve"): session i runs
  /// tokens[i] after what its cache holds, as sessions[i]->prefill(tokens[i]) (prefill[i] true) or ->decode
  /// (one token, prefill[i] false) would, with 1 <= tokens[i].size() <= its chunk_tokens(). The tokens of all
  /// sessions form one packed batch: each linear layer is one matmul over all of them; attention runs per session
  /// over its own cache (the one-token steps of a layer together through kv_decode_attention, each longer chunk
  /// through kv_chunk_attention_append), then each session's policy runs after_step. Returns per session its fp32 logits
  /// [tokens[i].size(), kVocabSize]. A session's logits equal its solo step's up to the rounding of the matmuls,
  /// whose rows BLAS may sum in another order for another number of rows (tests/unit/test_serve_batching.cpp
  /// measures it). Throws std::invalid_argument for sessions of different models, a session given twice, sizes
  /// that differ, empty or too many tokens, a token outside the vocabulary. `attention_threads`: the threads of the
  /// decode kernel (kv_decode_attention's `threads`; 0 = at::get_num_threads()), which a server may give more threads
  /// than the rest of the step's operations.
  static std::vector<torch::Tensor> step_batch(const std::vector<DecodeSession*>& sessions,
                                               const std::vector<std::vector<int64_t>>& tokens,
                                               const std::vector<bool>& prefill, int64_t attention_threads = 0);

  /// The cache (e.g. to save() or load() it between calls; positions continue from its next_position()).
  KvCache& cache() { return *cache_; }
  const KvCache& cache() const { return *cache_; }
  int64_t chunk_tokens() const { return chunk_tokens_; }
  int64_t chunk_pairs() const { return chunk_pairs_; }
  /// The length of this session's next prefill chunk when `remaining` prompt tokens are left (prefill_chunk_length
  /// after the cache's next_position()).
  int64_t next_chunk_length(int64_t remaining) const;
  /// The session's compression policy (FullKvPolicy when none was given).
  const KvPolicy& policy() const { return *policy_; }

 private:
  torch::Tensor run(const std::vector<int64_t>& tokens, bool prefill);

  Transformer model_;
  int64_t chunk_tokens_;
  int64_t chunk_pairs_;
  std::shared_ptr<KvPolicy> policy_;
  std::shared_ptr<KvCache> cache_;
  std::shared_ptr<KvObservations> observations_;  // null unless the policy needs() something
};

/// One sequence decoded recurrently by a flexformer model: linear attention as a recurrent network (Katharopoulos
/// et al. 2020, "Transformers are RNNs"), each layer carrying its state, S = sum phi(k) v^T and z = sum phi(k) per
/// head (LinearAttentionState of one sequence: s [1, heads, F, Dv], z [1, heads, F], fp32 (fp64 for an fp64 model)),
/// so a session holds the same bytes after 10 tokens as after 10,000 and needs no KV cache and no cache policy.
/// A prompt runs in chunks of `chunk_tokens` (each continuing from the states the previous one left), then tokens
/// one at a time; positions are absolute from 0, as in DecodeSession. Every step runs FlexformerDecoding: with
/// attention.linear_impl fused the fused kernel (prefill chunks and one-token steps alike), with reference the
/// chunked form for a chunk and the recurrent form for one token. The logits equal model->forward over the whole
/// sequence up to floating-point rounding (tests/unit/test_recurrent_session.cpp). Runs without autograd.
class RecurrentSession {
 public:
  /// Throws std::invalid_argument for chunk_tokens < 1 or a model whose blocks are not all FlexformerAttention.
  explicit RecurrentSession(Transformer model, int64_t chunk_tokens = 512);

  /// Runs `tokens` (ids in [0, kVocabSize), at least one) after what the states cover, in chunks; returns fp32
  /// logits [tokens.size(), kVocabSize], row i predicting the token after tokens[i]. Each chunk is one step_batch
  /// (a chunk that throws leaves the states as the chunks before it left them; reset() starts over).
  torch::Tensor prefill(const std::vector<int64_t>& tokens);
  /// Runs one token; returns its fp32 logits [kVocabSize].
  torch::Tensor decode(int64_t token);
  /// Drops the states: the next token is at position 0 again.
  void reset();

  /// One step of several sessions of one model in a single forward (continuous batching, as
  /// DecodeSession::step_batch): session i runs tokens[i] (1 to its chunk_tokens() tokens) after what its states
  /// cover. The tokens of all sessions form one packed batch: each linear layer is one matmul over all of them;
  /// each layer's attention is one call of the kernel over every session's segment, from the sessions' states
  /// stacked ([n_sessions, heads, F, Dv]; zeros for a session's first step), which are split back afterwards.
  /// Returns per session its fp32 logits [tokens[i].size(), kVocabSize], equal to its solo step's up to the
  /// rounding of the matmuls and of the kernel's split of the work (tests/unit/test_recurrent_session.cpp measures
  /// it). While it runs, the states are held up to about four times over (the stack, the kernel's copy, the final
  /// stack, the sessions' new rows). Throws std::invalid_argument for sessions of different models, a null session
  /// or one given twice, sizes that differ, empty or too many tokens, a token outside the vocabulary; a step that
  /// throws (also from the forward) leaves every session as it was.
  static std::vector<torch::Tensor> step_batch(const std::vector<RecurrentSession*>& sessions,
                                               const std::vector<std::vector<int64_t>>& tokens);

  /// Bytes the states hold now (0 before the first token; then the same after every step).
  int64_t state_bytes() const;
  /// Tokens run since the last reset (the next token's position).
  int64_t next_position() const { return position_; }
  int64_t chunk_tokens() const { return chunk_tokens_; }
  /// The length of the next prefill chunk when `remaining` (>= 1) prompt tokens are left: min(remaining,
  /// chunk_tokens). Throws std::invalid_argument for remaining < 1.
  int64_t next_chunk_length(int64_t remaining) const;

 private:
  Transformer model_;
  int64_t chunk_tokens_;
  int64_t position_ = 0;
  std::vector<LinearAttentionState> states_;  // per layer; undefined before the first token
};

/// True when every block of `model` uses flexformer attention (it decodes with RecurrentSession), false when every
/// block is softmax (DecodeSession). Throws std::invalid_argument for a model without layers or one that mixes them.
bool decodes_recurrently(const Transformer& model);

/// How a byte is drawn from a model's logits (generate, dcp serve).
struct SamplingOptions {
  double temperature = 1.0;  ///< 0 = greedy (argmax)
  int64_t top_k = 0;         ///< keep the k most likely bytes; 0 = all
  /// Nucleus sampling (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration"): keep the most
  /// likely bytes, in order, until their probability reaches top_p (at least one); 1 = all.
  double top_p = 1.0;
};

/// The byte sampler of generate and dcp serve, one per sequence: its seeded CPU generator
/// (at::CPUGeneratorImpl) advances by one draw per sampled byte, so equal seeds, options and logits give equal
/// bytes. next(): logits [>= 256] (the model's row; only the 256 byte entries count) to fp64; temperature 0 is
/// argmax (the first largest, read in place from fp32 logits); else logits / temperature, then top_k, then top_p (each skipped at its "all" value), then one
/// multinomial draw from the softmax. Throws std::invalid_argument for options out of range (temperature < 0,
/// top_k < 0, top_p outside (0, 1]) and for a temperature so small that logits / temperature overflow;
/// std::runtime_error when the logits are not finite (`index`, the byte's index, is named).
class ByteSampler {
 public:
  explicit ByteSampler(uint64_t seed);
  int64_t next(const torch::Tensor& logits, const SamplingOptions& options, int64_t index);
  /// The same from `size` (>= 256) contiguous fp32 logits: greedy reads them in place (no tensor op: the batched
  /// decode step samples every session this way), other options wrap them in a tensor. Throws as next() and
  /// std::invalid_argument for size < 256.
  int64_t next(const float* logits, int64_t size, const SamplingOptions& options, int64_t index);

 private:
  at::Generator generator_;
};

struct GenerateOptions {
  int64_t max_new_tokens = 200;
  double temperature = 1.0;   ///< 0 = greedy
  int64_t top_k = 0;          ///< 0 = no top-k filtering
  double top_p = 1.0;         ///< 1 = no nucleus filtering (SamplingOptions::top_p)
  uint64_t seed = 0;
  int64_t context = 1024;     ///< tokens the model sees (the training max_seq_len)
  int64_t chunk_tokens = 512; ///< prefill chunk (kv.chunk_tokens): of the KV cache, or of the recurrent states
  int64_t chunk_pairs = 0;    ///< softmax models: attention bound of a prefill chunk (kv.chunk_pairs; 0 = none)
  /// softmax models: the KV cache's compression policy (null = keep everything); flexformer models have none
  std::shared_ptr<KvPolicy> kv_policy;
  /// Called with each byte as soon as it is sampled (e.g. to print it), before the next one runs; may be empty.
  std::function<void(char)> on_byte;
};

/// Samples `max_new_tokens` bytes after BOS + `prompt` and returns them (raw bytes; may be invalid UTF-8 where
/// the model emits it). The model sees the last `context` tokens (a window, positions 0.. inside it), as it was
/// trained. Softmax models decode through a KV cache (DecodeSession: the window prefilled in chunks of
/// chunk_tokens, then one token per step); flexformer models recurrently from per-layer states
/// (RecurrentSession: the window in chunks of chunk_tokens, then one token per step). When the window slides (the sequence is longer than `context`) positions restart at 0,
/// so the cache or the states are rebuilt from the new window: the same computation as recomputing the window
/// for every token (equal logits up to rounding; tests compare greedy outputs token for token), cheap per token
/// until the window is full and a full window's prefill per token after that. Bytes are drawn by a ByteSampler
/// seeded with `seed`. Throws std::invalid_argument for a negative max_new_tokens or temperature, a negative
/// top_k, top_p outside (0, 1], context < 1, chunk_tokens < 1 or chunk_pairs < 0, and for a
/// temperature so small that logits / temperature overflow; std::runtime_error when the model's logits are not
/// finite (NaN or inf weights).
std::string generate(Transformer& model, const std::string& prompt, const GenerateOptions& opt);

}  // namespace dcp
