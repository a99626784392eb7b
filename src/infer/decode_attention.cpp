// The decode step's attention: one new token of each of N sequences over its own (compressed) cache and itself,
// every (sequence, head) pair in one parallel loop over raw rows. Through kv_cache_attention a decoded token costs
// some twenty tensor operations per head, and over a short cache their dispatch costs more than the arithmetic;
// here it costs none, which is what lets a continuous-batching step run many sessions at about the price of one
// (docs/serve.md "Scheduler"). The arithmetic is the same softmax(scale q.K^T + bias) V as kv_cache_attention's
// (spec section 2: the cache entries with their log-weight biases, then the token's own key, which no bias
// carries), in one pass: scores, their maximum, exp and sum, then the weighted values.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "dcp/cpu_features.h"
#include "dcp/infer.h"
#include "infer/decode_attention_simd.h"
#include "util/omp_for_each.h"

namespace dcp {
namespace {

// The accumulator: fp32 for fp32 and bf16 rows (as kv_cache_attention's cache part), fp64 for fp64.
template <class T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};

template <class A, class T>
inline A widen(T x) {
  return static_cast<A>(static_cast<float>(x));
}
template <>
inline double widen<double, double>(double x) {
  return x;
}

// <q, k> over d elements in 16 independent partial sums (vector lanes without reassociating one sum), added in
// a fixed order: the same value for the same rows on every call, whatever else the call computes.
template <class A, class T>
inline A dot(const A* q, const T* k, int64_t d) {
  constexpr int kLanes = 16;
  A part[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= d; j += kLanes) {
    for (int u = 0; u < kLanes; ++u) part[u] += q[j + u] * widen<A>(k[j + u]);
  }
  A s = 0;
  for (; j < d; ++j) s += q[j] * widen<A>(k[j]);
  for (int u = 0; u < kLanes; ++u) s += part[u];
  return s;
}

struct Rows {
  const void* q;
  const void* k;
  const void* v;
  int64_t q_stride[2], k_stride[2], v_stride[2];  // elements per sequence, per head
};

// Values read, summed over query heads of (entries + 1) x (head_dim + value_dim), below which one call runs on the
// calling thread: a call reads about 2 bytes (bf16) per entry
// and dimension from memory, ~0.25 ms at 8 GB/s for 2^20 of them, and splitting less than that over threads saves
// about what waking them costs (tens of microseconds, more on a loaded machine). A chunk's query blocks
// (attend_chunk_blocks) read about 1/16 of that from memory, the rest from L1, so the same count stands there for
// arithmetic, not bytes: ~0.1-0.2 ms of it at the rates bench_chunk_attention measured (not re-tuned for blocks).
constexpr int64_t kSerialWork = int64_t{1} << 20;
static_assert(kChunkQueryBlock >= 1 && kChunkQueryBlock <= decode_simd::kMaxQueries,
              "the default query block must fit attend_queries");

// Runs body(begin, end) over the pairs [0, pairs): on `threads` OpenMP threads, one pair at a time to whichever
// thread is free (the caches differ in length), or all on the calling thread for threads <= 1. The first exception
// a pair throws is rethrown once every thread has stopped.
template <class Body>
void parallel_pairs(int64_t pairs, int64_t threads, const Body& body) {
  if (omp_for_each(pairs, threads, [&](int64_t pair) { body(pair, pair + 1); })) return;
  body(0, pairs);
}

// A chunk's tokens on the AVX-512 paths: blocks of up to query_block consecutive tokens of one query head
// (decode_simd::attend_queries), so that each key and value row is read from memory once per block instead of once
// per token; the blocks head by head, each head's latest (longest) first, one block at a time to whichever thread is
// free. Token t of the chunk reads the first chunk_first[kh] + t rows of its KV head kh and its own k_t, v_t; every
// token's sums run as one token's alone (attend_pair), so its bits depend neither on the block size nor on threads.
template <class T>
void attend_chunk_blocks(const Rows& r, const std::vector<const KvCache*>& caches, int64_t layer, int64_t heads,
                         int64_t kv_heads, int64_t d, int64_t dv, double scale, T* out, DecodeAttentionPath path,
                         int64_t threads, const std::vector<int64_t>& chunk_first, int64_t query_block) {
  const int64_t tokens = static_cast<int64_t>(caches.size());
  struct Block {
    int64_t head, begin, end;
  };
  std::vector<Block> blocks;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t e = tokens; e > 0; e -= query_block) blocks.push_back({h, std::max<int64_t>(0, e - query_block), e});
  }
  parallel_pairs(static_cast<int64_t>(blocks.size()), threads, [&](int64_t begin, int64_t end) {
    static thread_local std::vector<float> scores, scratch;
    std::array<decode_simd::Query<T>, decode_simd::kMaxQueries> qb;
    for (int64_t taken = begin; taken < end; ++taken) {
      const Block& b = blocks[static_cast<size_t>(taken)];
      const int64_t h = b.head, kh = h / (heads / kv_heads), count = b.end - b.begin;
      const KvHeadData hd = caches[0]->data(layer, kh);  // every token of the chunk reads the same cache
      const int64_t n_max = chunk_first[static_cast<size_t>(kh)] + b.end - 1;
      scores.resize(static_cast<size_t>(count * (n_max + 1)));
      scratch.resize(static_cast<size_t>(decode_simd::query_scratch_floats(count, d)));
      for (int64_t i = 0; i < count; ++i) {
        const int64_t s = b.begin + i;
        qb[static_cast<size_t>(i)] = {static_cast<const T*>(r.q) + s * r.q_stride[0] + h * r.q_stride[1],
                                      static_cast<const T*>(r.k) + s * r.k_stride[0] + kh * r.k_stride[1],
                                      static_cast<const T*>(r.v) + s * r.v_stride[0] + kh * r.v_stride[1],
                                      chunk_first[static_cast<size_t>(kh)] + s,
                                      scores.data() + i * (n_max + 1),
                                      out + (s * heads + h) * dv};
      }
      const T* keys = static_cast<const T*>(hd.keys);
      const T* values = static_cast<const T*>(hd.values);
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (path == DecodeAttentionPath::kAvx512Bf16) {
          decode_simd::attend_queries_dot(qb.data(), count, keys, values, hd.bias, d, dv, static_cast<float>(scale),
                                          scratch.data());
          continue;
        }
      }
      decode_simd::attend_queries<T>(qb.data(), count, keys, values, hd.bias, d, dv, static_cast<float>(scale),
                                     scratch.data());
    }
  });
}

