// The AVX-512 path of the decode kernel (kv_decode_attention): one (sequence, head) pair over raw rows. Internal to
// the infer stage; callers check avx512_usable() first (the functions carry their own target attributes).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace dcp::decode_simd {

/// softmax(q.K^T * scale + bias) V over n cache rows and the token's own (k_new, v_new), on AVX-512F registers in
/// fp32: pass 1 the n + 1 scores (each a 16-lane FMA chain over head_dim, then one fixed-order lane reduction),
/// pass 2 their maximum, exp (dcp::simd::exp, ~1 ulp) and sum, pass 3 the probability-weighted value rows
/// (value_dim in 16-lane accumulators). The order of every sum depends only on this pair's rows, so a pair gives the
/// same bits alone or among others. q, keys [n, d], values [n, dv], k_new [d], v_new [dv] in T (fp32 or bf16);
/// bias [n] fp32 (the entries' log-weights); qs: scratch of d floats (the scaled query); scores: scratch of
/// n + 1 floats; out [dv] in T.
template <class T>
void attend_pair(const T* q, const T* keys, const T* values, const float* bias, int64_t n, const T* k_new,
                 const T* v_new, int64_t d, int64_t dv, float scale, float* qs, float* scores, T* out);

extern template void attend_pair<float>(const float*, const float*, const float*, const float*, int64_t,
                                        const float*, const float*, int64_t, int64_t, float, float*, float*, float*);
extern template void attend_pair<c10::BFloat16>(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*,
                                                const float*, int64_t, const c10::BFloat16*, const c10::BFloat16*,
                                                int64_t, int64_t, float, float*, float*, c10::BFloat16*);

}  // namespace dcp::decode_simd
