// fp32 tile products and softmax steps on AVX-512F registers. Every function carries its own target attribute
// (DCP_AVX512, kernels/simd.h; no -mavx512f for the file), so nothing here runs unless called after the CPU check.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <limits>
#include <utility>

#include "kernels/attention/tiles.h"
#include "kernels/simd.h"


namespace dcp::tiles {
namespace {

constexpr int kLanes = 16;
using simd::lanes_below;

// One register block of C: MR rows x NV vectors of 16 columns, the last vector masked by `tail`. A is read by
// broadcasts (one element per row and k: A(r, kk) at a[r * lda + kk], or at a[kk * lda + r] when kTransA, i.e.
// A stored transposed), B by full-width loads of its rows.
template <int MR, int NV, bool kTransA = false>
DCP_AVX512 void micro(int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc,
                      bool accumulate, __mmask16 tail) {
  __m512 acc[MR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __mmask16 mask = v == NV - 1 ? tail : static_cast<__mmask16>(0xffff);
      acc[r][v] = accumulate ? _mm512_maskz_loadu_ps(mask, c + r * ldc + v * kLanes) : _mm512_setzero_ps();
    }
  }
  for (int64_t kk = 0; kk < k; ++kk) {
    __m512 bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __mmask16 mask = v == NV - 1 ? tail : static_cast<__mmask16>(0xffff);
      bv[v] = _mm512_maskz_loadu_ps(mask, b + kk * ldb + v * kLanes);
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512 ar = _mm512_set1_ps(kTransA ? a[kk * lda + r] : a[r * lda + kk]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(ar, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __mmask16 mask = v == NV - 1 ? tail : static_cast<__mmask16>(0xffff);
      _mm512_mask_storeu_ps(c + r * ldc + v * kLanes, mask, acc[r][v]);
    }
  }
}

using MicroFn = void (*)(int64_t, const float*, int64_t, const float*, int64_t, float*, int64_t, bool, __mmask16);

// Rows per block for NV vectors: as many as 24 accumulators allow (32 zmm registers less B and a broadcast).
constexpr int rows_for(int nv) { return nv == 1 ? 12 : nv == 2 ? 12 : nv == 3 ? 8 : 6; }

template <int NV, bool kTransA, int... R>
constexpr auto table(std::integer_sequence<int, R...>) {
  return std::array<MicroFn, sizeof...(R)>{&micro<R + 1, NV, kTransA>...};
}

template <int NV, bool kTransA>
DCP_AVX512 void column_block(int64_t m, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                             float* c, int64_t ldc, bool accumulate, __mmask16 tail) {
  constexpr int kRows = rows_for(NV);
  static constexpr auto kernels = table<NV, kTransA>(std::make_integer_sequence<int, kRows>{});
  // Row r of A starts at a + r * lda, or at a + r when A is stored transposed.
  const int64_t row_step = kTransA ? 1 : lda;
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) {
    micro<kRows, NV, kTransA>(k, a + r * row_step, lda, b, ldb, c + r * ldc, ldc, accumulate, tail);
  }
  if (r < m) kernels[m - r - 1](k, a + r * row_step, lda, b, ldb, c + r * ldc, ldc, accumulate, tail);
}

template <bool kTransA>
DCP_AVX512 void gemm_any(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                         float* c, int64_t ldc, bool accumulate) {
  int64_t j = 0;
  for (; j + 4 * kLanes <= n; j += 4 * kLanes) {
    column_block<4, kTransA>(m, k, a, lda, b + j, ldb, c + j, ldc, accumulate, 0xffff);
  }
  const int64_t rest = n - j;
  if (rest <= 0) return;
  const int nv = static_cast<int>((rest + kLanes - 1) / kLanes);
  const __mmask16 tail = lanes_below(rest - (nv - 1) * kLanes);
  switch (nv) {
    case 1: column_block<1, kTransA>(m, k, a, lda, b + j, ldb, c + j, ldc, accumulate, tail); break;
    case 2: column_block<2, kTransA>(m, k, a, lda, b + j, ldb, c + j, ldc, accumulate, tail); break;
    case 3: column_block<3, kTransA>(m, k, a, lda, b + j, ldb, c + j, ldc, accumulate, tail); break;
    default: column_block<4, kTransA>(m, k, a, lda, b + j, ldb, c + j, ldc, accumulate, tail); break;
  }
}

}  // namespace