// rows(s, kh): the cache rows sequence s's token reads at KV head kh: all of them, or, with `chunk_first` (one
// chunk's tokens as the sequences, kv_chunk_decode_attention), the first chunk_first[kh] + s.
template <class T>
void attend(const Rows& r, const std::vector<const KvCache*>& caches, int64_t layer, int64_t heads, int64_t kv_heads,
            int64_t d, int64_t dv, double scale, T* out, DecodeAttentionPath path, int64_t threads,
            const std::vector<int64_t>* chunk_first, int64_t query_block) {
  using A = typename Acc<T>::type;
  const int64_t n_seq = static_cast<int64_t>(caches.size());
  const int64_t pairs = n_seq * heads;
  auto rows = [&](int64_t s, int64_t kh) {
    return chunk_first ? (*chunk_first)[static_cast<size_t>(kh)] + s : caches[static_cast<size_t>(s)]->length(layer, kh);
  };
  int64_t work = 0;
  for (int64_t s = 0; s < n_seq; ++s) {
    for (int64_t h = 0; h < kv_heads; ++h) work += (rows(s, h) + 1) * (heads / kv_heads) * (d + dv);
  }
  const bool simd = path != DecodeAttentionPath::kPortable;
  const int64_t use = work < kSerialWork ? 1 : threads;
  if constexpr (!std::is_same_v<T, double>) {
    if (chunk_first && simd) {
      attend_chunk_blocks<T>(r, caches, layer, heads, kv_heads, d, dv, scale, out, path, use, *chunk_first, query_block);
      return;
    }
  }
  // Threads take the pairs longest cache first (Graham's LPT rule, "Bounds on multiprocessing timing anomalies",
  // 1969): the last pairs taken are then the shortest, so the threads finish within about one short pair of each
  // other; in the callers' order (the scheduler's sessions by arrival) the longest cache could come last and leave
  // the other threads idle for its whole length. Every pair is computed alone, so its bits do not depend on the order.
  std::vector<int64_t> order(static_cast<size_t>(pairs));
  for (int64_t i = 0; i < pairs; ++i) order[static_cast<size_t>(i)] = i;
  if (chunk_first) {
    // (The portable loops; the AVX-512 paths took attend_chunk_blocks above.) A chunk's tokens read the same rows of
    // each head (each token a few more): head by head, every token of a head before the next head (its longest
    // first), so that the threads reread one head's keys and values from their own caches instead of cycling
    // through every head's for each token.
    int64_t i = 0;
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t s = n_seq - 1; s >= 0; --s) order[static_cast<size_t>(i++)] = s * heads + h;
    }
  } else if (use > 1) {
    std::vector<int64_t> length(static_cast<size_t>(pairs));
    for (int64_t i = 0; i < pairs; ++i) {
      length[static_cast<size_t>(i)] = rows(i / heads, i % heads / (heads / kv_heads));
    }
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return length[static_cast<size_t>(a)] > length[static_cast<size_t>(b)]; });
  }
  parallel_pairs(pairs, use, [&](int64_t begin, int64_t end) {
    // Per-thread scratch, kept between calls: qs the scaled query (d rounded up to 32: the AVX-512 paths read bf16
    // queries 32 columns at a time), acc the weighted values, scores one per entry.
    static thread_local std::vector<A> qs, acc, scores;
    qs.resize(static_cast<size_t>((d + 31) / 32 * 32));
    acc.resize(static_cast<size_t>(dv));
    for (int64_t taken = begin; taken < end; ++taken) {
      const int64_t pair = order[static_cast<size_t>(taken)];
      // Query head h reads KV head h / (heads / kv_heads) (grouped-query attention; equal counts without GQA).
      const int64_t s = pair / heads, h = pair % heads, kh = h / (heads / kv_heads);
      const KvHeadData hd = caches[static_cast<size_t>(s)]->data(layer, kh);
      const T* q = static_cast<const T*>(r.q) + s * r.q_stride[0] + h * r.q_stride[1];
      const T* k_new = static_cast<const T*>(r.k) + s * r.k_stride[0] + kh * r.k_stride[1];
      const T* v_new = static_cast<const T*>(r.v) + s * r.v_stride[0] + kh * r.v_stride[1];
      const int64_t n = rows(s, kh);
      scores.resize(static_cast<size_t>(n + 1));
      const T* keys = static_cast<const T*>(hd.keys);
      const T* values = static_cast<const T*>(hd.values);
      T* o = out + (s * heads + h) * dv;
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (path == DecodeAttentionPath::kAvx512Bf16) {
          decode_simd::attend_pair_dot(q, keys, values, hd.bias, n, k_new, v_new, d, dv, static_cast<float>(scale),
                                       scores.data(), o);
          continue;
        }
      }
      if constexpr (!std::is_same_v<T, double>) {
        if (simd) {
          decode_simd::attend_pair<T>(q, keys, values, hd.bias, n, k_new, v_new, d, dv, static_cast<float>(scale),
                                      qs.data(), scores.data(), o);
          continue;
        }
      }
      for (int64_t j = 0; j < d; ++j) qs[static_cast<size_t>(j)] = widen<A>(q[j]) * static_cast<A>(scale);
      A m = -std::numeric_limits<A>::infinity();
      for (int64_t i = 0; i < n; ++i) {
        const A x = dot<A>(qs.data(), keys + i * d, d) + static_cast<A>(hd.bias[i]);
        scores[static_cast<size_t>(i)] = x;
        m = std::max(m, x);
      }
      const A self = dot<A>(qs.data(), k_new, d);
      scores[static_cast<size_t>(n)] = self;
      m = std::max(m, self);
      A sum = 0;
      for (int64_t i = 0; i <= n; ++i) {
        const A p = std::exp(scores[static_cast<size_t>(i)] - m);
        scores[static_cast<size_t>(i)] = p;
        sum += p;
      }
      std::fill(acc.begin(), acc.end(), A{0});
      for (int64_t i = 0; i < n; ++i) {
        const A p = scores[static_cast<size_t>(i)];
        const T* row = values + i * dv;
        for (int64_t j = 0; j < dv; ++j) acc[static_cast<size_t>(j)] += p * widen<A>(row[j]);
      }
      const A p_self = scores[static_cast<size_t>(n)];
      for (int64_t j = 0; j < dv; ++j) acc[static_cast<size_t>(j)] += p_self * widen<A>(v_new[j]);
      const A inv = A{1} / sum;
      for (int64_t j = 0; j < dv; ++j) o[j] = static_cast<T>(acc[static_cast<size_t>(j)] * inv);
    }
  });
}

}  // namespace

