// The decode kernel's AVX-512 path (decode_attention_simd.h). The portable loops of decode_attention.cpp are its
// twin; tests/unit/test_serve_batching.cpp forces both and compares them with the fp64 reference.
#include "infer/decode_attention_simd.h"

#include <immintrin.h>

#include <algorithm>
#include <limits>

#include "kernels/simd.h"

namespace dcp::decode_simd {
namespace {

using simd::kLanes;

// The lanes of a 16-wide block starting at `at` that lie below `count` (none when at >= count).
DCP_AVX512 inline __mmask16 tail(int64_t count, int64_t at) {
  return at >= count ? static_cast<__mmask16>(0) : simd::lanes_below(count - at);
}

// <q, row> over d elements: 16-lane FMAs, then one lane reduction (a fixed tree: _mm512_reduce_add_ps).
template <class T>
DCP_AVX512 inline float dot(const float* q, const T* row, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < d; j += kLanes) {
    const __mmask16 m = tail(d, j);
    acc = _mm512_fmadd_ps(simd::load(q + j, m), simd::load(row + j, m), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

template <class T>
DCP_AVX512 void attend_pair_avx512(const T* q, const T* keys, const T* values, const float* bias, int64_t n,
                                   const T* k_new, const T* v_new, int64_t d, int64_t dv, float scale, float* qs,
                                   float* scores, T* out) {
  // The scaled query in fp32 (qs: d floats), read back from L1 for every row.
  for (int64_t j = 0; j < d; j += kLanes) {
    const __mmask16 m = tail(d, j);
    simd::store(qs + j, _mm512_mul_ps(simd::load(q + j, m), _mm512_set1_ps(scale)), m);
  }
  // Pass 1: scores (cache rows with their bias, then the token itself), and their maximum.
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t u = 0; u < kLanes; ++u) scores[i + u] = dot(qs, keys + (i + u) * d, d);
    const __m512 s = _mm512_add_ps(_mm512_loadu_ps(scores + i), _mm512_loadu_ps(bias + i));
    _mm512_storeu_ps(scores + i, s);
    mx = _mm512_max_ps(mx, s);
  }
  for (; i < n; ++i) scores[i] = dot(qs, keys + i * d, d) + bias[i];
  scores[n] = dot(qs, k_new, d);
  float m = _mm512_reduce_max_ps(mx);
  for (int64_t r = (n / kLanes) * kLanes; r <= n; ++r) m = std::max(m, scores[r]);
  // Pass 2: p = exp(s - max) in place, and their sum (masked lanes add nothing).
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t r = 0; r <= n; r += kLanes) {
    const __mmask16 mk = tail(n + 1, r);
    const __m512 p = _mm512_maskz_mov_ps(mk, simd::exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, scores + r), mv)));
    _mm512_mask_storeu_ps(scores + r, mk, p);
    sum = _mm512_add_ps(sum, p);
  }
  const float inv = 1.0f / _mm512_reduce_add_ps(sum);
  // Pass 3: sum_i p_i v_i, four 16-lane accumulators (64 value columns) per sweep over the rows.
  for (int64_t c = 0; c < dv; c += 4 * kLanes) {
    const __mmask16 m0 = tail(dv, c), m1 = tail(dv, c + kLanes), m2 = tail(dv, c + 2 * kLanes),
                    m3 = tail(dv, c + 3 * kLanes);
    const int64_t width = std::min<int64_t>(dv - c, 4 * kLanes);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t r = 0; r <= n; ++r) {
      const T* v = r < n ? values + r * dv : v_new;  // row n is the token's own value
      const __m512 pb = _mm512_set1_ps(scores[r]);
      a0 = _mm512_fmadd_ps(pb, simd::load(v + c, m0), a0);
      if (width > kLanes) a1 = _mm512_fmadd_ps(pb, simd::load(v + c + kLanes, m1), a1);
      if (width > 2 * kLanes) a2 = _mm512_fmadd_ps(pb, simd::load(v + c + 2 * kLanes, m2), a2);
      if (width > 3 * kLanes) a3 = _mm512_fmadd_ps(pb, simd::load(v + c + 3 * kLanes, m3), a3);
    }
    const __m512 iv = _mm512_set1_ps(inv);
    simd::store(out + c, _mm512_mul_ps(a0, iv), m0);
    if (width > kLanes) simd::store(out + c + kLanes, _mm512_mul_ps(a1, iv), m1);
    if (width > 2 * kLanes) simd::store(out + c + 2 * kLanes, _mm512_mul_ps(a2, iv), m2);
    if (width > 3 * kLanes) simd::store(out + c + 3 * kLanes, _mm512_mul_ps(a3, iv), m3);
  }
}

}  // namespace

template <class T>
void attend_pair(const T* q, const T* keys, const T* values, const float* bias, int64_t n, const T* k_new,
                 const T* v_new, int64_t d, int64_t dv, float scale, float* qs, float* scores, T* out) {
  attend_pair_avx512<T>(q, keys, values, bias, n, k_new, v_new, d, dv, scale, qs, scores, out);
}

template void attend_pair<float>(const float*, const float*, const float*, const float*, int64_t, const float*,
                                 const float*, int64_t, int64_t, float, float*, float*, float*);
template void attend_pair<c10::BFloat16>(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*,
                                         const float*, int64_t, const c10::BFloat16*, const c10::BFloat16*, int64_t,
                                         int64_t, float, float*, float*, c10::BFloat16*);

}  // namespace dcp::decode_simd
