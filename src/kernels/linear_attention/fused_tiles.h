// How the fused linear-attention kernel (fused.cpp) multiplies its tiles: matrix views of any orientation for A,
// row-major B, and the operand policies that turn them into one tile family's operands (kernels/attention/tiles.h):
// - RowPolicy<T> (float, double): in place; fp32 on AVX-512 registers (A row-major or stored transposed), the rest
//   portable loops;
// - Bf16Policy: the scan's products on bf16 operands with fp32 accumulators, on AMX tiles or with vdpbf16ps; A is
//   rounded into a row-major bf16 copy (or, from a transposed view on AVX512-BF16, into the VNNI pairs of A^T,
//   which is the same fast interleave as B's), B into the VNNI layout.
// And the elementwise steps with transcendental functions (sin / cos of the projections, exp), portable or AVX-512.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/attention/tiles.h"

namespace dcp::linear_attention::fused {

using tiles::bf16;

inline int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

/// A matrix view: element (i, j) at p[i * rs + j * cs].
template <class T>
struct View {
  const T* p;
  int64_t rs, cs;
};

/// A = any view, B row-major, both used in place; products in T.
template <class T>
struct RowPolicy {
  using Acc = T;
  using Op = T;  ///< element type of the pack scratch (unused here)
  static constexpr bool kPacks = false;
  bool simd = false;  ///< fp32 products on AVX-512

  struct A {
    View<T> v;
  };
  struct B {
    const T* p;
    int64_t ld;
  };
  A pack_a(View<T> v, int64_t /*m*/, int64_t /*k*/, Op* /*scratch*/) const { return {v}; }
  B pack_b(const T* p, int64_t ld, int64_t /*k*/, int64_t /*n*/, Op* /*scratch*/) const { return {p, ld}; }

  /// C[m x n] (+)= A[m x k] B[k x n] (ldc >= n).
  void mm(int64_t m, int64_t n, int64_t k, const A& a, const B& b, T* c, int64_t ldc, bool accumulate,
          T* /*ctmp*/) const {
    if (m <= 0 || n <= 0) return;
    if constexpr (std::is_same_v<T, float>) {
      if (simd && a.v.cs == 1) return tiles::gemm_avx512(m, n, k, a.v.p, a.v.rs, b.p, b.ld, c, ldc, accumulate);
      if (simd && a.v.rs == 1) return tiles::gemm_avx512_at(m, n, k, a.v.p, a.v.cs, b.p, b.ld, c, ldc, accumulate);
    }
    for (int64_t i = 0; i < m; ++i) {
      T* crow = c + i * ldc;
      if (!accumulate) std::fill(crow, crow + n, T(0));
      for (int64_t p = 0; p < k; ++p) {
        const T x = a.v.p[i * a.v.rs + p * a.v.cs];
        const T* brow = b.p + p * b.ld;
        for (int64_t j = 0; j < n; ++j) crow[j] += x * brow[j];
      }
    }
  }
};

/// fp32 tiles rounded to bf16 operands, fp32 accumulation: AMX (m, n padded to 16, k to 32) or AVX512-BF16.
struct Bf16Policy {
  using Acc = float;
  using Op = bf16;
  static constexpr bool kPacks = true;
  bool amx = false;

  struct A {
    const bf16* p;
    int64_t ld;
    bool paired;  ///< VNNI pairs of A^T ([k/2][ld][2]) instead of row-major [m][ld]
  };
  struct B {
    const bf16* p;
    int64_t ld;  ///< pairs per pair row (padded n)
  };
  static int64_t pad_k(int64_t k) { return round_up(std::max<int64_t>(k, 1), 32); }
  static int64_t pad_mn(int64_t x) { return round_up(std::max<int64_t>(x, 1), 16); }
  /// bf16 elements a pack of an [r x c] operand may take (either role).
  static int64_t pack_elems(int64_t r, int64_t c) { return pad_k(r) * pad_k(c); }

