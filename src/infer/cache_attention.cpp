// Attention of a chunk over a KV cache plus itself: the cache part per head (heads differ in length and carry
// log-weight biases), the chunk part by the causal tiled operator, combined exactly in the (out, lse) form.
#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <stdexcept>

#include "dcp/infer.h"

namespace dcp {
namespace {

// Where the decode kernel has only its portable loops, chunks of at most this many tokens attend by it (the
// threshold every chunk had before 2026-12-07, not re-measured for those loops).
constexpr int64_t kPortableDecodeChunkTokens = 64;

// Keys per block of the cache part: bounds its [T, block] score temporaries (8 MiB for a 512-token chunk in
// fp32) whatever the cache length.
constexpr int64_t kKeyBlock = 4096;

void check_chunk(const char* who, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                 const KvCache& cache, int64_t layer) {
  const KvCacheSpec& s = cache.spec();
  if (layer < 0 || layer >= s.layers) {
    throw std::invalid_argument(fmt::format("{}: layer {} outside [0, {})", who, layer, s.layers));
  }
  auto shape = [](const torch::Tensor& t) { return t.defined() ? c10::str(t.sizes()) : std::string("undefined"); };
  if (!q.defined() || q.dim() != 3 || q.size(0) < 1 || q.size(1) < s.kv_heads || q.size(1) % s.kv_heads != 0 ||
      q.size(2) != s.head_dim || !k.defined() || k.dim() != 3 || k.size(0) != q.size(0) || k.size(1) != s.kv_heads ||
      k.size(2) != s.head_dim || !v.defined() || v.dim() != 3 || v.size(0) != q.size(0) ||
      v.size(1) != s.kv_heads || v.size(2) != s.value_dim) {
    throw std::invalid_argument(fmt::format(
        "{}: layer {}: q must be [T >= 1, a multiple of {}, {}], k [T, {}, {}] and v [T, {}, {}] (the cache's heads "
        "and dims), got q {}, k {}, v {}",
        who, layer, s.kv_heads, s.head_dim, s.kv_heads, s.head_dim, s.kv_heads, s.value_dim, shape(q), shape(k),
        shape(v)));
  }
  if (s.value_dim != s.head_dim) {
    throw std::invalid_argument(fmt::format("{}: value_dim {} != head_dim {} is not supported by the chunk operator",
                                            who, s.value_dim, s.head_dim));
  }
  for (const auto* t : {&q, &k, &v}) {
    if (t->scalar_type() != s.dtype) {
      throw std::invalid_argument(fmt::format("{}: layer {}: q, k, v must be {} (the cache dtype), got {}", who, layer,
                                              c10::toString(s.dtype), c10::toString(t->scalar_type())));
    }
  }
}

torch::ScalarType stat_dtype(torch::ScalarType t) { return t == torch::kDouble ? torch::kDouble : torch::kFloat; }

torch::Tensor one_sequence(int64_t tokens) { return torch::tensor({int64_t{0}, tokens}, torch::kInt64); }

}  // namespace

KvCacheSpec kv_cache_spec(const Transformer& model) {
  KvCacheSpec s;
  s.layers = model->cfg.n_layers;
  s.kv_heads = model->cfg.kv_heads();
  s.head_dim = model->cfg.n_heads > 0 ? model->cfg.d_model / model->cfg.n_heads : 0;
  s.value_dim = s.head_dim;
  s.dtype = compute_dtype(model->precision);
  s.device = model->embed->weight.device();
  return s;
}

AttentionResult kv_cache_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                   const KvCache& cache, int64_t layer, const AttentionOptions& options) {
  check_chunk("kv_cache_attention", q, k, v, cache, layer);
  torch::NoGradGuard no_grad;
  const int64_t T = q.size(0), heads = q.size(1), dv = v.size(2), kv_heads = k.size(1), g = heads / kv_heads;
  const double scale = options.scale > 0 ? options.scale : 1.0 / std::sqrt(static_cast<double>(q.size(2)));
  const torch::Tensor cu = one_sequence(T);
  const torch::Tensor ke = expand_kv_heads(k, heads), ve = expand_kv_heads(v, heads);
  AttentionResult chunk = q.is_cpu() ? tiled_attention_forward(q, ke, ve, cu, cu, /*causal=*/true, options)
                                     : reference_attention(q, ke, ve, cu, cu, /*causal=*/true, scale);
  const auto st = stat_dtype(q.scalar_type());
  const auto opt = q.options().dtype(st);
  torch::Tensor out = torch::zeros({T, heads, dv}, opt);
  torch::Tensor lse = torch::full({T, heads}, -std::numeric_limits<double>::infinity(), opt);
  bool any = false;
  for (int64_t h = 0; h < kv_heads; ++h) {
    const KvHeadView view = cache.view(layer, h);
    const int64_t n = view.length();
    if (n == 0) continue;
    any = true;
    // The group's queries of KV head h, [g x T, d] head-major (one matmul per key block for the whole group).
    const torch::Tensor qh = q.narrow(1, h * g, g).transpose(0, 1).reshape({g * T, q.size(2)}).to(st) * scale;
    AttentionResult acc;
    for (int64_t b0 = 0; b0 < n; b0 += kKeyBlock) {
      const int64_t nb = std::min(kKeyBlock, n - b0);
      // logits [T, nb] = scale q.k + log-weight: an entry of bias log w weighs like w copies of itself.
      torch::Tensor logits = torch::matmul(qh, view.keys.narrow(0, b0, nb).to(st).t()) +
                             view.bias.narrow(0, b0, nb).to(st).unsqueeze(0);
      torch::Tensor block_lse = torch::logsumexp(logits, 1);  // [T]
      torch::Tensor block_out = torch::matmul(torch::exp(logits - block_lse.unsqueeze(1)), view.values.narrow(0, b0, nb).to(st));
      AttentionResult block{block_out.unsqueeze(1), block_lse.unsqueeze(1)};
      acc = acc.out.defined() ? merge_attention(acc, block) : block;
    }
    out.narrow(1, h * g, g).copy_(acc.out.squeeze(1).view({g, T, dv}).transpose(0, 1));
    lse.narrow(1, h * g, g).copy_(acc.lse.squeeze(1).view({g, T}).t());
  }
  if (!any) return chunk;
  AttentionResult merged = merge_attention({out, lse}, chunk);
  return {merged.out.to(q.scalar_type()), merged.lse};
}

