// The AVX-512 paths of the decode kernel (kv_decode_attention): one (sequence, head) pair over raw rows, or a block
// of a chunk's tokens over one head's rows (kv_chunk_decode_attention), and the choice of path for given CPU features. Internal to the infer stage; callers check the CPU first (resolve_path:
// the functions carry their own target attributes).
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

#include "dcp/cpu_features.h"
#include "dcp/infer.h"

namespace dcp::decode_simd {

/// resolve_decode_attention_path on a CPU with the features `cpu` (resolve_decode_attention_path passes
/// cpu_features()): lets a test check the choice and the refusals for CPUs other than the one it runs on. Throws
/// std::invalid_argument as resolve_decode_attention_path does.
DecodeAttentionPath resolve_path(c10::ScalarType dtype, DecodeAttentionPath requested, const CpuFeatures& cpu);

/// softmax(q.K^T * scale + bias) V over n cache rows and the token's own (k_new, v_new), on AVX-512F registers in
/// fp32: pass 1 the n + 1 scores, 16 rows at a time (each row's FMA chain over head_dim in its own register, bf16
/// rows split into even and odd columns, then one transposing reduction gives the 16 scores), pass 2 their
/// maximum, exp (dcp::simd::exp, ~1 ulp) and sum, pass 3 the probability-weighted value rows (fp32 accumulators,
/// each column summed over the rows in order). The order of every sum depends only on this pair's rows, so a pair
/// gives the same bits alone or among others. q, keys [n, d], values [n, dv], k_new [d], v_new [dv] in T (fp32 or
/// bf16); bias [n] fp32 (the entries' log-weights); qs: scratch of d rounded up to 32 floats (the scaled query);
/// scores: scratch of n + 1 floats; out [dv] in T.
template <class T>
void attend_pair(const T* q, const T* keys, const T* values, const float* bias, int64_t n, const T* k_new,
                 const T* v_new, int64_t d, int64_t dv, float scale, float* qs, float* scores, T* out);

/// attend_pair for bf16 rows with the scores by vdpbf16ps (AVX512-BF16): <q, k> from the bf16 query and key pairs
/// (exact products, fp32 sums), times scale, plus bias; passes 2 and 3 as attend_pair's. Call only where
/// cpu_features().avx512_bf16 (and AVX-512 F, BW, VL) hold.
void attend_pair_dot(const c10::BFloat16* q, const c10::BFloat16* keys, const c10::BFloat16* values, const float* bias,
                     int64_t n, const c10::BFloat16* k_new, const c10::BFloat16* v_new, int64_t d, int64_t dv,
                     float scale, float* scores, c10::BFloat16* out);

/// One query of a block for attend_queries: token q (with its own k_new, v_new) over the first n rows of the head,
/// scores scratch of n + 1 floats, out [dv].
template <class T>
struct Query {
  const T* q;
  const T* k_new;
  const T* v_new;
  int64_t n;
  float* scores;
  T* out;
};

/// Most queries of one attend_queries call.
constexpr int64_t kMaxQueries = 16;

/// Floats of attend_queries' scratch for `count` queries of head dimension d.
inline int64_t query_scratch_floats(int64_t count, int64_t d) { return count * ((d + 31) / 32 * 32 + 64); }

/// attend_pair for `count` (1..kMaxQueries) queries over the same head's rows at once (a prefill chunk's tokens,
/// kv_chunk_decode_attention): each block of 16 key rows of pass 1 and each tile of 64 value rows of pass 3 is read
/// from memory once for all of them (then from L1), where one query at a time rereads the head's rows per token.
/// Every query's sums run in attend_pair's order, so each gets the bits attend_pair gives it alone. scratch:
/// query_scratch_floats(count, d) floats.
template <class T>
void attend_queries(const Query<T>* queries, int64_t count, const T* keys, const T* values, const float* bias, int64_t d,
                    int64_t dv, float scale, float* scratch);

/// attend_queries by vdpbf16ps (attend_pair_dot's scores). Call only where cpu_features().avx512_bf16 holds.
void attend_queries_dot(const Query<c10::BFloat16>* queries, int64_t count, const c10::BFloat16* keys,
                        const c10::BFloat16* values, const float* bias, int64_t d, int64_t dv, float scale,
                        float* scratch);

extern template void attend_queries<float>(const Query<float>*, int64_t, const float*, const float*, const float*,
                                           int64_t, int64_t, float, float*);
extern template void attend_queries<c10::BFloat16>(const Query<c10::BFloat16>*, int64_t, const c10::BFloat16*,
                                                   const c10::BFloat16*, const float*, int64_t, int64_t, float, float*);
extern template void attend_pair<float>(const float*, const float*, const float*, const float*, int64_t,
                                        const float*, const float*, int64_t, int64_t, float, float*, float*, float*);
extern template void attend_pair<c10::BFloat16>(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*,
                                                const float*, int64_t, const c10::BFloat16*, const c10::BFloat16*,
                                                int64_t, int64_t, float, float*, float*, c10::BFloat16*);

}  // namespace dcp::decode_simd