  A pack_a(View<float> v, int64_t m, int64_t k, bf16* scratch) const {
    const int64_t kp = pad_k(k), mp = pad_mn(m);
    if (v.cs == 1) {
      tiles::amx_rows_from_f32(v.p, v.rs, m, k, kp, scratch);
      std::fill(scratch + m * kp, scratch + mp * kp, bf16(0));
      return {scratch, kp, false};
    }
    if (v.rs == 1 && !amx) {
      // A^T is the row-major [k x m] array at v.p (ld v.cs): interleave its row pairs, as for a B operand.
      tiles::amx_vnni_from_f32(v.p, v.cs, k, m, kp, mp, scratch);
      return {scratch, mp, true};
    }
    for (int64_t i = 0; i < mp; ++i) {  // AMX tiles read A row-major: a transposing copy
      for (int64_t j = 0; j < kp; ++j) {
        scratch[i * kp + j] = i < m && j < k ? c10::BFloat16(v.p[i * v.rs + j * v.cs]).x : bf16(0);
      }
    }
    return {scratch, kp, false};
  }
  B pack_b(const float* p, int64_t ld, int64_t k, int64_t n, bf16* scratch) const {
    const int64_t np = pad_mn(n);
    tiles::amx_vnni_from_f32(p, ld, k, n, pad_k(k), np, scratch);
    return {scratch, np};
  }
  /// C[m x n] (+)= A B; AMX computes whole padded tiles into ctmp ([pad_mn(m) x pad_mn(n)] fp32) first.
  void mm(int64_t m, int64_t n, int64_t k, const A& a, const B& b, float* c, int64_t ldc, bool accumulate,
          float* ctmp) const {
    if (m <= 0 || n <= 0) return;
    const int64_t kp = pad_k(k);
    if (!amx) return tiles::gemm_avx512_bf16(m, n, kp, a.p, a.ld, a.paired, b.p, b.ld, c, ldc, accumulate);
    const int64_t mp = pad_mn(m), np = pad_mn(n);
    tiles::amx_gemm(mp, np, kp, a.p, a.ld, b.p, b.ld, ctmp, np, false);
    for (int64_t i = 0; i < m; ++i) {
      float* crow = c + i * ldc;
      const float* t = ctmp + i * np;
      if (accumulate) {
        for (int64_t j = 0; j < n; ++j) crow[j] += t[j];
      } else {
        std::memcpy(crow, t, static_cast<size_t>(n) * sizeof(float));
      }
    }
  }
};

// ---- elementwise steps ---------------------------------------------------------------------------------------

/// cos_out[t] = scale cos(u[t]), sin_out[t] = scale sin(u[t]) for t < n; simd: AVX-512 (simd::sincos, accurate
/// for |u| < 8192), else std::cos / std::sin.
void sincos_scaled(const float* u, int64_t n, float scale, float* cos_out, float* sin_out, bool simd);
void sincos_scaled(const double* u, int64_t n, double scale, double* cos_out, double* sin_out, bool simd);
/// out[t] = exp(x[t]) for t < n (in place allowed).
void exp_rows(const float* x, int64_t n, float* out, bool simd);
void exp_rows(const double* x, int64_t n, double* out, bool simd);

/// The AVX-512 row steps behind Rows<float> (fused_simd.cpp); n elements, contiguous, any alignment.
namespace avx512 {
void axpy(float* y, const float* x, float a, int64_t n);
void add_scalar(float* y, float a, int64_t n);
float sum(const float* x, int64_t n);
float dot(const float* x, const float* y, int64_t n);
void mul(float* dst, const float* x, const float* y, int64_t n);
void fma_into(float* acc, const float* x, const float* y, int64_t n);
void cross(float* dst, const float* a, const float* b, const float* c, const float* d, float s, int64_t n);
void scaled_sum(float* dst, const float* a, const float* b, float s, int64_t n);
void elu_map(float* at, float* pt, const float* g, int64_t n);
void elu_grad_dot(float* da, const float* dphi, const float* at, const float* pt, float* dot, int64_t n);
void cond_backward(float* dx, const float* da, const float* a, const float* g, const float* dot, float kappa,
                   int64_t n);
void load_rows(const float* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd);
void load_rows(const c10::BFloat16* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd);
void transpose(const float* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd);
void load_transposed(const float* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd,
                     float* sumsq);
void load_transposed(const c10::BFloat16* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd,
                     float* sumsq);
void store_transposed(const float* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd);
void store_transposed(const float* src, int64_t lds, int64_t rows, int64_t cols, c10::BFloat16* dst, int64_t ldd);
void store_rows(const float* src, int64_t lds, int64_t rows, int64_t cols, const float* scale, float* dst,
                int64_t ldd);
void store_rows(const float* src, int64_t lds, int64_t rows, int64_t cols, const float* scale, c10::BFloat16* dst,
                int64_t ldd);
}  // namespace avx512

/// Row steps of the fused kernel on contiguous runs of n elements (a tile row, one value per token), AVX-512 for
/// fp32 where `simd`, else plain loops (fp64 always). The layouts: rows [r x c] with leading dimension ld.
template <class T>
struct Rows {
  bool simd = false;
  static constexpr bool kFloat = std::is_same_v<T, float>;

