// How the tiled attention driver turns rows of q, k, v and its own fp32 tiles into operands of one tile-product
// family (tiles.h): plain row-major (fp32 on AVX-512 or portable loops, fp64) or bf16 on AMX. The driver is one
// template over these two policies; everything that differs between them is here.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

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
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t d = 0; d < k; ++d) dst[d * ld_dst + r] = src[r * ld + d];
    }
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
  static Acc from_in(In x) { return x; }
  static In to_in(Acc x) { return x; }
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
    const Op* bits = reinterpret_cast<const Op*>(src);
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t d = 0; d < k; ++d) dst[d * ld_dst + r] = bits[r * ld + d];
    }
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
  static Acc from_in(In x) { return static_cast<float>(x); }
  static In to_in(Acc x) { return In(x); }
};

}  // namespace dcp::tiles