const char* to_string(DecodeAttentionPath path) {
  switch (path) {
    case DecodeAttentionPath::kAuto: return "auto";
    case DecodeAttentionPath::kPortable: return "portable";
    case DecodeAttentionPath::kAvx512: return "avx512";
    case DecodeAttentionPath::kAvx512Bf16: return "avx512-bf16";
  }
  return "unknown";
}

namespace decode_simd {

DecodeAttentionPath resolve_path(torch::ScalarType dtype, DecodeAttentionPath requested, const CpuFeatures& cpu) {
  const bool avx512 = cpu.avx512f && cpu.avx512bw && cpu.avx512vl;
  switch (requested) {
    case DecodeAttentionPath::kAuto:
      if (dtype == torch::kBFloat16 && avx512 && cpu.avx512_bf16) return DecodeAttentionPath::kAvx512Bf16;
      return dtype != torch::kDouble && avx512 ? DecodeAttentionPath::kAvx512 : DecodeAttentionPath::kPortable;
    case DecodeAttentionPath::kPortable: return requested;
    case DecodeAttentionPath::kAvx512:
      if (dtype == torch::kDouble) {
        throw std::invalid_argument("kv_decode_attention: path avx512 cannot run for Double caches: fp64 runs the "
                                    "portable loops only");
      }
      if (!avx512) {
        throw std::invalid_argument(fmt::format("kv_decode_attention: path avx512 cannot run for {} caches: this CPU "
                                                "lacks AVX-512 (F, BW, VL)", c10::toString(dtype)));
      }
      return requested;
    case DecodeAttentionPath::kAvx512Bf16:
      if (dtype != torch::kBFloat16) {
        throw std::invalid_argument(fmt::format("kv_decode_attention: path avx512-bf16 cannot run for {} caches: it "
                                                "reads bf16 rows only", c10::toString(dtype)));
      }
      if (!avx512 || !cpu.avx512_bf16) {
        throw std::invalid_argument("kv_decode_attention: path avx512-bf16 cannot run for BFloat16 caches: this CPU "
                                    "lacks AVX-512 (F, BW, VL) with AVX512-BF16");
      }
      return requested;
  }
  throw std::invalid_argument("kv_decode_attention: unknown path");
}

}  // namespace decode_simd

