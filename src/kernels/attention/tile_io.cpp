#include "kernels/attention/tile_io.h"

#include "kernels/simd.h"

namespace dcp::tiles {
namespace {

using simd::kLanes;
using simd::lanes_below;

// Lane i = i * stride (element offsets of 16 consecutive rows).
DCP_AVX512 inline __m512i row_offsets(int64_t stride) {
  return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                            _mm512_set1_epi32(static_cast<int>(stride)));
}

DCP_AVX512 inline void store_halves(c10::BFloat16* dst, __m512i halves, __mmask16 m) {
  _mm256_mask_storeu_epi16(dst, m, _mm512_cvtepi32_epi16(halves));
}

}  // namespace

template <class T>
DCP_AVX512 void store_rows_avx512(const float* src, int64_t lds, int64_t rows, int64_t cols, const float* scale,
                                  T* dst, int64_t ldd) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 s = _mm512_set1_ps(scale ? scale[r] : 1.0f);
    for (int64_t c = 0; c < cols; c += kLanes) {
      const __mmask16 m = lanes_below(cols - c);
      simd::store(dst + r * ldd + c, _mm512_mul_ps(simd::load(src + r * lds + c, m), s), m);
    }
  }
}

template <class T>
DCP_AVX512 void store_transposed_avx512(const float* src, int64_t lds, int64_t dst_rows, int64_t dst_cols, T* dst,
                                        int64_t ldd) {
  const __m512i rows = row_offsets(lds);
  for (int64_t c = 0; c < dst_rows; ++c) {
    for (int64_t d = 0; d < dst_cols; d += kLanes) {
      const __mmask16 m = lanes_below(dst_cols - d);
      const __m512 v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, rows, src + d * lds + c, 4);
      simd::store(dst + c * ldd + d, v, m);
    }
  }
}

template <>
DCP_AVX512 void transpose_rows_avx512<float>(const float* src, int64_t lds, int64_t rows, int64_t cols, float* dst,
                                             int64_t ldd) {
  const __m512i offsets = row_offsets(lds);
  for (int64_t r = 0; r < rows; r += kLanes) {
    const __mmask16 m = lanes_below(rows - r);
    for (int64_t d = 0; d < cols; ++d) {
      _mm512_mask_storeu_ps(dst + d * ldd + r, m,
                            _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, offsets, src + r * lds + d, 4));
    }
  }
}

template <>
DCP_AVX512 void transpose_rows_avx512<c10::BFloat16>(const c10::BFloat16* src, int64_t lds, int64_t rows,
                                                     int64_t cols, c10::BFloat16* dst, int64_t ldd) {
  // One 32-bit gather fetches columns 2p and 2p+1 of 16 rows; the low halves are row 2p of dst, the high ones
  // row 2p + 1. An odd last column is copied alone (its pair would read past the row).
  const __m512i offsets = row_offsets(lds * 2);
  const int64_t pairs = cols / 2;
  for (int64_t r = 0; r < rows; r += kLanes) {
    const __mmask16 m = lanes_below(rows - r);
    const auto* base = reinterpret_cast<const uint8_t*>(src + r * lds);
    for (int64_t p = 0; p < pairs; ++p) {
      const __m512i w = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, offsets, base + 4 * p, 1);
      store_halves(dst + 2 * p * ldd + r, _mm512_and_si512(w, _mm512_set1_epi32(0xffff)), m);
      store_halves(dst + (2 * p + 1) * ldd + r, _mm512_srli_epi32(w, 16), m);
    }
    if (cols % 2 == 1) {
      for (int64_t i = 0; i < kLanes && r + i < rows; ++i) dst[(cols - 1) * ldd + r + i] = src[(r + i) * lds + cols - 1];
    }
  }
}

template <class T>
DCP_AVX512 void row_dots_avx512(const T* a, int64_t lda, const T* b, int64_t ldb, int64_t rows, int64_t cols,
                                float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < cols; c += kLanes) {
      const __mmask16 m = lanes_below(cols - c);
      acc = _mm512_fmadd_ps(simd::load(a + r * lda + c, m), simd::load(b + r * ldb + c, m), acc);
    }
    out[r] = _mm512_reduce_add_ps(acc);
  }
}

DCP_AVX512 void scale_rows_avx512(float* o, int64_t ld, int64_t rows, int64_t cols, const float* alpha) {
  for (int64_t r = 0; r < rows; ++r) {
    if (alpha[r] == 1.0f) continue;
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int64_t c = 0; c < cols; c += kLanes) {
      const __mmask16 m = lanes_below(cols - c);
      _mm512_mask_storeu_ps(o + r * ld + c, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, o + r * ld + c), a));
    }
  }
}

#define DCP_TILE_IO(T)                                                                                             \
  template void store_rows_avx512<T>(const float*, int64_t, int64_t, int64_t, const float*, T*, int64_t);        \
  template void store_transposed_avx512<T>(const float*, int64_t, int64_t, int64_t, T*, int64_t);                \
  template void row_dots_avx512<T>(const T*, int64_t, const T*, int64_t, int64_t, int64_t, float*);
DCP_TILE_IO(float)
DCP_TILE_IO(c10::BFloat16)
#undef DCP_TILE_IO

}  // namespace dcp::tiles