  void axpy(T* y, const T* x, T a, int64_t n) const {  // y += a x
    if constexpr (kFloat) {
      if (simd) return avx512::axpy(y, x, a, n);
    }
    for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
  }
  void add_scalar(T* y, T a, int64_t n) const {  // y += a
    if constexpr (kFloat) {
      if (simd) return avx512::add_scalar(y, a, n);
    }
    for (int64_t i = 0; i < n; ++i) y[i] += a;
  }
  T sum(const T* x, int64_t n) const {
    if constexpr (kFloat) {
      if (simd) return avx512::sum(x, n);
    }
    T s = 0;
    for (int64_t i = 0; i < n; ++i) s += x[i];
    return s;
  }
  T dot(const T* x, const T* y, int64_t n) const {
    if constexpr (kFloat) {
      if (simd) return avx512::dot(x, y, n);
    }
    T s = 0;
    for (int64_t i = 0; i < n; ++i) s += x[i] * y[i];
    return s;
  }
  void mul(T* dst, const T* x, const T* y, int64_t n) const {  // dst = x y (in place allowed)
    if constexpr (kFloat) {
      if (simd) return avx512::mul(dst, x, y, n);
    }
    for (int64_t i = 0; i < n; ++i) dst[i] = x[i] * y[i];
  }
  void fma_into(T* acc, const T* x, const T* y, int64_t n) const {  // acc += x y
    if constexpr (kFloat) {
      if (simd) return avx512::fma_into(acc, x, y, n);
    }
    for (int64_t i = 0; i < n; ++i) acc[i] += x[i] * y[i];
  }
  void cross(T* dst, const T* a, const T* b, const T* c, const T* d, T s, int64_t n) const {  // s (a b - c d)
    if constexpr (kFloat) {
      if (simd) return avx512::cross(dst, a, b, c, d, s, n);
    }
    for (int64_t i = 0; i < n; ++i) dst[i] = s * (a[i] * b[i] - c[i] * d[i]);
  }
  void scaled_sum(T* dst, const T* a, const T* b, T s, int64_t n) const {  // s (a + b)
    if constexpr (kFloat) {
      if (simd) return avx512::scaled_sum(dst, a, b, s, n);
    }
    for (int64_t i = 0; i < n; ++i) dst[i] = s * (a[i] + b[i]);
  }
  /// at *= g (one g per token), then pt = elu(at) + 1: at + 1 where at > 0, else exp(at) (exp_rows' values).
  void elu_map(T* at, T* pt, const T* g, int64_t n) const {
    if constexpr (kFloat) {
      if (simd) return avx512::elu_map(at, pt, g, n);
    }
    for (int64_t i = 0; i < n; ++i) {
      at[i] *= g[i];
      pt[i] = at[i] > 0 ? at[i] + 1 : std::exp(at[i]);
    }
  }
  /// da = dphi (at > 0 ? 1 : pt), the gradient through elu + 1 (pt = exp(at) where at <= 0), and dot += at da
  /// (fma_into's operation) in the same pass.
  void elu_grad_dot(T* da, const T* dphi, const T* at, const T* pt, T* dot, int64_t n) const {
    if constexpr (kFloat) {
      if (simd) return avx512::elu_grad_dot(da, dphi, at, pt, dot, n);
    }
    for (int64_t i = 0; i < n; ++i) {
      da[i] = dphi[i] * (at[i] > 0 ? T(1) : pt[i]);
      dot[i] += at[i] * da[i];
    }
  }
  /// dx = g (da - kappa dot a), g and dot one value per token.
  void cond_backward(T* dx, const T* da, const T* a, const T* g, const T* dot, T kappa, int64_t n) const {
    if constexpr (kFloat) {
      if (simd) return avx512::cond_backward(dx, da, a, g, dot, kappa, n);
    }
    for (int64_t i = 0; i < n; ++i) dx[i] = g[i] * (da[i] - kappa * dot[i] * a[i]);
  }
  /// dst [rows x cols] (ldd) = src rows converted to T.
  template <class In>
  void load_rows(const In* src, int64_t lds, int64_t rows, int64_t cols, T* dst, int64_t ldd) const {
    if constexpr (kFloat && (std::is_same_v<In, float> || std::is_same_v<In, c10::BFloat16>)) {
      if (simd) return avx512::load_rows(src, lds, rows, cols, dst, ldd);
    }
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) dst[r * ldd + c] = static_cast<T>(src[r * lds + c]);
    }
  }
  /// dst [cols x rows] (ldd) = src [rows x cols]^T.
  void transpose(const T* src, int64_t lds, int64_t rows, int64_t cols, T* dst, int64_t ldd) const {
    if constexpr (kFloat) {
      if (simd) return avx512::transpose(src, lds, rows, cols, dst, ldd);
    }
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) dst[c * ldd + r] = src[r * lds + c];
    }
  }
  /// dst [cols x rows] (ldd) = src [rows x cols] (lds, In)^T converted to T, and sumsq[r] = sum_c dst[c][r]^2
  /// (summed in increasing c).
  template <class In>
  void load_transposed(const In* src, int64_t lds, int64_t rows, int64_t cols, T* dst, int64_t ldd, T* sumsq) const {
    if constexpr (kFloat && (std::is_same_v<In, float> || std::is_same_v<In, c10::BFloat16>)) {
      if (simd) {
        std::fill(sumsq, sumsq + rows, T(0));
        return avx512::load_transposed(src, lds, rows, cols, dst, ldd, sumsq);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      T ss = 0;
      for (int64_t c = 0; c < cols; ++c) {
        const T x = static_cast<T>(src[r * lds + c]);
        dst[c * ldd + r] = x;
        ss += x * x;
      }
      sumsq[r] = ss;
    }
  }
  /// dst [rows x cols] (ldd, In) = src [cols x rows] (lds)^T.
  template <class In>
  void store_transposed(const T* src, int64_t lds, int64_t rows, int64_t cols, In* dst, int64_t ldd) const {
    if constexpr (kFloat && (std::is_same_v<In, float> || std::is_same_v<In, c10::BFloat16>)) {
      if (simd) return avx512::store_transposed(src, lds, rows, cols, dst, ldd);
    }
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) dst[r * ldd + c] = static_cast<In>(src[c * lds + r]);
    }
  }
  /// dst [rows x cols] (ldd, In) = src rows times scale[r] (null: 1).
  template <class In>
  void store_rows(const T* src, int64_t lds, int64_t rows, int64_t cols, const T* scale, In* dst, int64_t ldd) const {
    if constexpr (kFloat && (std::is_same_v<In, float> || std::is_same_v<In, c10::BFloat16>)) {
      if (simd) return avx512::store_rows(src, lds, rows, cols, scale, dst, ldd);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const T sc = scale ? scale[r] : T(1);
      for (int64_t c = 0; c < cols; ++c) dst[r * ldd + c] = static_cast<In>(src[r * lds + c] * sc);
    }
  }
};

}  // namespace dcp::linear_attention::fused
