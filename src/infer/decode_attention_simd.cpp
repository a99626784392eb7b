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
#include <stdexcept>
#include <string>
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
  // (Unrolled, so that x, y and z stay in registers: GCC 12 otherwise kept them on the stack.)
  __m512 x[8], y[4], z[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {  // x[i]: blocks [row i: 2 blocks of 4 partials | row i + 8: 2]
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // y[i]: blocks of 4 partials of rows i, i + 8, i + 4, i + 12
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[i], x[i + 4], 0x88), _mm512_shuffle_f32x4(x[i], x[i + 4], 0xDD));
  }
#pragma GCC unroll 2
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
    for (int64_t j = 0; j < d; j += kLanes) {  // all 16 lanes written, those past d as 0 (block_dots reads them)
      const __mmask16 m = tail(d, j);
      _mm512_storeu_ps(qs + j, _mm512_maskz_mul_ps(m, simd::load(q + j, m), sv));
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
  const int64_t last = valid - 1;
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) {
    row[r] = rows + (r < last ? r : last) * d;
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
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  if (valid == kRows) {  // a whole block: rows at fixed offsets (no clamped row pointers to keep)
    for (int64_t j = 0; j < d; j += 32) {
      const __mmask32 m = tail32(d, j);
      const __m512bh qj = (__m512bh)load32(q + j, m);
#pragma GCC unroll 16
      for (int r = 0; r < kRows; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], qj, (__m512bh)load32(rows + r * d + j, m));
    }
    return;
  }
  const bf16* row[kRows];
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) row[r] = rows + std::min<int64_t>(r, valid - 1) * d;
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

// Pass 3's accumulation of value rows [r0, r1) into the 64 value columns [c, c + 64) for G queries at once (p[g]
// query g's weights by row, a[g] its accumulators: four 16-lane registers, for fp32 values columns c + 16 k + l in
// a[g][k] lane l, for bf16 values (two 32-column loads, each split) the even columns of the first load in a[g][0],
// its odd ones in a[g][1], the second load's in a[g][2] and a[g][3]); with `prefetch`, each row also prefetches the
// same columns kPrefetchBytes ahead (into L1) in the `size`-byte array `values`. Each row is loaded (and, bf16,
// split) once for the G queries, and their 2G-4G accumulator chains are independent, where
// one query's two chains (32 bf16 columns) wait on the FMA latency row after row. Each query's columns are summed
// over the rows in order, as value_rows does: the same bits.
template <int G>
DCP_AVX512 inline void value_rows_group(const bf16* values, const float* const* p, int64_t r0, int64_t r1, int64_t dv,
                                        int64_t c, bool prefetch, int64_t size, __m512 (*a)[4]) {
  const __mmask32 m0 = tail32(dv, c), m1 = tail32(dv, c + 32);
  const int64_t width = std::min<int64_t>(dv - c, 64) * 2;
  // The accumulators in locals and two loops (32 columns or 64), so that GCC keeps them in registers: updated
  // through `a` under a condition they went to the stack at every row.
  __m512 e0[G], o0[G], e1[G], o1[G];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) e0[g] = a[g][0], o0[g] = a[g][1], e1[g] = a[g][2], o1[g] = a[g][3];
  if (m1 == 0) {
    for (int64_t r = r0; r < r1; ++r) {
      if (prefetch) prefetch_bytes(values, (r * dv + c) * 2 + kPrefetchBytes, width, size);
      const __m512i x0 = load32(values + r * dv + c, m0);
      const __m512 e = even_columns(x0), o = odd_columns(x0);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        const __m512 pb = _mm512_set1_ps(p[g][r]);
        e0[g] = _mm512_fmadd_ps(pb, e, e0[g]);
        o0[g] = _mm512_fmadd_ps(pb, o, o0[g]);
      }
    }
  } else {
    for (int64_t r = r0; r < r1; ++r) {
      if (prefetch) prefetch_bytes(values, (r * dv + c) * 2 + kPrefetchBytes, width, size);
      const __m512i x0 = load32(values + r * dv + c, m0), x1 = load32(values + r * dv + c + 32, m1);
      const __m512 ea = even_columns(x0), oa = odd_columns(x0), eb = even_columns(x1), ob = odd_columns(x1);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        const __m512 pb = _mm512_set1_ps(p[g][r]);
        e0[g] = _mm512_fmadd_ps(pb, ea, e0[g]);
        o0[g] = _mm512_fmadd_ps(pb, oa, o0[g]);
        e1[g] = _mm512_fmadd_ps(pb, eb, e1[g]);
        o1[g] = _mm512_fmadd_ps(pb, ob, o1[g]);
      }
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) a[g][0] = e0[g], a[g][1] = o0[g], a[g][2] = e1[g], a[g][3] = o1[g];
}

