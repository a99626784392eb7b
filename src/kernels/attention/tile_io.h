// Moving rows between q/k/v/out-shaped tensors (fp32 or bf16, strided) and the driver's fp32 tiles: scaled
// stores, transposed stores, transposes and row dot products. AVX-512 versions (tile_io.cpp, gathers for the
// transposes) for fp32 and bf16 storage, and portable loops for any type; the operand policies pick one.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#include "kernels/simd.h"

namespace dcp::tiles {

/// dst[r][c] = src[r][c] * (scale ? scale[r] : 1), r < rows, c < cols, rounded to T.
template <class T>
DCP_AVX512 void store_rows_avx512(const float* src, int64_t lds, int64_t rows, int64_t cols, const float* scale, T* dst,
                       int64_t ldd);
/// dst[c][d] = src[d][c] for c < dst_rows, d < dst_cols (src holds the transpose, lds its row stride).
template <class T>
DCP_AVX512 void store_transposed_avx512(const float* src, int64_t lds, int64_t dst_rows, int64_t dst_cols, T* dst,
                             int64_t ldd);
/// dst[d][r] = src[r][d] for r < rows, d < cols.
template <class T>
DCP_AVX512 void transpose_rows_avx512(const T* src, int64_t lds, int64_t rows, int64_t cols, T* dst, int64_t ldd);
/// out[r] = sum_c a[r][c] b[r][c] in fp32.
template <class T>
DCP_AVX512 void row_dots_avx512(const T* a, int64_t lda, const T* b, int64_t ldb, int64_t rows, int64_t cols, float* out);
/// o[r][:cols] *= alpha[r] where alpha[r] != 1.
DCP_AVX512 void scale_rows_avx512(float* o, int64_t ld, int64_t rows, int64_t cols, const float* alpha);

template <class Acc, class T>
void store_rows_portable(const Acc* src, int64_t lds, int64_t rows, int64_t cols, const Acc* scale, T* dst,
                         int64_t ldd) {
  for (int64_t r = 0; r < rows; ++r) {
    const Acc s = scale ? scale[r] : Acc(1);
    for (int64_t c = 0; c < cols; ++c) dst[r * ldd + c] = static_cast<T>(src[r * lds + c] * s);
  }
}
template <class Acc, class T>
void store_transposed_portable(const Acc* src, int64_t lds, int64_t dst_rows, int64_t dst_cols, T* dst,
                               int64_t ldd) {
  for (int64_t c = 0; c < dst_rows; ++c) {
    for (int64_t d = 0; d < dst_cols; ++d) dst[c * ldd + d] = static_cast<T>(src[d * lds + c]);
  }
}
template <class T, class U>
void transpose_rows_portable(const T* src, int64_t lds, int64_t rows, int64_t cols, U* dst, int64_t ldd) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < cols; ++d) dst[d * ldd + r] = static_cast<U>(src[r * lds + d]);
  }
}
template <class Acc, class T>
void row_dots_portable(const T* a, int64_t lda, const T* b, int64_t ldb, int64_t rows, int64_t cols, Acc* out) {
  for (int64_t r = 0; r < rows; ++r) {
    Acc sum = 0;
    for (int64_t c = 0; c < cols; ++c) sum += static_cast<Acc>(a[r * lda + c]) * static_cast<Acc>(b[r * ldb + c]);
    out[r] = sum;
  }
}
template <class Acc>
void scale_rows_portable(Acc* o, int64_t ld, int64_t rows, int64_t cols, const Acc* alpha) {
  for (int64_t r = 0; r < rows; ++r) {
    if (alpha[r] == Acc(1)) continue;
    for (int64_t c = 0; c < cols; ++c) o[r * ld + c] *= alpha[r];
  }
}

}  // namespace dcp::tiles