AttentionResult reference_kv_cache_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                             const KvCache& cache, int64_t layer, double scale) {
  check_chunk("reference_kv_cache_attention", q, k, v, cache, layer);
  torch::NoGradGuard no_grad;
  const int64_t T = q.size(0), heads = q.size(1), g = heads / k.size(1);
  if (scale <= 0) scale = 1.0 / std::sqrt(static_cast<double>(q.size(2)));
  std::vector<torch::Tensor> outs, lses;
  for (int64_t qh = 0; qh < heads; ++qh) {
    const int64_t h = qh / g;  // the KV head query head qh reads
    const KvHeadView view = cache.view(layer, h);
    const int64_t n = view.length();
    auto keys = torch::cat({view.keys.to(torch::kDouble), k.select(1, h).to(torch::kDouble)});
    auto values = torch::cat({view.values.to(torch::kDouble), v.select(1, h).to(torch::kDouble)});
    auto bias = torch::cat({view.bias.to(torch::kDouble), torch::zeros({T}, view.bias.options().dtype(torch::kDouble))});
    auto logits = scale * torch::matmul(q.select(1, qh).to(torch::kDouble), keys.t()) + bias.unsqueeze(0);  // [T, n+T]
    // Cache columns are visible to every query; chunk column n + j to queries i >= j.
    auto row = torch::arange(T, logits.options().dtype(torch::kInt64)).unsqueeze(1);
    auto col = torch::arange(n + T, logits.options().dtype(torch::kInt64)).unsqueeze(0);
    logits = logits.masked_fill(col - n > row, -std::numeric_limits<double>::infinity());
    auto l = torch::logsumexp(logits, 1);
    outs.push_back(torch::matmul(torch::exp(logits - l.unsqueeze(1)), values));
    lses.push_back(l);
  }
  return {torch::stack(outs, 1).to(q.scalar_type()), torch::stack(lses, 1).to(stat_dtype(q.scalar_type()))};
}