template <int G>
DCP_AVX512 inline void value_rows_group(const float* values, const float* const* p, int64_t r0, int64_t r1, int64_t dv,
                                        int64_t c, bool prefetch, int64_t size, __m512 (*a)[4]) {
  const __mmask16 m[4] = {tail(dv, c), tail(dv, c + kLanes), tail(dv, c + 2 * kLanes), tail(dv, c + 3 * kLanes)};
  const int64_t width = std::min<int64_t>(dv - c, 4 * kLanes);
  __m512 l[G][4];  // in locals, as for bf16
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) l[g][0] = a[g][0], l[g][1] = a[g][1], l[g][2] = a[g][2], l[g][3] = a[g][3];
  for (int64_t r = r0; r < r1; ++r) {
    const float* v = values + r * dv;
    if (prefetch) prefetch_bytes(values, (r * dv + c) * 4 + kPrefetchBytes, width * 4, size);
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      if (k * kLanes >= width) break;
      const __m512 x = simd::load(v + c + k * kLanes, m[k]);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) l[g][k] = _mm512_fmadd_ps(_mm512_set1_ps(p[g][r]), x, l[g][k]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) a[g][0] = l[g][0], a[g][1] = l[g][1], a[g][2] = l[g][2], a[g][3] = l[g][3];
}

// Pass 3's accumulation of one query's value rows [r0, r1) (p[r] their weights) into the 64 value columns [c, c +
// 64): value_rows_group for one query.
template <class T>
DCP_AVX512 inline void value_rows(const T* values, const float* p, int64_t r0, int64_t r1, int64_t dv, int64_t c,
                                  bool prefetch, int64_t size, __m512 (&a)[4]) {
  const float* const one[1] = {p};
  value_rows_group<1>(values, one, r0, r1, dv, c, prefetch, size, &a);
}

// Queries [t0, t0 + G) of a block over the value rows [i, tile_end) they all read, in registers, then each alone
// over the rest of its rows in the tile; accumulators in accs (4 x 16 floats per query) between tiles.
template <class T, int G>
DCP_AVX512 inline void value_tile_group(const Query<T>* qb, int64_t t0, int64_t i, int64_t tile_end, const T* values,
                                        int64_t dv, int64_t c, int64_t size, float* accs) {
  __m512 a[G][4];
  const float* p[G];
  int64_t common = tile_end;
  for (int g = 0; g < G; ++g) {
    for (int k = 0; k < 4; ++k) a[g][k] = _mm512_loadu_ps(accs + ((t0 + g) * 4 + k) * kLanes);
    p[g] = qb[t0 + g].scores;
    common = std::min(common, qb[t0 + g].n);
  }
  if (common > i) value_rows_group<G>(values, p, i, common, dv, c, t0 == 0, size, a);
  for (int g = 0; g < G; ++g) {
    const int64_t end = std::min(tile_end, qb[t0 + g].n);
    if (end > std::max(i, common)) value_rows(values, p[g], std::max(i, common), end, dv, c, false, size, a[g]);
    for (int k = 0; k < 4; ++k) _mm512_storeu_ps(accs + ((t0 + g) * 4 + k) * kLanes, a[g][k]);
  }
}

// out's columns [c, c + 64) from value_rows' accumulators, times inv.
DCP_AVX512 inline void store_values(const __m512* a, int64_t dv, int64_t c, float inv, float* out) {
  const __m512 iv = _mm512_set1_ps(inv);
  for (int k = 0; k < 4 && c + k * kLanes < dv; ++k) {  // no pointer formed past the row
    simd::store(out + c + k * kLanes, _mm512_mul_ps(a[k], iv), tail(dv, c + k * kLanes));
  }
}

