// The decode kernel's AVX-512 paths (decode_attention_simd.h). The portable loops of decode_attention.cpp are their
// twin; tests/unit/test_serve_batching.cpp forces each and compares it with the fp64 reference.
//
// Scores are computed 16 key rows at a time: each row's dot product accumulates in its own 16-lane register, and
// one transposing reduction (sum_lanes_16) turns the 16 registers into the 16 scores, about 2 instructions per row
// instead of a 16-lane reduction per row. bf16 rows are read 32 columns per 512-bit load, split into their even
// and odd columns as fp32 (a shift and a mask), or, on the avx512-bf16 path, multiplied pairwise by vdpbf16ps
// straight from the bf16 query (products of two bf16 are exact in fp32, accumulated in fp32).
#include "infer/decode_attention_simd.h"

#include <immintrin.h>

#include <algorithm>
#include <limits>
#include <type_traits>

#include "kernels/simd.h"

#define DCP_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace dcp::decode_simd {
namespace {

using bf16 = c10::BFloat16;
using simd::kLanes;
constexpr int kRows = 16;  // key rows per block of pass 1
constexpr int64_t kLine = 64;  // bytes per cache line
// Software prefetch distance of passes 1 and 3: each reads its rows kPrefetchBytes ahead into L1 while it works on
// the current ones. Measured on an AMD EPYC (bench/results/cpu2_202612_serve_prefetch.md: bench_serve_step, 16
// sessions of 1-8K tokens, binaries alternated): the avx512-bf16 kernel alone a median 15% faster than with the
// hardware prefetchers alone (which likely stop at each 4 KiB page); 2, 4 and 8 KiB within the run-to-run noise of
// each other. Not measured on Sapphire Rapids. The results do not change (a prefetch loads no register), and no
// test can see an address it fetches (a prefetch never faults).
constexpr int64_t kPrefetchBytes = 4096;

// Prefetches into L1 the cache lines of bytes [at, at + width) of the array at `base` that lie below its `size`
// bytes (offsets, so that no pointer is formed past the array).
inline void prefetch_bytes(const void* base, int64_t at, int64_t width, int64_t size) {
  const char* b = static_cast<const char*>(base);
  for (int64_t o = at; o < at + width && o < size; o += kLine) _mm_prefetch(b + o, _MM_HINT_T0);
}

// The lanes of a 16-wide block starting at `at` that lie below `count` (none when at >= count).
DCP_AVX512 inline __mmask16 tail(int64_t count, int64_t at) {
  return at >= count ? static_cast<__mmask16>(0) : simd::lanes_below(count - at);
}

// The 32-bit-element mask of the bf16 columns [at, at + 32) below `count`.
DCP_AVX512 inline __mmask32 tail32(int64_t count, int64_t at) {
  const int64_t k = count - at;
  return k >= 32 ? static_cast<__mmask32>(0xffffffffu) : k <= 0 ? static_cast<__mmask32>(0) : static_cast<__mmask32>((1u << k) - 1u);
}

// 32 bf16 columns [p, p + 32) where m has their bit: a plain load when all 32 are wanted, because the hardware
// prefetchers of the AMD EPYC measured do not follow masked AVX-512 loads (kernels/simd.h; here the kernel read its
// caches at 11.6-11.8 GB/s with masked loads and 29-30 GB/s with plain ones: bench/results/cpu2_202612_serve_step.md).
DCP_AVX512 inline __m512i load32(const bf16* p, __mmask32 m) {
  return m == static_cast<__mmask32>(0xffffffffu) ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(m, p);
}

// 32 bf16 columns as fp32: the even ones (0, 2, ..) and the odd ones (1, 3, ..).
DCP_AVX512 inline __m512 even_columns(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }
DCP_AVX512 inline __m512 odd_columns(__m512i x) {
  return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// Lane r of the result: the sum of the 16 lanes of v[r], by one fixed tree for every lane (halves, then quarters,
// eighths and sixteenths of the lanes are added, then the lanes are put in row order).
DCP_AVX512 inline __m512 sum_lanes_16(const __m512* v) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i) {  // x[i]: blocks [row i: 2 blocks of 4 partials | row i + 8: 2]
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // y[i]: blocks of 4 partials of rows i, i + 8, i + 4, i + 12
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[i], x[i + 4], 0x88), _mm512_shuffle_f32x4(x[i], x[i + 4], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {  // z[i]: 2 partials each of rows (i, i + 2), (i + 8, i + 10), (i + 4, i + 6), (i + 12, i + 14)
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(y[i], y[i + 2], 0x44), _mm512_shuffle_ps(y[i], y[i + 2], 0xEE));
  }
  // Sums of rows 0 2 1 3 | 8 10 9 11 | 4 6 5 7 | 12 14 13 15, then in order.
  const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), w);
}