torch::Tensor kv_chunk_attention_append(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                        KvCache& cache, int64_t layer, const torch::Tensor& positions,
                                        const AttentionOptions& options, int64_t threads) {
  // Checked before anything is appended, so that a bad chunk leaves the cache as it was on either path.
  check_chunk("kv_chunk_attention_append", q, k, v, cache, layer);
  if (threads < 0) {
    throw std::invalid_argument(fmt::format("kv_chunk_attention_append: threads {} must be >= 0", threads));
  }
  const double scale = options.scale > 0 ? options.scale : 1.0 / std::sqrt(static_cast<double>(q.size(2)));
  // On the CPU every chunk is appended first, then each token attends by the decode kernel over the rows before it
  // (kv_chunk_decode_attention: on the AVX-512 paths 16 tokens of a head at a time, each key and value row read
  // once per 16 tokens, a median 2.3x faster than token by token in bench_chunk_attention,
  // bench/results/cpu2_202612_serve_chunk_blocks.md).
  // kv_cache_attention converts each head's whole cache to fp32 and repacks it for OpenBLAS at every chunk, a cost
  // that grows with the cache and not with the chunk: bench_chunk_attention (one layer, 4 heads of 32, bf16, 2
  // threads on an AMD EPYC) measured the decode-kernel path faster at 29 of 30 points from 32 to 512 tokens over
  // 1024-8192 entries in two runs (0.09-0.89x the time; 1.11x once, at 8192 x 512, where the matmul path's own time
  // moved 5x between the runs), and dcp bench-serve 1.28-1.42x the tokens/s
  // (bench/results/cpu2_202612_serve_chunk_paths.md). That was measured on the AVX-512 paths only: where the
  // decode kernel runs its portable loops (no AVX-512, fp64 caches) chunks of more than kPortableDecodeChunkTokens
  // keep kv_cache_attention, as every chunk that long did before. A chunk over an empty layer (a prompt's first
  // chunk) has no cache part: kv_cache_attention is then the tiled kernel alone, the model's own forward bit for
  // bit. Off the CPU, kv_cache_attention (its matmuls), then append.
  bool empty = true;
  for (int64_t h = 0; h < cache.spec().kv_heads && empty; ++h) empty = cache.length(layer, h) == 0;
  const DecodeAttentionPath path = resolve_decode_attention_path(cache.spec().dtype, DecodeAttentionPath::kAuto);
  const bool simd = path != DecodeAttentionPath::kPortable;
  if (!empty && q.is_cpu() && cache.spec().device.is_cpu() && (simd || q.size(0) <= kPortableDecodeChunkTokens)) {
    cache.append(layer, k, v, positions);
    return kv_chunk_decode_attention(q, k, v, cache, layer, scale, path, threads);
  }
  torch::Tensor out = kv_cache_attention(q, k, v, cache, layer, options).out;
  cache.append(layer, k, v, positions);
  return out;
}

KvCacheAttention::KvCacheAttention(std::shared_ptr<KvCache> cache, torch::Tensor positions,
                                   std::shared_ptr<KvObservations> observations, KvPolicy* compress, KvStep step)
    : cache_(std::move(cache)),
      positions_(std::move(positions)),
      observations_(std::move(observations)),
      compress_(compress),
      step_(step) {
  if (!cache_) throw std::invalid_argument("KvCacheAttention: cache is null");
}

torch::Tensor KvCacheAttention::forward(const AttentionBackend& inner, int64_t layer, const torch::Tensor& q,
                                        const torch::Tensor& k, const torch::Tensor& v,
                                        const torch::Tensor& cu_seqlens) const {
  const auto* softmax = dynamic_cast<const SoftmaxAttention*>(&inner);
  if (softmax == nullptr) {
    throw std::invalid_argument(fmt::format(
        "KvCacheAttention: the attention backend of layer {} is not softmax (a KV cache needs attention.backend: "
        "softmax; flexformer decodes with FlexformerDecoding)", layer));
  }
  const int64_t T = q.size(0);
  if (cu_seqlens.numel() != 2 || cu_seqlens[1].item<int64_t>() != T || positions_.numel() != T) {
    throw std::invalid_argument(fmt::format(
        "KvCacheAttention: layer {}: the batch must be one sequence of {} tokens with as many positions (cu_seqlens {}, "
        "positions {})", layer, T, c10::str(cu_seqlens.sizes()), positions_.numel()));
  }
  // Attend over the cache as it was before this chunk and the chunk's causal part; the chunk is appended either way.
  const double scale = softmax->options().scale > 0 ? softmax->options().scale
                                                    : 1.0 / std::sqrt(static_cast<double>(q.size(2)));
  // One token: the decode kernel, the same one a batched step runs (DecodeSession::step_batch), so that a
  // session decodes the same bits alone and among others; a chunk: kv_chunk_attention_append, as step_batch.
  torch::Tensor out;
  if (T == 1 && q.is_cpu() && cache_->spec().device.is_cpu()) {
    out = kv_decode_attention(q, k, v, {cache_.get()}, layer, scale);
    cache_->append(layer, k, v, positions_);
  } else {
    out = kv_chunk_attention_append(q, k, v, *cache_, layer, positions_, softmax->options());
  }
  if (observations_) observations_->observe(layer, q, positions_, *cache_, scale);
  if (compress_) compress_->after_layer(*cache_, layer, step_);
  return out;
}

}  // namespace dcp