DCP_AVX512 inline void store_values(const __m512* a, int64_t dv, int64_t c, float inv, bf16* out) {
  alignas(64) float half[4][kLanes];
  alignas(64) float cols[64];
  const __m512 iv = _mm512_set1_ps(inv);
  for (int k = 0; k < 4; ++k) _mm512_store_ps(half[k], _mm512_mul_ps(a[k], iv));
  for (int h = 0; h < 2; ++h) {
    for (int l = 0; l < kLanes; ++l) {
      cols[32 * h + 2 * l] = half[2 * h][l];
      cols[32 * h + 2 * l + 1] = half[2 * h + 1][l];
    }
  }
  for (int64_t k = 0; k < 64 && c + k < dv; k += kLanes) simd::store(out + c + k, _mm512_load_ps(cols + k), tail(dv, c + k));
}

// Value rows per tile of pass 3 when several queries share them: 64 rows of 32 bf16 columns are 4 KiB, read from
// memory by the first query and from L1 by the others.
constexpr int64_t kValueTile = 64;
// Queries whose pass 3 runs together over a tile (value_rows_group): 4 give 8 independent accumulator chains for 32
// bf16 value columns, what two FMA units of 4 cycles' latency keep busy; 16 registers for 64 columns.
constexpr int kValueGroup = 4;

// The queries of one block (attend_queries), with their pass 1 maxima and pass 2 sums.
template <class T, bool kDot>
DCP_AVX512 inline void attend(const Query<T>* qb, int64_t count, const T* keys, const T* values, const float* bias,
                              int64_t d, int64_t dv, float scale, float* scratch) {
  if (count < 1 || count > kMaxQueries) {  // mx and inv below hold kMaxQueries
    throw std::invalid_argument("decode_simd::attend_queries: count " + std::to_string(count) + " outside [1, 16]");
  }
  // scratch: per query its scaled query (d rounded up to 32 floats; the FMA paths) and its pass-3 accumulators.
  const int64_t dq = (d + 31) / 32 * 32;
  // (The vdpbf16ps path reads the bf16 query itself and one query keeps its accumulators in registers: scratch may
  // then be null, and no pointer is formed from it.)
  auto qs = [&](int64_t t) { return kDot ? nullptr : scratch + t * dq; };
  float* accs = count > 1 ? scratch + (kDot ? 0 : count * dq) : nullptr;
  if constexpr (!kDot) {
    for (int64_t t = 0; t < count; ++t) scaled_query<T>(qb[t].q, d, scale, qs(t));
  }
  int64_t n_max = 0;
  for (int64_t t = 0; t < count; ++t) n_max = std::max(n_max, qb[t].n);
  // Pass 1: scores (cache rows with their bias, 16 at a time, then the token itself) and their maximum. Each block
  // of 16 key rows is read from memory once and from L1 by the block's other queries; a query stops at its own n.
  __m512 mx[kMaxQueries];
  for (int64_t t = 0; t < count; ++t) mx[t] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T));  // d >= 1 (KvCache's head_dim)
  const int64_t ahead_rows = kPrefetchBytes / row_bytes;
  for (int64_t i = 0; i < n_max; i += kRows) {
    // The block kPrefetchBytes ahead of this one, and its biases.
    prefetch_bytes(keys, i * row_bytes + kPrefetchBytes, kRows * row_bytes, n_max * row_bytes);
    if (bias != nullptr) prefetch_bytes(bias, (i + ahead_rows) * 4, kRows * 4, n_max * 4);
    for (int64_t t = 0; t < count; ++t) {
      if (qb[t].n <= i) continue;
      mx[t] = block_scores<T, kDot>(qb[t].q, qs(t), keys + i * d, bias + i, d, std::min<int64_t>(kRows, qb[t].n - i),
                                    scale, qb[t].scores + i, mx[t]);
    }
  }
  float inv[kMaxQueries];
  for (int64_t t = 0; t < count; ++t) {
    const Query<T>& x = qb[t];
    mx[t] = block_scores<T, kDot>(x.q, qs(t), x.k_new, nullptr, d, 1, scale, x.scores + x.n, mx[t]);
    // Pass 2: p = exp(s - max) in place, and their sum (masked lanes add nothing).
    const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mx[t]));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t r = 0; r <= x.n; r += kLanes) {
      const __mmask16 mk = tail(x.n + 1, r);
      const __m512 p = _mm512_maskz_mov_ps(mk, simd::exp(_mm512_sub_ps(simd::load(x.scores + r, mk), mv)));
      _mm512_mask_storeu_ps(x.scores + r, mk, p);
      sum = _mm512_add_ps(sum, p);
    }
    inv[t] = 1.0f / _mm512_reduce_add_ps(sum);
  }
  // Pass 3: sum_i p_i v_i / sum_i p_i, 64 value columns at a time. One query sweeps its rows in one go; several
  // take each tile of kValueTile rows in turn (the first query prefetching), keeping their accumulators in scratch
  // between tiles. Each query's columns are summed over its rows in order, then its own value, as one query alone.
  const int64_t size = n_max * dv * static_cast<int64_t>(sizeof(T));
  for (int64_t c = 0; c < dv; c += 64) {
    if (count == 1) {
      __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      value_rows(values, qb[0].scores, 0, qb[0].n, dv, c, true, size, a);
      value_rows(qb[0].v_new, qb[0].scores + qb[0].n, 0, 1, dv, c, false, 0, a);  // the token's own value
      store_values(a, dv, c, inv[0], qb[0].out);
      continue;
    }
    for (int64_t t = 0; t < count; ++t) {
      for (int k = 0; k < 4; ++k) _mm512_storeu_ps(accs + (t * 4 + k) * kLanes, _mm512_setzero_ps());
    }
    for (int64_t i = 0; i < n_max; i += kValueTile) {
      const int64_t tile_end = std::min(i + kValueTile, n_max);
      int64_t t = 0;
      for (; t + kValueGroup <= count; t += kValueGroup) {
        value_tile_group<T, kValueGroup>(qb, t, i, tile_end, values, dv, c, size, accs);
      }
      switch (count - t) {  // the last queries, fewer than a group
        case 3: value_tile_group<T, 3>(qb, t, i, tile_end, values, dv, c, size, accs); break;
        case 2: value_tile_group<T, 2>(qb, t, i, tile_end, values, dv, c, size, accs); break;
        case 1: value_tile_group<T, 1>(qb, t, i, tile_end, values, dv, c, size, accs); break;
        default: break;
      }
    }
    for (int64_t t = 0; t < count; ++t) {
      __m512 a[4];
      for (int k = 0; k < 4; ++k) a[k] = _mm512_loadu_ps(accs + (t * 4 + k) * kLanes);
      value_rows(qb[t].v_new, qb[t].scores + qb[t].n, 0, 1, dv, c, false, 0, a);
      store_values(a, dv, c, inv[t], qb[t].out);
    }
  }
}

}  // namespace

