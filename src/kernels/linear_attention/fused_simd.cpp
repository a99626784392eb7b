// The fused linear-attention kernel's elementwise steps with transcendental functions (fused_tiles.h): AVX-512
// versions (kernels/simd.h: sincos, exp) carrying their own target attributes, and portable loops.
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

DCP_AVX512 void elu_select(float* pt, const float* at, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = lanes_below(n - i);
    const __m512 a = _mm512_maskz_loadu_ps(m, at + i);
    const __mmask16 pos = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GT_OQ);
    _mm512_mask_storeu_ps(pt + i, m & pos, _mm512_add_ps(a, one));
  }
}

DCP_AVX512 void elu_grad(float* da, const float* dphi, const float* at, const float* pt, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 m = lanes_below(n - i);
    const __mmask16 pos = _mm512_cmp_ps_mask(_mm512_maskz_loadu_ps(m, at + i), _mm512_setzero_ps(), _CMP_GT_OQ);
    const __m512 slope = _mm512_mask_blend_ps(pos, _mm512_maskz_loadu_ps(m, pt + i), one);
    _mm512_mask_storeu_ps(da + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, dphi + i), slope));
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
      _mm512_mask_storeu_ps(dst + r * ldd + c, m, simd::load(src + r * lds + c, m));
    }
  }
}

void load_rows(const float* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd) {
  load_rows_any(src, lds, rows, cols, dst, ldd);
}
void load_rows(const c10::BFloat16* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd) {
  load_rows_any(src, lds, rows, cols, dst, ldd);
}
void transpose(const float* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd) {
  tiles::transpose_rows_avx512<float>(src, lds, rows, cols, dst, ldd);
}
void store_transposed(const float* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd) {
  tiles::store_transposed_avx512<float>(src, lds, rows, cols, dst, ldd);
}
void store_transposed(const float* src, int64_t lds, int64_t rows, int64_t cols, c10::BFloat16* dst, int64_t ldd) {
  tiles::store_transposed_avx512<c10::BFloat16>(src, lds, rows, cols, dst, ldd);
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
