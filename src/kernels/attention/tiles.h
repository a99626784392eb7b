// Tile-level building blocks of the tiled attention operator: small matrix products on tiles that live in L1/L2,
// the operand layouts they read, and the row-wise softmax steps of FlashAttention-2. Two families:
//
// - RowMajorTiles<T> (T = float or double): operands are plain row-major arrays, B included; fp32 products run
//   an AVX-512 register-blocked kernel where the CPU has it (tiles_avx512.cpp), everything else portable loops.
// - AmxTiles: bf16 operands, fp32 accumulators, on AMX tiles (tiles_amx.cpp). A is row-major bf16 with
//   k a multiple of 32; B is "VNNI" packed, [k/2][n][2] (pairs of consecutive k rows interleaved), n a multiple
//   of 16; m a multiple of 16. The same operands on AVX512-BF16 registers (tiles_bf16.cpp) serve CPUs without
//   AMX (the fused linear-attention kernel uses them; the tiled softmax upcasts to fp32 there).
//
// Every function is single-threaded and allocation-free: the operator's driver parallelises over tiles and owns
// the scratch. The SIMD functions carry their own target attributes (never file-wide -m flags), so inline library
// code in their files is compiled for the baseline ISA and runs on any host.
#pragma once

#include <cstdint>

namespace dcp::tiles {

/// bf16 as its bit pattern (the upper half of an fp32).
using bf16 = uint16_t;

/// Row limits of a score tile: row r of the tile may use columns [0, limit[r]) (causal mask, padding).
using RowLimits = const int32_t*;

// ---- portable loops (any T) --------------------------------------------------------------------------------

/// C[m x n] (+)= A[m x k] B[k x n]; A row-major (lda), B row-major (ldb), C row-major (ldc).
template <class T>
void gemm_portable(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb, T* c,
                   int64_t ldc, bool accumulate);

/// FlashAttention-2 Algorithm 1, lines 8-10, on one score tile s[m x n] (ld), in place: with x = s * scale2
/// (scale2 = scale * log2(e): exp2 domain) and the row's running max m2 and sum l, m2' = max(m2, rowmax x over
/// its limit), s <- exp2(x - m2') (0 beyond the limit), l <- exp2(m2 - m2') l + rowsum s, alpha[r] =
/// exp2(m2 - m2'). A row that has seen no key keeps m2 = -inf, l = 0, alpha = 1 and s = 0.
template <class T>
void online_softmax_portable(T* s, int64_t ld, int64_t m, int64_t n, RowLimits limit, T scale2, T* m2, T* l,
                             T* alpha);

/// FlashAttention-2 Algorithm 2, lines 12-14, on one tile: p = exp2(s * scale2 - lse2[r]) (0 beyond the limit),
/// written over s, and ds = scale * p * (dp - dlt[r]), written over dp (the score scale is folded into dS so that
/// dQ = dS K and dK = dS^T Q).
template <class T>
void softmax_grad_portable(T* s, T* dp, int64_t ld, int64_t m, int64_t n, RowLimits limit, T scale2, T scale,
                           const T* lse2, const T* dlt);

// ---- AVX-512 (fp32) ----------------------------------------------------------------------------------------

/// gemm_portable<float> on AVX-512F registers (12 x 32 and 6 x 64 blocks, masked edges).
void gemm_avx512(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                 float* c, int64_t ldc, bool accumulate);
/// The same with A stored transposed: A(r, kk) = at[kk * lda + r] (at is [k x m] row-major, lda >= m).
void gemm_avx512_at(int64_t m, int64_t n, int64_t k, const float* at, int64_t lda, const float* b, int64_t ldb,
                    float* c, int64_t ldc, bool accumulate);
/// online_softmax_portable<float> with a vectorised exp2.
void online_softmax_avx512(float* s, int64_t ld, int64_t m, int64_t n, RowLimits limit, float scale2, float* m2,
                           float* l, float* alpha);
/// softmax_grad_portable<float> with a vectorised exp2.
void softmax_grad_avx512(float* s, float* dp, int64_t ld, int64_t m, int64_t n, RowLimits limit, float scale2,
                         float scale, const float* lse2, const float* dlt);

// ---- AVX512-BF16 (bf16 operands, fp32 accumulators; the AMX operand layouts) --------------------------------

/// amx_gemm's product on AVX512-BF16 registers (vdpbf16ps: one pair of k per fp32 lane), for CPUs with
/// AVX512-BF16 but without AMX: C[m x n] fp32 (+)= A[m x k] B[k x n], A bf16 row-major (lda elements) or, with
/// paired_a, A^T VNNI-packed (pair row p holds (A[i][2p], A[i][2p+1]) for i < lda at [p * 2 * lda + 2 i], the
/// layout of a B operand); B VNNI-packed with ldb pairs per row as for amx_gemm; any m and n (masked edges), k
/// even (padding pairs zero). Call only where cpu_features() has avx512f, avx512bw, avx512vl and avx512_bf16.
void gemm_avx512_bf16(int64_t m, int64_t n, int64_t k, const bf16* a, int64_t lda, bool paired_a, const bf16* b,
                      int64_t ldb, float* c, int64_t ldc, bool accumulate);

// ---- AMX (bf16 operands, fp32 accumulators) ------------------------------------------------------------------

/// Loads this thread's tile configuration; call before amx_gemm on a thread (again after other AMX users ran).
void amx_begin();
/// Releases this thread's tile state (so that context switches stop saving it).
void amx_end();
/// C[m x n] fp32 (+)= A[m x k] B[k x n]; A bf16 row-major (lda elements), B VNNI-packed with ldb pairs per row
/// (pair row p holds (B[2p][j], B[2p+1][j]) for j < n at [p * 2 * ldb + 2 j]); m, n multiples of 16, k of 32.
void amx_gemm(int64_t m, int64_t n, int64_t k, const bf16* a, int64_t lda, const bf16* b, int64_t ldb, float* c,
              int64_t ldc, bool accumulate);
/// dst [m x k_pad] bf16 row-major (ld k_pad) from fp32 rows src [m x k] (ld), zero-padded to k_pad columns.
void amx_rows_from_f32(const float* src, int64_t ld, int64_t m, int64_t k, int64_t k_pad, bf16* dst);
/// VNNI B [k_pad x n_pad] from fp32 rows src [k x n] (ld): B = src, zero-padded (k_pad even, n_pad >= n).
void amx_vnni_from_f32(const float* src, int64_t ld, int64_t k, int64_t n, int64_t k_pad, int64_t n_pad, bf16* dst);
/// VNNI B [k_pad x n_pad] from bf16 rows src [k x n] (ld): B = src, zero-padded.
void amx_vnni_from_rows(const bf16* src, int64_t ld, int64_t k, int64_t n, int64_t k_pad, int64_t n_pad, bf16* dst);
/// VNNI B [k_pad x n_pad] from bf16 rows src [n x k] (ld): B = src^T, zero-padded; k even.
void amx_vnni_from_rows_t(const bf16* src, int64_t ld, int64_t n, int64_t k, int64_t k_pad, int64_t n_pad,
                          bf16* dst);

}  // namespace dcp::tiles
