// AVX-512F helpers shared by the fused elementwise kernels: 16 lanes of fp32 loaded from and stored to fp32 or
// bf16 rows, with a mask for the tail. Every function carries the target attribute itself (no -mavx512f for
// the files that include this), so callers must check avx512_usable() (dcp/cpu_features.h) before calling any of them.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

#define DCP_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

namespace dcp::simd {

constexpr int64_t kLanes = 16;

DCP_AVX512 inline __mmask16 lanes_below(int64_t count) {
  return count >= kLanes ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << count) - 1u);
}

// The loads and stores below take a lane mask for the edges of a row but issue plain (unmasked) instructions when
// all 16 lanes are wanted: on the AMD EPYC (Zen 5) measured, the hardware prefetchers did not follow masked
// AVX-512 loads, and copying 64 strided rows of 64 floats from memory took 2-3x as long with full-mask masked
// loads as with plain ones (docs/flexformer.md "Performance").
DCP_AVX512 inline __m512 load(const float* p, __mmask16 m) {
  return m == 0xffff ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p);
}

DCP_AVX512 inline __m512 load(const c10::BFloat16* p, __mmask16 m) {
  const __m256i bits = m == 0xffff ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                                   : _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

DCP_AVX512 inline void store(float* p, __m512 x, __mmask16 m) {
  if (m == 0xffff) return _mm512_storeu_ps(p, x);
  _mm512_mask_storeu_ps(p, m, x);
}

// Round to nearest even, as c10::BFloat16(float) does (NaN stays a quiet NaN), with AVX-512F integer ops so that
// CPUs without AVX512-BF16 run it too.
DCP_AVX512 inline void store(c10::BFloat16* p, __m512 x, __mmask16 m) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  if (m == 0xffff) return _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(r));
}

// 2^x: x = n + f with n = round(x), |f| <= 1/2, 2^f by its degree-6 Taylor polynomial in f ln 2 (relative
// error 1.2e-7, about one fp32 ulp), 2^n applied exactly by vscalefps. Arguments are clamped below at -200 (2^-200
// is 0 in fp32), which turns -inf into 0; max(lo, x) keeps a NaN x (vmaxps returns its second operand then).
DCP_AVX512 inline __m512 exp2(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-200.0f), x);
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393381609e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// e^x through exp2 (e^x = 2^(x log2 e)); same accuracy and clamping as exp2.
DCP_AVX512 inline __m512 exp(__m512 x) { return exp2(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f))); }

// sin x and cos x together (Cephes sinf / cosf, Moshier 1989, on AVX-512): x = j pi/2 + r with j = round(2x/pi) and
// r reduced in three steps (Cody & Waite 1980; pi/2 = 1.5703125 + 4.837512969970703125e-4 + 7.54978995489188216e-8,
// the first two exact in few bits, so j times them is exact for |j| < 2^15), |r| <= pi/4; sin r and cos r by
// Cephes' minimax polynomials (about 1 ulp); the quadrant j mod 4 swaps them and sets the signs. Accurate for
// |x| < 8192 (beyond, the phase error grows like |x| 2^-24). NaN in gives NaN out.
DCP_AVX512 inline void sincos(__m512 x, __m512* sin_out, __m512* cos_out) {
  const __m512 j = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.63661977236758134f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(j, _mm512_set1_ps(1.5703125f), x);
  r = _mm512_fnmadd_ps(j, _mm512_set1_ps(4.837512969970703125e-4f), r);
  r = _mm512_fnmadd_ps(j, _mm512_set1_ps(7.54978995489188216e-8f), r);
  const __m512 r2 = _mm512_mul_ps(r, r);
  // sin r = r + r^3 (s0 + r^2 (s1 + r^2 s2)); cos r = 1 - r^2 / 2 + r^4 (c0 + r^2 (c1 + r^2 c2)).
  __m512 ps = _mm512_fmadd_ps(_mm512_set1_ps(-1.9515295891e-4f), r2, _mm512_set1_ps(8.3321608736e-3f));
  ps = _mm512_fmadd_ps(ps, r2, _mm512_set1_ps(-1.6666654611e-1f));
  const __m512 s = _mm512_fmadd_ps(_mm512_mul_ps(ps, r2), r, r);
  __m512 pc = _mm512_fmadd_ps(_mm512_set1_ps(2.443315711809948e-5f), r2, _mm512_set1_ps(-1.388731625493765e-3f));
  pc = _mm512_fmadd_ps(pc, r2, _mm512_set1_ps(4.166664568298827e-2f));
  const __m512 c =
      _mm512_fmadd_ps(pc, _mm512_mul_ps(r2, r2), _mm512_fnmadd_ps(r2, _mm512_set1_ps(0.5f), _mm512_set1_ps(1.0f)));
  // Quadrant q = j mod 4: (sin, cos) = (s, c), (c, -s), (-s, -c), (-c, s).
  const __m512i q = _mm512_cvtps_epi32(j);
  const __mmask16 swap = _mm512_test_epi32_mask(q, _mm512_set1_epi32(1));
  const __m512i sin_sign = _mm512_slli_epi32(_mm512_and_si512(q, _mm512_set1_epi32(2)), 30);
  const __m512i cos_sign =
      _mm512_slli_epi32(_mm512_and_si512(_mm512_add_epi32(q, _mm512_set1_epi32(1)), _mm512_set1_epi32(2)), 30);
  const __m512 sv = _mm512_mask_blend_ps(swap, s, c);
  const __m512 cv = _mm512_mask_blend_ps(swap, c, s);
  *sin_out = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(sv), sin_sign));
  *cos_out = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(cv), cos_sign));
}

// The logistic function 1 / (1 + e^-x) through exp2 (e^-x = 2^(-x log2 e)); saturates to 0 and 1. The
// reciprocal is vrcp14ps refined by one Newton step (relative error ~2^-28 instead of a 14-cycle division).
DCP_AVX512 inline __m512 sigmoid(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  // e^-x is capped at 2^80 so that 1 + e^-x stays finite for the reciprocal (sigmoid < 1e-24 there);
  // min(cap, y) keeps a NaN y.
  const __m512 y = _mm512_min_ps(_mm512_set1_ps(80.0f), _mm512_mul_ps(x, _mm512_set1_ps(-1.4426950408889634f)));
  const __m512 d = _mm512_add_ps(one, exp2(y));
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
}

}  // namespace dcp::simd
