// How the tiled attention driver turns rows of q, k, v and its own fp32 tiles into operands of one tile-product
// family (tiles.h): plain row-major (fp32 on AVX-512 or portable loops, fp64) or bf16 on AMX. The driver is one
// template over these two policies; everything that differs between them is here.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/attention/tile_io.h"
#include "kernels/attention/tiles.h"

namespace dcp::tiles {

inline int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

/// Row-major operands of element type T (float or double), used in place where the rows already are one.
template <class T>
struct RowMajorPolicy {
  using In = T;   ///< element type of q, k, v
  using Op = T;   ///< element type of product operands
  using Acc = T;  ///< accumulators and softmax statistics
  static constexpr int64_t kAlign = 1;         ///< tile sizes are multiples of this
  static constexpr bool kCopiesRowsB = false;  ///< rows_b works in place
  bool simd = false;                           ///< fp32 products and softmax on AVX-512

  int64_t pad(int64_t x) const { return x; }

  void gemm(int64_t m, int64_t n, int64_t k, const Op* a, int64_t lda, const Op* b, int64_t ldb, Acc* c, int64_t ldc,
            bool accumulate) const {
    if constexpr (std::is_same_v<T, float>) {
      if (simd) return gemm_avx512(m, n, k, a, lda, b, ldb, c, ldc, accumulate);
    }
    gemm_portable<T>(m, n, k, a, lda, b, ldb, c, ldc, accumulate);
  }
  void online_softmax(Acc* s, int64_t ld, int64_t m, int64_t n, RowLimits limit, Acc scale2, Acc* m2, Acc* l,
                      Acc* alpha) const {
    if constexpr (std::is_same_v<T, float>) {
      if (simd) return online_softmax_avx512(s, ld, m, n, limit, scale2, m2, l, alpha);
    }
    online_softmax_portable<T>(s, ld, m, n, limit, scale2, m2, l, alpha);
  }
  void softmax_grad(Acc* s, Acc* dp, int64_t ld, int64_t m, int64_t n, RowLimits limit, Acc scale2, Acc scale,
                    const Acc* lse2, const Acc* dlt) const {
    if constexpr (std::is_same_v<T, float>) {
      if (simd) return softmax_grad_avx512(s, dp, ld, m, n, limit, scale2, scale, lse2, dlt);
    }
    softmax_grad_portable<T>(s, dp, ld, m, n, limit, scale2, scale, lse2, dlt);
  }

  /// A [m x k] from input rows (ld): in place.
  const Op* rows_a(const In* src, int64_t ld, int64_t /*m*/, int64_t /*m_pad*/, int64_t /*k*/, Op* /*scratch*/,
                   int64_t* lda) const {
    *lda = ld;
    return src;
  }
  /// B [k x n] = input rows [k x n] (ld): in place.
  const Op* rows_b(const In* src, int64_t ld, int64_t /*k*/, int64_t /*n*/, Op* /*scratch*/, int64_t* ldb) const {
    *ldb = ld;
    return src;
  }
  /// B [k x n] = (input rows [n x k])^T, transposed into scratch (ldb = n).
  const Op* rows_bt(const In* src, int64_t ld, int64_t n, int64_t k, Op* scratch, int64_t* ldb) const {
    rows_t(src, ld, n, k, scratch, n);
    *ldb = n;
    return scratch;
  }
  /// dst [k x ld_dst] = (rows [m x k])^T in its first m columns; the caller zeroes the rest.
  void rows_t(const In* src, int64_t ld, int64_t m, int64_t k, Op* dst, int64_t ld_dst) const {
    if constexpr (std::is_same_v<T, float>) {
      if (simd) return transpose_rows_avx512<float>(src, ld, m, k, dst, ld_dst);
    }
    transpose_rows_portable(src, ld, m, k, dst, ld_dst);
  }
  /// Output rows: dst[r][c] = src[r][c] * scale[r] (scale null: 1).
  void store_rows(const Acc* src, int64_t lds, int64_t rows, int64_t cols, const Acc* scale, In* dst,
                  int64_t ldd) const {
    if constexpr (std::is_same_v<T, float>) {
      if (simd) return store_rows_avx512<float>(src, lds, rows, cols, scale, dst, ldd);
    }
    store_rows_portable(src, lds, rows, cols, scale, dst, ldd);
  }
  /// Output rows from a transposed accumulator: dst[c][d] = src[d][c].
  void store_transposed(const Acc* src, int64_t lds, int64_t rows, int64_t cols, In* dst, int64_t ldd) const {
    if constexpr (std::is_same_v<T, float>) {
      if (simd) return store_transposed_avx512<float>(src, lds, rows, cols, dst, ldd);
    }
    store_transposed_portable(src, lds, rows, cols, dst, ldd);
  }
  void row_dots(const In* a, int64_t lda, const In* b, int64_t ldb, int64_t rows, int64_t cols, Acc* out) const {
    if constexpr (std::is_same_v<T, float>) {
      if (simd) return row_dots_avx512<float>(a, lda, b, ldb, rows, cols, out);
    }
    row_dots_portable(a, lda, b, ldb, rows, cols, out);
  }
  void scale_rows(Acc* o, int64_t ld, int64_t rows, int64_t cols, const Acc* alpha) const {
    if constexpr (std::is_same_v<T, float>) {
      if (simd) return scale_rows_avx512(o, ld, rows, cols, alpha);
    }
    scale_rows_portable(o, ld, rows, cols, alpha);
  }
  /// A [m x k] from an accumulator tile: in place.
  const Op* tile_a(Acc* t, int64_t ld, int64_t /*m*/, int64_t /*k*/, Op* /*scratch*/, int64_t* lda) const {
    *lda = ld;
    return t;
  }
  /// B [k x n] from an accumulator tile: in place.
  const Op* tile_b(Acc* t, int64_t ld, int64_t /*k*/, int64_t /*n*/, Op* /*scratch*/, int64_t* ldb) const {
    *ldb = ld;
    return t;
  }
};

/// bf16 operands on AMX tiles, fp32 accumulation: A row-major bf16, B VNNI-packed; every size padded to 32.
struct AmxPolicy {
  using In = c10::BFloat16;
  using Op = bf16;
  using Acc = float;
  static constexpr int64_t kAlign = 32;
  static constexpr bool kCopiesRowsB = true;