// The query as the row loops read it: fp32 rows use q * scale in 16-column chunks; bf16 rows with FMAs use q * scale
// split into even and odd columns per 32-column chunk (qs: 2 d floats); vdpbf16ps reads q itself (bf16).
template <class T>
DCP_AVX512 inline void scaled_query(const T* q, int64_t d, float scale, float* qs) {
  const __m512 sv = _mm512_set1_ps(scale);
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t j = 0; j < d; j += kLanes) {
      const __mmask16 m = tail(d, j);
      simd::store(qs + j, _mm512_mul_ps(simd::load(q + j, m), sv), m);
    }
  } else {
    for (int64_t j = 0; j < d; j += 32) {
      const __m512i x = load32(q + j, tail32(d, j));
      _mm512_storeu_ps(qs + j, _mm512_mul_ps(even_columns(x), sv));
      _mm512_storeu_ps(qs + j + kLanes, _mm512_mul_ps(odd_columns(x), sv));
    }
  }
}

// acc[r]: 16 partial sums of <q * scale, row r> for the rows [0, valid) of `rows` (rows r >= valid repeat row
// valid - 1; their lanes are ignored). FMAs in fp32.
template <class T>
DCP_AVX512 inline void block_dots(const float* qs, const T* rows, int64_t d, int64_t valid, __m512* acc) {
  const T* row[kRows];
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) {
    row[r] = rows + std::min<int64_t>(r, valid - 1) * d;
    acc[r] = _mm512_setzero_ps();
  }
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t j = 0; j < d; j += kLanes) {
      const __mmask16 m = tail(d, j);
      const __m512 qj = _mm512_loadu_ps(qs + j);
#pragma GCC unroll 16
      for (int r = 0; r < kRows; ++r) acc[r] = _mm512_fmadd_ps(qj, simd::load(row[r] + j, m), acc[r]);
    }
  } else {
    for (int64_t j = 0; j < d; j += 32) {
      const __mmask32 m = tail32(d, j);
      const __m512 qe = _mm512_loadu_ps(qs + j), qo = _mm512_loadu_ps(qs + j + kLanes);
#pragma GCC unroll 16
      for (int r = 0; r < kRows; ++r) {
        const __m512i x = load32(row[r] + j, m);
        acc[r] = _mm512_fmadd_ps(qo, odd_columns(x), _mm512_fmadd_ps(qe, even_columns(x), acc[r]));
      }
    }
  }
}

// The same with vdpbf16ps on the bf16 query (unscaled): acc[r] lanes sum to <q, row r>.
DCP_AVX512_BF16 inline void block_dots_bf16(const bf16* q, const bf16* rows, int64_t d, int64_t valid, __m512* acc) {
  const bf16* row[kRows];
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) {
    row[r] = rows + std::min<int64_t>(r, valid - 1) * d;
    acc[r] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < d; j += 32) {
    const __mmask32 m = tail32(d, j);
    const __m512bh qj = (__m512bh)load32(q + j, m);
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], qj, (__m512bh)load32(row[r] + j, m));
  }
}

// Pass 1 of one block: scores[i..i+valid) = <q, row> scale + bias (fp32 paths: the scale is in qs), and the
// running maximum over the valid lanes. The fp32 and bf16 caches share this body (block_dots<T> on the scaled fp32
// query); the vdpbf16ps path is the specialisation below.
DCP_AVX512 inline __m512 store_block_scores(__m512 s, int64_t valid, float* scores, __m512 mx) {
  const __mmask16 m = simd::lanes_below(valid);
  _mm512_mask_storeu_ps(scores, m, s);
  return _mm512_mask_max_ps(mx, m, mx, s);
}

