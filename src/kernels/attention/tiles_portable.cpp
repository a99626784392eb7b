// The tile steps as plain loops: the fp64 path, fp32 where AVX-512 is absent, and the twin the SIMD kernels are
// tested against.
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/attention/tiles.h"

namespace dcp::tiles {

template <class T>
void gemm_portable(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb, T* c,
                   int64_t ldc, bool accumulate) {
  for (int64_t i = 0; i < m; ++i) {
    T* crow = c + i * ldc;
    if (!accumulate) std::fill(crow, crow + n, T(0));
    for (int64_t p = 0; p < k; ++p) {
      const T x = a[i * lda + p];
      const T* brow = b + p * ldb;
      for (int64_t j = 0; j < n; ++j) crow[j] += x * brow[j];
    }
  }
}

template <class T>
void online_softmax_portable(T* s, int64_t ld, int64_t m, int64_t n, RowLimits limit, T scale2, T* m2, T* l,
                             T* alpha) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  for (int64_t r = 0; r < m; ++r) {
    T* row = s + r * ld;
    const int64_t valid = std::min<int64_t>(limit[r], n);
    if (valid <= 0) {
      std::fill(row, row + n, T(0));
      alpha[r] = 1;
      continue;
    }
    T mx = neg_inf;
    for (int64_t c = 0; c < valid; ++c) mx = std::max(mx, row[c] * scale2);
    const T m_new = std::max(m2[r], mx);
    T sum = 0;
    for (int64_t c = 0; c < n; ++c) {
      row[c] = c < valid ? std::exp2(row[c] * scale2 - m_new) : T(0);
      sum += row[c];
    }
    alpha[r] = m2[r] == neg_inf ? T(0) : std::exp2(m2[r] - m_new);
    l[r] = l[r] * alpha[r] + sum;
    m2[r] = m_new;
  }
}

template <class T>
void softmax_grad_portable(T* s, T* dp, int64_t ld, int64_t m, int64_t n, RowLimits limit, T scale2, T scale,
                           const T* lse2, const T* dlt) {
  for (int64_t r = 0; r < m; ++r) {
    T* srow = s + r * ld;
    T* drow = dp + r * ld;
    const int64_t valid = std::min<int64_t>(limit[r], n);
    for (int64_t c = 0; c < n; ++c) {
      const T p = c < valid ? std::exp2(srow[c] * scale2 - lse2[r]) : T(0);
      drow[c] = c < valid ? scale * p * (drow[c] - dlt[r]) : T(0);
      srow[c] = p;
    }
  }
}

#define DCP_TILES_PORTABLE(T)                                                                                      \
  template void gemm_portable<T>(int64_t, int64_t, int64_t, const T*, int64_t, const T*, int64_t, T*, int64_t,    \
                                 bool);                                                                            \
  template void online_softmax_portable<T>(T*, int64_t, int64_t, int64_t, RowLimits, T, T*, T*, T*);              \
  template void softmax_grad_portable<T>(T*, T*, int64_t, int64_t, int64_t, RowLimits, T, T, const T*, const T*);
DCP_TILES_PORTABLE(float)
DCP_TILES_PORTABLE(double)
#undef DCP_TILES_PORTABLE

}  // namespace dcp::tiles