template <class T>
void attend_queries(const Query<T>* queries, int64_t count, const T* keys, const T* values, const float* bias, int64_t d,
                    int64_t dv, float scale, float* scratch) {
  attend<T, false>(queries, count, keys, values, bias, d, dv, scale, scratch);
}

// The vdpbf16ps instances carry the avx512bf16 target themselves (callers check cpu_features().avx512_bf16).
DCP_AVX512_BF16 void attend_queries_dot(const Query<bf16>* queries, int64_t count, const bf16* keys, const bf16* values,
                                        const float* bias, int64_t d, int64_t dv, float scale, float* scratch) {
  attend<bf16, true>(queries, count, keys, values, bias, d, dv, scale, scratch);
}

template <class T>
void attend_pair(const T* q, const T* keys, const T* values, const float* bias, int64_t n, const T* k_new,
                 const T* v_new, int64_t d, int64_t dv, float scale, float* qs, float* scores, T* out) {
  const Query<T> one{q, k_new, v_new, n, scores, out};
  attend<T, false>(&one, 1, keys, values, bias, d, dv, scale, qs);  // one query: scratch is its scaled query
}

DCP_AVX512_BF16 void attend_pair_dot(const bf16* q, const bf16* keys, const bf16* values, const float* bias, int64_t n,
                                     const bf16* k_new, const bf16* v_new, int64_t d, int64_t dv, float scale,
                                     float* scores, bf16* out) {
  const Query<bf16> one{q, k_new, v_new, n, scores, out};
  attend<bf16, true>(&one, 1, keys, values, bias, d, dv, scale, nullptr);
}

template void attend_queries<float>(const Query<float>*, int64_t, const float*, const float*, const float*, int64_t,
                                    int64_t, float, float*);
template void attend_queries<bf16>(const Query<bf16>*, int64_t, const bf16*, const bf16*, const float*, int64_t, int64_t,
                                   float, float*);
template void attend_pair<float>(const float*, const float*, const float*, const float*, int64_t, const float*,
                                 const float*, int64_t, int64_t, float, float*, float*, float*);
template void attend_pair<bf16>(const bf16*, const bf16*, const bf16*, const float*, int64_t, const bf16*, const bf16*,
                                int64_t, int64_t, float, float*, float*, bf16*);

}  // namespace dcp::decode_simd