template <class T, bool kDot>
DCP_AVX512 inline __m512 block_scores(const T*, const float* qs, const T* rows, const float* bias, int64_t d,
                                      int64_t valid, float, float* scores, __m512 mx) {
  static_assert(!kDot, "the vdpbf16ps path is block_scores<bf16, true>");
  __m512 acc[kRows];
  block_dots<T>(qs, rows, d, valid, acc);
  const __m512 s = bias ? _mm512_add_ps(sum_lanes_16(acc), simd::load(bias, simd::lanes_below(valid)))
                        : sum_lanes_16(acc);
  return store_block_scores(s, valid, scores, mx);
}

template <>
DCP_AVX512_BF16 inline __m512 block_scores<bf16, true>(const bf16* q, const float*, const bf16* rows, const float* bias,
                                                       int64_t d, int64_t valid, float scale, float* scores, __m512 mx) {
  __m512 acc[kRows];
  block_dots_bf16(q, rows, d, valid, acc);
  const __m512 sv = _mm512_set1_ps(scale);
  const __m512 s = bias ? _mm512_fmadd_ps(sum_lanes_16(acc), sv, simd::load(bias, simd::lanes_below(valid)))
                        : _mm512_mul_ps(sum_lanes_16(acc), sv);
  return store_block_scores(s, valid, scores, mx);
}

// Pass 3 for fp32 values: sum_r p_r v_r in four 16-lane accumulators (64 value columns) per sweep over the rows.
DCP_AVX512 inline void weighted_values(const float* values, const float* v_new, const float* p, int64_t n, int64_t dv,
                                       float inv, float* out) {
  for (int64_t c = 0; c < dv; c += 4 * kLanes) {
    const __mmask16 m0 = tail(dv, c), m1 = tail(dv, c + kLanes), m2 = tail(dv, c + 2 * kLanes),
                    m3 = tail(dv, c + 3 * kLanes);
    const int64_t width = std::min<int64_t>(dv - c, 4 * kLanes);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t r = 0; r <= n; ++r) {
      const float* v = r < n ? values + r * dv : v_new;  // row n is the token's own value
      prefetch_bytes(values, (r * dv + c) * 4 + kPrefetchBytes, width * 4, n * dv * 4);
      const __m512 pb = _mm512_set1_ps(p[r]);
      a0 = _mm512_fmadd_ps(pb, simd::load(v + c, m0), a0);
      if (width > kLanes) a1 = _mm512_fmadd_ps(pb, simd::load(v + c + kLanes, m1), a1);
      if (width > 2 * kLanes) a2 = _mm512_fmadd_ps(pb, simd::load(v + c + 2 * kLanes, m2), a2);
      if (width > 3 * kLanes) a3 = _mm512_fmadd_ps(pb, simd::load(v + c + 3 * kLanes, m3), a3);
    }
    const __m512 iv = _mm512_set1_ps(inv);
    simd::store(out + c, _mm512_mul_ps(a0, iv), m0);
    simd::store(out + c + kLanes, _mm512_mul_ps(a1, iv), m1);
    simd::store(out + c + 2 * kLanes, _mm512_mul_ps(a2, iv), m2);
    simd::store(out + c + 3 * kLanes, _mm512_mul_ps(a3, iv), m3);
  }
}

// Pass 3 for bf16 values: 64 columns per sweep as two 32-column loads, each split into even and odd columns (four
// accumulators); the columns are put back in order once per sweep. Each column's sum runs over the rows in order,
// as for fp32 values.
DCP_AVX512 inline void weighted_values(const bf16* values, const bf16* v_new, const float* p, int64_t n, int64_t dv,
                                       float inv, bf16* out) {
  alignas(64) float even[2][kLanes], odd[2][kLanes];
  alignas(64) float cols[64];
  for (int64_t c = 0; c < dv; c += 64) {
    const __mmask32 m0 = tail32(dv, c), m1 = tail32(dv, c + 32);
    __m512 e0 = _mm512_setzero_ps(), o0 = e0, e1 = e0, o1 = e0;
    for (int64_t r = 0; r <= n; ++r) {
      const bf16* v = r < n ? values + r * dv : v_new;
      prefetch_bytes(values, (r * dv + c) * 2 + kPrefetchBytes, std::min<int64_t>(dv - c, 64) * 2, n * dv * 2);
      const __m512 pb = _mm512_set1_ps(p[r]);
      const __m512i x0 = load32(v + c, m0);
      e0 = _mm512_fmadd_ps(pb, even_columns(x0), e0);
      o0 = _mm512_fmadd_ps(pb, odd_columns(x0), o0);
      if (m1 != 0) {
        const __m512i x1 = load32(v + c + 32, m1);
        e1 = _mm512_fmadd_ps(pb, even_columns(x1), e1);
        o1 = _mm512_fmadd_ps(pb, odd_columns(x1), o1);
      }
    }
    const __m512 iv = _mm512_set1_ps(inv);
    _mm512_store_ps(even[0], _mm512_mul_ps(e0, iv));
    _mm512_store_ps(odd[0], _mm512_mul_ps(o0, iv));
    _mm512_store_ps(even[1], _mm512_mul_ps(e1, iv));
    _mm512_store_ps(odd[1], _mm512_mul_ps(o1, iv));
    for (int h = 0; h < 2; ++h) {
      for (int l = 0; l < kLanes; ++l) {
        cols[32 * h + 2 * l] = even[h][l];
        cols[32 * h + 2 * l + 1] = odd[h][l];
      }
    }
    for (int64_t k = 0; k < 64; k += kLanes) simd::store(out + c + k, _mm512_load_ps(cols + k), tail(dv, c + k));
  }
}