  int64_t pad(int64_t x) const { return round_up(x, kAlign); }

  void gemm(int64_t m, int64_t n, int64_t k, const Op* a, int64_t lda, const Op* b, int64_t ldb, Acc* c, int64_t ldc,
            bool accumulate) const {
    amx_gemm(m, n, k, a, lda, b, ldb, c, ldc, accumulate);
  }
  void online_softmax(Acc* s, int64_t ld, int64_t m, int64_t n, RowLimits limit, Acc scale2, Acc* m2, Acc* l,
                      Acc* alpha) const {
    online_softmax_avx512(s, ld, m, n, limit, scale2, m2, l, alpha);
  }
  void softmax_grad(Acc* s, Acc* dp, int64_t ld, int64_t m, int64_t n, RowLimits limit, Acc scale2, Acc scale,
                    const Acc* lse2, const Acc* dlt) const {
    softmax_grad_avx512(s, dp, ld, m, n, limit, scale2, scale, lse2, dlt);
  }

  /// A [m_pad x pad(k)]: in place when the rows are whole tiles of a 32-multiple width, else a zero-padded copy.
  const Op* rows_a(const In* src, int64_t ld, int64_t m, int64_t m_pad, int64_t k, Op* scratch, int64_t* lda) const {
    const Op* bits = reinterpret_cast<const Op*>(src);
    if (m == m_pad && k % kAlign == 0) {
      *lda = ld;
      return bits;
    }
    const int64_t k_pad = pad(k);
    for (int64_t r = 0; r < m_pad; ++r) {
      Op* out = scratch + r * k_pad;
      if (r < m) std::memcpy(out, bits + r * ld, static_cast<size_t>(k) * sizeof(Op));
      std::fill(out + (r < m ? k : 0), out + k_pad, Op(0));
    }
    *lda = k_pad;
    return scratch;
  }
  const Op* rows_b(const In* src, int64_t ld, int64_t k, int64_t n, Op* scratch, int64_t* ldb) const {
    amx_vnni_from_rows(reinterpret_cast<const Op*>(src), ld, k, n, pad(k), pad(n), scratch);
    *ldb = pad(n);
    return scratch;
  }
  const Op* rows_bt(const In* src, int64_t ld, int64_t n, int64_t k, Op* scratch, int64_t* ldb) const {
    amx_vnni_from_rows_t(reinterpret_cast<const Op*>(src), ld, n, k, pad(k), pad(n), scratch);
    *ldb = pad(n);
    return scratch;
  }
  void rows_t(const In* src, int64_t ld, int64_t m, int64_t k, Op* dst, int64_t ld_dst) const {
    transpose_rows_avx512<In>(src, ld, m, k, reinterpret_cast<In*>(dst), ld_dst);
  }
  void store_rows(const Acc* src, int64_t lds, int64_t rows, int64_t cols, const Acc* scale, In* dst,
                  int64_t ldd) const {
    store_rows_avx512<In>(src, lds, rows, cols, scale, dst, ldd);
  }
  void store_transposed(const Acc* src, int64_t lds, int64_t rows, int64_t cols, In* dst, int64_t ldd) const {
    store_transposed_avx512<In>(src, lds, rows, cols, dst, ldd);
  }
  void row_dots(const In* a, int64_t lda, const In* b, int64_t ldb, int64_t rows, int64_t cols, Acc* out) const {
    row_dots_avx512<In>(a, lda, b, ldb, rows, cols, out);
  }
  void scale_rows(Acc* o, int64_t ld, int64_t rows, int64_t cols, const Acc* alpha) const {
    scale_rows_avx512(o, ld, rows, cols, alpha);
  }
  const Op* tile_a(Acc* t, int64_t ld, int64_t m, int64_t k, Op* scratch, int64_t* lda) const {
    amx_rows_from_f32(t, ld, m, k, pad(k), scratch);
    *lda = pad(k);
    return scratch;
  }
  const Op* tile_b(Acc* t, int64_t ld, int64_t k, int64_t n, Op* scratch, int64_t* ldb) const {
    amx_vnni_from_f32(t, ld, k, n, pad(k), pad(n), scratch);
    *ldb = pad(n);
    return scratch;
  }
};

}  // namespace dcp::tiles