DecodeAttentionPath resolve_decode_attention_path(torch::ScalarType dtype, DecodeAttentionPath requested) {
  return decode_simd::resolve_path(dtype, requested, cpu_features());
}

namespace {

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const std::vector<const KvCache*>& caches, int64_t layer, double scale,
                               DecodeAttentionPath path, int64_t threads, const std::vector<int64_t>* chunk_first,
                               int64_t query_block = 1) {
  if (threads < 0) throw std::invalid_argument(fmt::format("kv_decode_attention: threads {} must be >= 0", threads));
  if (threads == 0) threads = at::get_num_threads();
  const int64_t n = static_cast<int64_t>(caches.size());
  if (n == 0) throw std::invalid_argument("kv_decode_attention: no caches");
  for (int64_t i = 0; i < n; ++i) {
    if (caches[static_cast<size_t>(i)] == nullptr) {
      throw std::invalid_argument(fmt::format("kv_decode_attention: cache {} is null", i));
    }
  }
  const KvCacheSpec& s = caches[0]->spec();
  for (int64_t i = 1; i < n; ++i) {
    const KvCacheSpec& o = caches[static_cast<size_t>(i)]->spec();
    if (o.layers != s.layers || o.kv_heads != s.kv_heads || o.head_dim != s.head_dim || o.value_dim != s.value_dim ||
        o.dtype != s.dtype || o.device != s.device) {
      throw std::invalid_argument(fmt::format("kv_decode_attention: cache {} has another shape or dtype than cache 0", i));
    }
  }
  if (layer < 0 || layer >= s.layers) {
    throw std::invalid_argument(fmt::format("kv_decode_attention: layer {} outside [0, {})", layer, s.layers));
  }
  auto shape = [](const torch::Tensor& t) { return t.defined() ? c10::str(t.sizes()) : std::string("undefined"); };
  if (!q.defined() || q.dim() != 3 || q.size(0) != n || q.size(1) < s.kv_heads || q.size(1) % s.kv_heads != 0 ||
      q.size(2) != s.head_dim || !k.defined() || k.dim() != 3 || k.size(0) != n || k.size(1) != s.kv_heads ||
      k.size(2) != s.head_dim || !v.defined() || v.dim() != 3 || v.size(0) != n || v.size(1) != s.kv_heads ||
      v.size(2) != s.value_dim) {
    throw std::invalid_argument(fmt::format(
        "kv_decode_attention: q must be [{}, a multiple of {}, {}], k [{}, {}, {}] and v [{}, {}, {}] (one token per "
        "cache), got q {}, k {}, v {}",
        n, s.kv_heads, s.head_dim, n, s.kv_heads, s.head_dim, n, s.kv_heads, s.value_dim, shape(q), shape(k),
        shape(v)));
  }
  const int64_t heads = q.size(1);
  for (const auto* t : {&q, &k, &v}) {
    if (t->scalar_type() != s.dtype || !t->device().is_cpu()) {
      throw std::invalid_argument(fmt::format("kv_decode_attention: q, k, v must be CPU {} tensors (the cache dtype), "
                                              "got {} on {}", c10::toString(s.dtype), c10::toString(t->scalar_type()),
                                              t->device().str()));
    }
  }
  // Rows are read with their own strides; only the last dimension must be dense.
  auto dense = [](const torch::Tensor& t) { return t.stride(2) == 1 ? t : t.contiguous(); };
  const torch::Tensor qd = dense(q), kd = dense(k), vd = dense(v);
  if (!s.device.is_cpu()) throw std::invalid_argument("kv_decode_attention: the caches must be on the CPU");
  if (scale <= 0) scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  const DecodeAttentionPath resolved = resolve_decode_attention_path(s.dtype, path);
  torch::Tensor out = torch::empty({n, heads, s.value_dim}, q.options());
  const Rows rows{qd.data_ptr(), kd.data_ptr(), vd.data_ptr(), {qd.stride(0), qd.stride(1)},
                  {kd.stride(0), kd.stride(1)}, {vd.stride(0), vd.stride(1)}};
  switch (s.dtype) {
    case torch::kFloat:
      attend<float>(rows, caches, layer, heads, s.kv_heads, s.head_dim, s.value_dim, scale, out.data_ptr<float>(), resolved,
                    threads, chunk_first, query_block);
      break;
    case torch::kDouble:
      attend<double>(rows, caches, layer, heads, s.kv_heads, s.head_dim, s.value_dim, scale, out.data_ptr<double>(), resolved,
                     threads, chunk_first, query_block);
      break;
    case torch::kBFloat16:
      attend<c10::BFloat16>(rows, caches, layer, heads, s.kv_heads, s.head_dim, s.value_dim, scale,
                            out.data_ptr<c10::BFloat16>(), resolved, threads, chunk_first, query_block);
      break;
    default:
      throw std::invalid_argument("kv_decode_attention: unsupported dtype " + std::string(c10::toString(s.dtype)));
  }
  return out;
}

}  // namespace