template <class T, bool kDot>
DCP_AVX512 inline void attend(const T* q, const T* keys, const T* values, const float* bias, int64_t n,
                              const T* k_new, const T* v_new, int64_t d, int64_t dv, float scale, float* qs,
                              float* scores, T* out) {
  if constexpr (!kDot) scaled_query<T>(q, d, scale, qs);
  // Pass 1: scores (cache rows with their bias, 16 at a time, then the token itself) and their maximum.
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T));  // d >= 1 (KvCache's head_dim)
  const int64_t ahead_rows = kPrefetchBytes / row_bytes;
  for (int64_t i = 0; i < n; i += kRows) {
    // The block kPrefetchBytes ahead of this one, and its biases.
    prefetch_bytes(keys, i * row_bytes + kPrefetchBytes, kRows * row_bytes, n * row_bytes);
    if (bias != nullptr) prefetch_bytes(bias, (i + ahead_rows) * 4, kRows * 4, n * 4);
    mx = block_scores<T, kDot>(q, qs, keys + i * d, bias + i, d, std::min<int64_t>(kRows, n - i), scale, scores + i, mx);
  }
  mx = block_scores<T, kDot>(q, qs, k_new, nullptr, d, 1, scale, scores + n, mx);
  const float m = _mm512_reduce_max_ps(mx);
  // Pass 2: p = exp(s - max) in place, and their sum (masked lanes add nothing).
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t r = 0; r <= n; r += kLanes) {
    const __mmask16 mk = tail(n + 1, r);
    const __m512 p = _mm512_maskz_mov_ps(mk, simd::exp(_mm512_sub_ps(simd::load(scores + r, mk), mv)));
    _mm512_mask_storeu_ps(scores + r, mk, p);
    sum = _mm512_add_ps(sum, p);
  }
  // Pass 3: sum_i p_i v_i / sum_i p_i.
  weighted_values(values, v_new, scores, n, dv, 1.0f / _mm512_reduce_add_ps(sum), out);
}

}  // namespace

template <class T>
void attend_pair(const T* q, const T* keys, const T* values, const float* bias, int64_t n, const T* k_new,
                 const T* v_new, int64_t d, int64_t dv, float scale, float* qs, float* scores, T* out) {
  attend<T, false>(q, keys, values, bias, n, k_new, v_new, d, dv, scale, qs, scores, out);
}

// The vdpbf16ps instances carry the avx512bf16 target themselves (callers check cpu_features().avx512_bf16).
DCP_AVX512_BF16 void attend_pair_dot(const bf16* q, const bf16* keys, const bf16* values, const float* bias, int64_t n,
                                     const bf16* k_new, const bf16* v_new, int64_t d, int64_t dv, float scale,
                                     float* scores, bf16* out) {
  attend<bf16, true>(q, keys, values, bias, n, k_new, v_new, d, dv, scale, nullptr, scores, out);
}

template void attend_pair<float>(const float*, const float*, const float*, const float*, int64_t, const float*,
                                 const float*, int64_t, int64_t, float, float*, float*, float*);
template void attend_pair<bf16>(const bf16*, const bf16*, const bf16*, const float*, int64_t, const bf16*, const bf16*,
                                int64_t, int64_t, float, float*, float*, bf16*);

}  // namespace dcp::decode_simd
