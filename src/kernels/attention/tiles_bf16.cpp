// bf16 tile products on AVX512-BF16 registers (vdpbf16ps), with the operand layouts of the AMX tiles
// (tiles_amx.cpp): the fast bf16 path of CPUs that have AVX512-BF16 but no AMX (Cooper Lake, Zen 4, or a
// Sapphire Rapids guest without the tile-data permission). Each function carries its own target attribute.
#include <immintrin.h>

#include <array>
#include <cstring>
#include <utility>

#include "kernels/attention/tiles.h"

#define DCP_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace dcp::tiles {
namespace {

constexpr int kLanes = 16;

DCP_AVX512_BF16 inline __mmask16 columns_below(int64_t count) {
  return count >= kLanes ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << count) - 1u);
}

// One register block of C: MR rows x NV vectors of 16 fp32 columns. Per pair p of k, the B vector of 16 columns
// holds the pairs (B[2p][j], B[2p+1][j]) (one 32-bit word per column, the VNNI layout), and A's pair
// (A[r][2p], A[r][2p+1]) is broadcast to every word: vdpbf16ps adds both products to each fp32 lane. A's pair is
// the word at a + r lda + 2p (row-major A) or, with kPairedA (A^T in VNNI pairs, [k/2][lda][2]), at a + 2 (p lda + r).
template <int MR, int NV, bool kPairedA>
DCP_AVX512_BF16 void micro(int64_t pairs, const bf16* a, int64_t lda, const bf16* b, int64_t ldb, float* c,
                           int64_t ldc, bool accumulate, __mmask16 tail) {
  __m512 acc[MR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __mmask16 mask = v == NV - 1 ? tail : static_cast<__mmask16>(0xffff);
      acc[r][v] = accumulate ? _mm512_maskz_loadu_ps(mask, c + r * ldc + v * kLanes) : _mm512_setzero_ps();
    }
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __mmask16 mask = v == NV - 1 ? tail : static_cast<__mmask16>(0xffff);
      bv[v] = _mm512_maskz_loadu_epi32(mask, b + p * 2 * ldb + v * 2 * kLanes);
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      int32_t word;
      std::memcpy(&word, kPairedA ? a + 2 * (p * lda + r) : a + r * lda + 2 * p, sizeof(word));
      const __m512i ar = _mm512_set1_epi32(word);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)ar, (__m512bh)bv[v]);
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

using MicroFn = void (*)(int64_t, const bf16*, int64_t, const bf16*, int64_t, float*, int64_t, bool, __mmask16);

// As in tiles_avx512.cpp: as many rows as 24 accumulators allow.
constexpr int rows_for(int nv) { return nv == 1 ? 12 : nv == 2 ? 12 : nv == 3 ? 8 : 6; }

template <int NV, bool kPairedA, int... R>
constexpr auto table(std::integer_sequence<int, R...>) {
  return std::array<MicroFn, sizeof...(R)>{&micro<R + 1, NV, kPairedA>...};
}

template <int NV, bool kPairedA>
DCP_AVX512_BF16 void column_block(int64_t m, int64_t pairs, const bf16* a, int64_t lda, const bf16* b, int64_t ldb,
                                  float* c, int64_t ldc, bool accumulate, __mmask16 tail) {
  constexpr int kRows = rows_for(NV);
  static constexpr auto kernels = table<NV, kPairedA>(std::make_integer_sequence<int, kRows>{});
  const int64_t row_step = kPairedA ? 2 : lda;  // where row r of A starts
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) {
    micro<kRows, NV, kPairedA>(pairs, a + r * row_step, lda, b, ldb, c + r * ldc, ldc, accumulate, tail);
  }
  if (r < m) kernels[m - r - 1](pairs, a + r * row_step, lda, b, ldb, c + r * ldc, ldc, accumulate, tail);
}

template <bool kPairedA>
DCP_AVX512_BF16 void gemm_any(int64_t m, int64_t n, int64_t k, const bf16* a, int64_t lda, const bf16* b,
                              int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  const int64_t pairs = k / 2;
  int64_t j = 0;
  // Column j of B starts at word j of each pair row: b + 2 j elements.
  for (; j + 4 * kLanes <= n; j += 4 * kLanes) {
    column_block<4, kPairedA>(m, pairs, a, lda, b + 2 * j, ldb, c + j, ldc, accumulate, 0xffff);
  }
  const int64_t rest = n - j;
  if (rest <= 0) return;
  const int nv = static_cast<int>((rest + kLanes - 1) / kLanes);
  const __mmask16 tail = columns_below(rest - (nv - 1) * kLanes);
  switch (nv) {
    case 1: column_block<1, kPairedA>(m, pairs, a, lda, b + 2 * j, ldb, c + j, ldc, accumulate, tail); break;
    case 2: column_block<2, kPairedA>(m, pairs, a, lda, b + 2 * j, ldb, c + j, ldc, accumulate, tail); break;
    case 3: column_block<3, kPairedA>(m, pairs, a, lda, b + 2 * j, ldb, c + j, ldc, accumulate, tail); break;
    default: column_block<4, kPairedA>(m, pairs, a, lda, b + 2 * j, ldb, c + j, ldc, accumulate, tail); break;
  }
}

}  // namespace

DCP_AVX512_BF16 void gemm_avx512_bf16(int64_t m, int64_t n, int64_t k, const bf16* a, int64_t lda, bool paired_a,
                                      const bf16* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  if (paired_a) return gemm_any<true>(m, n, k, a, lda, b, ldb, c, ldc, accumulate);
  gemm_any<false>(m, n, k, a, lda, b, ldb, c, ldc, accumulate);
}

}  // namespace dcp::tiles