torch::Tensor kv_decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                  const std::vector<const KvCache*>& caches, int64_t layer, double scale,
                                  DecodeAttentionPath path, int64_t threads) {
  return decode_attention(q, k, v, caches, layer, scale, path, threads, nullptr);
}

torch::Tensor kv_chunk_decode_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                        const KvCache& cache, int64_t layer, double scale, DecodeAttentionPath path,
                                        int64_t threads, int64_t query_block) {
  if (query_block == 0) query_block = kChunkQueryBlock;
  if (query_block < 1 || query_block > decode_simd::kMaxQueries) {
    throw std::invalid_argument(fmt::format("kv_chunk_decode_attention: query_block {} outside [0, {}] (0: the "
                                            "default {})", query_block, decode_simd::kMaxQueries, kChunkQueryBlock));
  }
  const KvCacheSpec& s = cache.spec();
  if (layer < 0 || layer >= s.layers) {
    throw std::invalid_argument(fmt::format("kv_chunk_decode_attention: layer {} outside [0, {})", layer, s.layers));
  }
  const int64_t T = q.defined() && q.dim() == 3 ? q.size(0) : -1;
  if (T < 1) {
    throw std::invalid_argument(fmt::format("kv_chunk_decode_attention: q must be [T >= 1, heads, {}], got {}",
                                            s.head_dim, q.defined() ? c10::str(q.sizes()) : std::string("undefined")));
  }
  std::vector<int64_t> first(static_cast<size_t>(s.kv_heads));
  for (int64_t h = 0; h < s.kv_heads; ++h) {
    const int64_t n = cache.length(layer, h);
    if (n < T) {
      throw std::invalid_argument(fmt::format(
          "kv_chunk_decode_attention: layer {} head {} holds {} rows, fewer than the chunk's {} tokens (append the "
          "chunk first)", layer, h, n, T));
    }
    first[static_cast<size_t>(h)] = n - T;
  }
  const std::vector<const KvCache*> caches(static_cast<size_t>(T), &cache);
  return decode_attention(q, k, v, caches, layer, scale, path, threads, &first, query_block);
}

}  // namespace dcp
