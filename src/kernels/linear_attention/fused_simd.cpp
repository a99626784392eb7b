// The fused linear-attention kernel's elementwise steps with transcendental functions (fused_tiles.h): AVX-512
// versions (kernels/simd.h: sincos, exp) carrying their own target attributes, and portable loops.
#include <algorithm>
#include <cmath>

#include "kernels/attention/tile_io.h"
#include "kernels/linear_attention/fused_tiles.h"
#include "kernels/simd.h"

namespace dcp::linear_attention::fused {
namespace {

DCP_AVX512 void sincos_avx512(const float* u, int64_t n, float scale, float* cos_out, float* sin_out) {
  const __m512 vs = _mm512_set1_ps(scale);
  for (int64_t t = 0; t < n; t += simd::kLanes) {
    const __mmask16 mask = simd::lanes_below(n - t);
    __m512 s, c;
    simd::sincos(_mm512_maskz_loadu_ps(mask, u + t), &s, &c);
    _mm512_mask_storeu_ps(cos_out + t, mask, _mm512_mul_ps(c, vs));
    _mm512_mask_storeu_ps(sin_out + t, mask, _mm512_mul_ps(s, vs));
  }
}

DCP_AVX512 void exp_avx512(const float* x, int64_t n, float* out) {
  for (int64_t t = 0; t < n; t += simd::kLanes) {
    const __mmask16 mask = simd::lanes_below(n - t);
    _mm512_mask_storeu_ps(out + t, mask, simd::exp(_mm512_maskz_loadu_ps(mask, x + t)));
  }
}

template <class T>
void sincos_portable(const T* u, int64_t n, T scale, T* cos_out, T* sin_out) {
  for (int64_t t = 0; t < n; ++t) {
    const T x = u[t];
    cos_out[t] = scale * std::cos(x);
    sin_out[t] = scale * std::sin(x);
  }
}

template <class T>
void exp_portable(const T* x, int64_t n, T* out) {
  for (int64_t t = 0; t < n; ++t) out[t] = std::exp(x[t]);
}

}  // namespace

void sincos_scaled(const float* u, int64_t n, float scale, float* cos_out, float* sin_out, bool simd) {
  if (simd) return sincos_avx512(u, n, scale, cos_out, sin_out);
  sincos_portable(u, n, scale, cos_out, sin_out);
}

void sincos_scaled(const double* u, int64_t n, double scale, double* cos_out, double* sin_out, bool /*simd*/) {
  sincos_portable(u, n, scale, cos_out, sin_out);
}

void exp_rows(const float* x, int64_t n, float* out, bool simd) {
  if (simd) return exp_avx512(x, n, out);
  exp_portable(x, n, out);
}

void exp_rows(const double* x, int64_t n, double* out, bool /*simd*/) { exp_portable(x, n, out); }

namespace avx512 {

using simd::kLanes;
using simd::lanes_below;

DCP_AVX512 void axpy(float* y, const float* x, float a, int64_t n) {
  const __m512 va = _mm512_set1_ps(a);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = lanes_below(n - i);
    _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i)));
  }
}

DCP_AVX512 void add_scalar(float* y, float a, int64_t n) {
  const __m512 va = _mm512_set1_ps(a);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = lanes_below(n - i);
    _mm512_mask_storeu_ps(y + i, m, _mm512_add_ps(va, _mm512_maskz_loadu_ps(m, y + i)));
  }
}

DCP_AVX512 float sum(const float* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(lanes_below(n - i), x + i));
  return _mm512_reduce_add_ps(acc);
}

DCP_AVX512 float dot(const float* x, const float* y, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = lanes_below(n - i);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

DCP_AVX512 void mul(float* dst, const float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = lanes_below(n - i);
    _mm512_mask_storeu_ps(dst + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i)));
  }
}

DCP_AVX512 void fma_into(float* acc, const float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = lanes_below(n - i);
    _mm512_mask_storeu_ps(acc + i, m,
                          _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i),
                                          _mm512_maskz_loadu_ps(m, acc + i)));
  }
}

DCP_AVX512 void cross(float* dst, const float* a, const float* b, const float* c, const float* d, float s,
                      int64_t n) {
  const __m512 vs = _mm512_set1_ps(s);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = lanes_below(n - i);
    const __m512 ab = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i));
    const __m512 v = _mm512_fnmadd_ps(_mm512_maskz_loadu_ps(m, c + i), _mm512_maskz_loadu_ps(m, d + i), ab);
    _mm512_mask_storeu_ps(dst + i, m, _mm512_mul_ps(vs, v));
  }
}

DCP_AVX512 void scaled_sum(float* dst, const float* a, const float* b, float s, int64_t n) {
  const __m512 vs = _mm512_set1_ps(s);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = lanes_below(n - i);
    _mm512_mask_storeu_ps(dst + i, m,
                          _mm512_mul_ps(vs, _mm512_add_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i))));
  }
}

DCP_AVX512 void elu_map(float* at, float* pt, const float* g, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = lanes_below(n - i);
    const __m512 a = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, at + i), _mm512_maskz_loadu_ps(m, g + i));
    const __mmask16 pos = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GT_OQ);
    _mm512_mask_storeu_ps(at + i, m, a);
    _mm512_mask_storeu_ps(pt + i, m, _mm512_mask_blend_ps(pos, simd::exp(a), _mm512_add_ps(a, one)));
  }
}