DCP_AVX512 void gemm_avx512(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                            int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  gemm_any<false>(m, n, k, a, lda, b, ldb, c, ldc, accumulate);
}

DCP_AVX512 void gemm_avx512_at(int64_t m, int64_t n, int64_t k, const float* at, int64_t lda, const float* b,
                               int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  gemm_any<true>(m, n, k, at, lda, b, ldb, c, ldc, accumulate);
}

DCP_AVX512 void online_softmax_avx512(float* s, int64_t ld, int64_t m, int64_t n, RowLimits limit, float scale2,
                                      float* m2, float* l, float* alpha) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m512 vscale = _mm512_set1_ps(scale2);
  for (int64_t r = 0; r < m; ++r) {
    float* row = s + r * ld;
    const int64_t valid = std::min<int64_t>(limit[r], n);
    if (valid <= 0) {
      for (int64_t c = 0; c < n; c += kLanes) _mm512_mask_storeu_ps(row + c, lanes_below(n - c), _mm512_setzero_ps());
      alpha[r] = 1.0f;
      continue;
    }
    __m512 vmax = _mm512_set1_ps(neg_inf);
    for (int64_t c = 0; c < valid; c += kLanes) {
      const __mmask16 mask = lanes_below(valid - c);
      vmax = _mm512_mask_max_ps(vmax, mask, vmax, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, row + c), vscale));
    }
    const float m_new = std::max(m2[r], _mm512_reduce_max_ps(vmax));
    const __m512 vm = _mm512_set1_ps(m_new);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t c = 0; c < n; c += kLanes) {
      const __mmask16 store = lanes_below(n - c);
      const __mmask16 keep = c < valid ? lanes_below(valid - c) : static_cast<__mmask16>(0);
      const __m512 x = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(keep, row + c), vscale, vm);
      const __m512 p = _mm512_maskz_mov_ps(keep, simd::exp2(x));
      vsum = _mm512_add_ps(vsum, p);
      _mm512_mask_storeu_ps(row + c, store, p);
    }
    const float a = m2[r] == neg_inf ? 0.0f : _mm512_cvtss_f32(simd::exp2(_mm512_set1_ps(m2[r] - m_new)));
    alpha[r] = a;
    l[r] = l[r] * a + _mm512_reduce_add_ps(vsum);
    m2[r] = m_new;
  }
}

DCP_AVX512 void softmax_grad_avx512(float* s, float* dp, int64_t ld, int64_t m, int64_t n, RowLimits limit,
                                    float scale2, float scale, const float* lse2, const float* dlt) {
  const __m512 vscale2 = _mm512_set1_ps(scale2), vscale = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < m; ++r) {
    float* srow = s + r * ld;
    float* drow = dp + r * ld;
    const int64_t valid = std::min<int64_t>(limit[r], n);
    const __m512 vlse = _mm512_set1_ps(lse2[r]), vdlt = _mm512_set1_ps(dlt[r]);
    for (int64_t c = 0; c < n; c += kLanes) {
      const __mmask16 store = lanes_below(n - c);
      const __mmask16 keep = c < valid ? lanes_below(valid - c) : static_cast<__mmask16>(0);
      const __m512 p = _mm512_maskz_mov_ps(
          keep, simd::exp2(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(keep, srow + c), vscale2, vlse)));
      const __m512 ds = _mm512_mul_ps(_mm512_mul_ps(p, vscale),
                                      _mm512_sub_ps(_mm512_maskz_loadu_ps(keep, drow + c), vdlt));
      _mm512_mask_storeu_ps(srow + c, store, p);
      _mm512_mask_storeu_ps(drow + c, store, ds);
    }
  }
}

}  // namespace dcp::tiles
