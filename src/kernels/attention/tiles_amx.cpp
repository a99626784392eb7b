// bf16 tile products on AMX (Intel Sapphire Rapids and later) and the conversions into their operand layouts.
// Each function carries its own target attribute; callers check amx_usable() (CPUID and Linux's tile-data
// permission) first.
#include <immintrin.h>

#include <cstring>

#include "kernels/attention/tiles.h"

#define DCP_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

namespace dcp::tiles {
namespace {

// Palette 1 with every register 16 rows x 64 bytes: C tiles hold 16 x 16 fp32, A tiles 16 x 32 bf16 and B tiles
// 16 pair rows x 16 columns. Registers: 0-3 accumulate a 32 x 32 block of C, 4-5 hold A, 6-7 hold B.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Lane i of the result takes element idx[i] of (a: 0..15, b: 16..31): interleaves two rows into VNNI pairs.
DCP_AMX inline __m512i pair_index() {
  alignas(64) static const uint16_t idx[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                               8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_load_si512(idx);
}

DCP_AMX inline __mmask16 lanes_below16(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << count) - 1u);
}
DCP_AMX inline __mmask32 lanes_below32(int64_t count) {
  return count >= 32 ? ~static_cast<__mmask32>(0) : static_cast<__mmask32>((1u << count) - 1u);
}

}  // namespace

DCP_AMX void amx_begin() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  // Inline asm with a memory operand: GCC 12's _tile_loadconfig builtin does not tell the optimiser that it
  // reads the structure, so the stores filling it were removed as dead (seen: a zeroed config, then #UD).
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg) : "memory");
}

DCP_AMX void amx_end() { _tile_release(); }

DCP_AMX void amx_gemm(int64_t m, int64_t n, int64_t k, const bf16* a, int64_t lda, const bf16* b, int64_t ldb,
                      float* c, int64_t ldc, bool accumulate) {
  const long sa = static_cast<long>(lda * 2), sb = static_cast<long>(ldb * 4), sc = static_cast<long>(ldc * 4);
  for (int64_t i = 0; i < m; i += 32) {
    const bool two_m = i + 16 < m;
    for (int64_t j = 0; j < n; j += 32) {
      const bool two_n = j + 16 < n;
      float* c0 = c + i * ldc + j;
      float* c1 = c0 + 16;
      float* c2 = c0 + 16 * ldc;
      float* c3 = c2 + 16;
      if (accumulate) {
        _tile_loadd(0, c0, sc);
        if (two_n) _tile_loadd(1, c1, sc);
        if (two_m) _tile_loadd(2, c2, sc);
        if (two_m && two_n) _tile_loadd(3, c3, sc);
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int64_t p = 0; p < k; p += 32) {
        const bf16* a0 = a + i * lda + p;
        const bf16* b0 = b + p * ldb + 2 * j;  // pair row p / 2, column j
        _tile_loadd(4, a0, sa);
        _tile_loadd(6, b0, sb);
        _tile_dpbf16ps(0, 4, 6);
        if (two_n) {
          _tile_loadd(7, b0 + 32, sb);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (two_m) {
          _tile_loadd(5, a0 + 16 * lda, sa);
          _tile_dpbf16ps(2, 5, 6);
          if (two_n) _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, c0, sc);
      if (two_n) _tile_stored(1, c1, sc);
      if (two_m) _tile_stored(2, c2, sc);
      if (two_m && two_n) _tile_stored(3, c3, sc);
    }
  }
}

DCP_AMX void amx_rows_from_f32(const float* src, int64_t ld, int64_t m, int64_t k, int64_t k_pad, bf16* dst) {
  for (int64_t r = 0; r < m; ++r) {
    const float* row = src + r * ld;
    bf16* out = dst + r * k_pad;
    for (int64_t c = 0; c < k_pad; c += 32) {
      const __m512 lo = _mm512_maskz_loadu_ps(c < k ? lanes_below16(k - c) : 0, row + c);
      const __m512 hi = _mm512_maskz_loadu_ps(c + 16 < k ? lanes_below16(k - c - 16) : 0, row + c + 16);
      _mm512_mask_storeu_epi16(out + c, lanes_below32(k_pad - c), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

DCP_AMX void amx_vnni_from_f32(const float* src, int64_t ld, int64_t k, int64_t n, int64_t k_pad, int64_t n_pad,
                               bf16* dst) {
  const __m512i idx = pair_index();
  for (int64_t p = 0; 2 * p < k_pad; ++p) {
    const float* r0 = src + 2 * p * ld;
    const float* r1 = r0 + ld;
    const bool has0 = 2 * p < k, has1 = 2 * p + 1 < k;
    bf16* out = dst + 2 * p * n_pad;
    for (int64_t j = 0; j < n_pad; j += 16) {
      const __mmask16 cols = j < n ? lanes_below16(n - j) : 0;
      const __m512 x0 = _mm512_maskz_loadu_ps(has0 ? cols : 0, r0 + j);
      const __m512 x1 = _mm512_maskz_loadu_ps(has1 ? cols : 0, r1 + j);
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);  // lanes 0-15 row 2p, 16-31 row 2p+1
      _mm512_mask_storeu_epi16(out + 2 * j, lanes_below32(2 * (n_pad - j)), _mm512_permutexvar_epi16(idx, both));
    }
  }
}

DCP_AMX void amx_vnni_from_rows(const bf16* src, int64_t ld, int64_t k, int64_t n, int64_t k_pad, int64_t n_pad,
                                bf16* dst) {
  const __m512i idx = pair_index();
  for (int64_t p = 0; 2 * p < k_pad; ++p) {
    const bf16* r0 = src + 2 * p * ld;
    const bf16* r1 = r0 + ld;
    const bool has0 = 2 * p < k, has1 = 2 * p + 1 < k;
    bf16* out = dst + 2 * p * n_pad;
    for (int64_t j = 0; j < n_pad; j += 16) {
      const __mmask16 cols = j < n ? lanes_below16(n - j) : 0;
      const __m256i x0 = _mm256_maskz_loadu_epi16(has0 ? cols : 0, r0 + j);
      const __m256i x1 = _mm256_maskz_loadu_epi16(has1 ? cols : 0, r1 + j);
      const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(x0), x1, 1);
      _mm512_mask_storeu_epi16(out + 2 * j, lanes_below32(2 * (n_pad - j)), _mm512_permutexvar_epi16(idx, both));
    }
  }
}

DCP_AMX void amx_vnni_from_rows_t(const bf16* src, int64_t ld, int64_t n, int64_t k, int64_t k_pad, int64_t n_pad,
                                  bf16* dst) {
  // B = src^T: pair row p, column j is the 32-bit word (src[j][2p], src[j][2p+1]), so the pack is a transpose of
  // 32-bit words, done 16 columns at a time through gathers of one word from each of 16 rows.
  const int64_t pairs = k_pad / 2, full_pairs = k / 2;
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(static_cast<int>(ld * 2)));
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t j = 0; j < n_pad; j += 16) {
    const __mmask16 cols = j < n ? lanes_below16(n - j) : 0;
    const uint8_t* base = reinterpret_cast<const uint8_t*>(src + j * ld);
    for (int64_t p = 0; p < pairs; ++p) {
      const __m512i words = p < full_pairs
                                ? _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), cols, rows, base + 4 * p, 1)
                                : _mm512_setzero_si512();
      _mm512_mask_storeu_epi32(out + p * n_pad + j, lanes_below16(n_pad - j), words);
    }
  }
}

}  // namespace dcp::tiles