DCP_AVX512 void elu_grad_dot(float* da, const float* dphi, const float* at, const float* pt, float* dot, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = lanes_below(n - i);
    const __m512 a = _mm512_maskz_loadu_ps(m, at + i);
    const __mmask16 pos = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GT_OQ);
    const __m512 slope = _mm512_mask_blend_ps(pos, _mm512_maskz_loadu_ps(m, pt + i), one);
    const __m512 g = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, dphi + i), slope);
    _mm512_mask_storeu_ps(da + i, m, g);
    _mm512_mask_storeu_ps(dot + i, m, _mm512_fmadd_ps(a, g, _mm512_maskz_loadu_ps(m, dot + i)));
  }
}

DCP_AVX512 void cond_backward(float* dx, const float* da, const float* a, const float* g, const float* dot,
                              float kappa, int64_t n) {
  const __m512 vk = _mm512_set1_ps(kappa);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = lanes_below(n - i);
    const __m512 kd = _mm512_mul_ps(vk, _mm512_maskz_loadu_ps(m, dot + i));
    const __m512 v = _mm512_fnmadd_ps(kd, _mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, da + i));
    _mm512_mask_storeu_ps(dx + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, g + i), v));
  }
}

template <class In>
DCP_AVX512 void load_rows_any(const In* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; c += kLanes) {
      const __mmask16 m = lanes_below(cols - c);
      simd::store(dst + r * ldd + c, simd::load(src + r * lds + c, m), m);
    }
  }
}

void load_rows(const float* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd) {
  load_rows_any(src, lds, rows, cols, dst, ldd);
}
void load_rows(const c10::BFloat16* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd) {
  load_rows_any(src, lds, rows, cols, dst, ldd);
}
// A 16 x 16 block in registers, transposed in place: r[i] holds row i before and column i after (unpacks of
// lanes, then of lane pairs, then two rounds of 128-bit lane shuffles; 64 shuffles where the gather-based copy
// of tile_io.cpp issues 16 gathers of 16 loads each).
DCP_AVX512 inline void transpose16(__m512 r[16]) {
  __m512 t[16];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  // r[4 i + j] now holds, in 128-bit lane l, element j of rows 4 i .. 4 i + 3 at columns 4 l + j... regrouped below.
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const __m512 a = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88), b = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
    const __m512 c = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
    const __m512 d = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
    t[j] = _mm512_shuffle_f32x4(a, c, 0x88);
    t[8 + j] = _mm512_shuffle_f32x4(a, c, 0xdd);
    t[4 + j] = _mm512_shuffle_f32x4(b, d, 0x88);
    t[12 + j] = _mm512_shuffle_f32x4(b, d, 0xdd);
  }
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// dst[c][r] = src[r][c] for r < rows, c < cols, by 16 x 16 blocks (masked at the edges), converted on the way;
// with `sumsq`, also sumsq[r] += sum_c src[r][c]^2, one fma per c in increasing c.
template <class In, class Out>
DCP_AVX512 void transpose_blocks(const In* src, int64_t lds, int64_t rows, int64_t cols, Out* dst, int64_t ldd,
                                 float* sumsq = nullptr) {
  for (int64_t r0 = 0; r0 < rows; r0 += kLanes) {
    const int64_t nr = std::min<int64_t>(kLanes, rows - r0);
    const __mmask16 row_mask = lanes_below(nr);
    __m512 acc = sumsq ? _mm512_maskz_loadu_ps(row_mask, sumsq + r0) : _mm512_setzero_ps();
    for (int64_t c0 = 0; c0 < cols; c0 += kLanes) {
      const int64_t nc = std::min<int64_t>(kLanes, cols - c0);
      const __mmask16 col_mask = lanes_below(nc);
      __m512 r[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        r[i] = i < nr ? simd::load(src + (r0 + i) * lds + c0, col_mask) : _mm512_setzero_ps();
      }
      transpose16(r);
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        if (i < nc) simd::store(dst + (c0 + i) * ldd + r0, r[i], row_mask);
      }
      if (sumsq) {
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) {
          if (i < nc) acc = _mm512_fmadd_ps(r[i], r[i], acc);
        }
      }
    }
    if (sumsq) _mm512_mask_storeu_ps(sumsq + r0, row_mask, acc);
  }
}

void transpose(const float* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd) {
  transpose_blocks(src, lds, rows, cols, dst, ldd);
}
void load_transposed(const float* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd,
                     float* sumsq) {
  transpose_blocks(src, lds, rows, cols, dst, ldd, sumsq);
}
void load_transposed(const c10::BFloat16* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd,
                     float* sumsq) {
  transpose_blocks(src, lds, rows, cols, dst, ldd, sumsq);
}
void store_transposed(const float* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd) {
  transpose_blocks(src, lds, cols, rows, dst, ldd);
}
void store_transposed(const float* src, int64_t lds, int64_t rows, int64_t cols, c10::BFloat16* dst, int64_t ldd) {
  transpose_blocks(src, lds, cols, rows, dst, ldd);
}
void store_rows(const float* src, int64_t lds, int64_t rows, int64_t cols, const float* scale, float* dst,
                int64_t ldd) {
  tiles::store_rows_avx512<float>(src, lds, rows, cols, scale, dst, ldd);
}
void store_rows(const float* src, int64_t lds, int64_t rows, int64_t cols, const float* scale, c10::BFloat16* dst,
                int64_t ldd) {
  tiles::store_rows_avx512<c10::BFloat16>(src, lds, rows, cols, scale, dst, ldd);
}

}  // namespace avx512

}  // namespace dcp::linear_attention::fused
