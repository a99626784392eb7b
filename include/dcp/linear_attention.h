// Causal linear attention over a packed stream (Katharopoulos et al. 2020, "Transformers are RNNs"), as fla keeps
// it (fla/ops/linear_attn: naive, chunk, fused_chunk, fused_recurrent):
// - three reference forms of the operator on feature-mapped queries and keys, written with differentiable ATen
//   ops: the masked quadratic form (src/kernels/linear_attention/naive.cpp), the chunked scan (chunk.cpp) and the
//   token-by-token recurrence (recurrent.cpp); Flexformer (dcp/flexformer.h) computes the features and
//   normalises the result around them;
// - the fused chunked kernel of Flexformer's whole operator (fused.cpp): input conditioning, feature map,
//   chunked causal scan and normaliser in one pass over raw q, k, v, with an explicit backward outside autograd.
#pragma once

#include <torch/types.h>

#include <cstdint>

namespace dcp {

/// attention.feature_map: phi applied to the conditioned queries and keys (docs/flexformer.md).
enum class FeatureMap {
  kStationary,     ///< m^{-1/2} [cos(Omega x); sin(Omega x)], Omega trained (FF-S)
  kNonstationary,  ///< (4m)^{-1/2} [cos(Omega1 x) + cos(Omega2 x); sin(Omega1 x) + sin(Omega2 x)], both trained (FF-NS)
  kFixed,          ///< stationary map with untrained frequencies (RFA / Performer style)
  kElu,            ///< elu(x) + 1 (Katharopoulos et al. 2020), no frequencies
};
/// attention.input_norm: how q and k are conditioned before the feature map.
enum class InputNorm {
  kL2,     ///< x / |x| (RFA)
  kRms,    ///< x / rms(x) * d^{-1/4} (QK-RMSNorm folded with the softmax 1/sqrt(d))
  kScale,  ///< x * d^{-1/4}, keys also weighted by exp(|b|^2/2 - c) (softmax recovery, distillation)
};
/// attention.normalizer: how the attention average is kept well defined despite signed kernel estimates.
enum class Normalizer {
  kShift,  ///< append a feature alpha >= 1 to q and k features: kernel alpha^2 + K >= 0
  kClamp,  ///< divide by max(denominator, kClampEps) (RFA)
  kNone,   ///< no denominator; per-head output RMSNorm with a learned gain (fla LinearAttention default)
};
/// Denominators below this are clamped by Normalizer::kClamp (features are bounded by 1, see docs/flexformer.md).
inline constexpr double kClampEps = 1e-2;
/// Added to the denominator under Normalizer::kShift, which is >= 0 by construction (exactly 0 only if alpha = 1).
inline constexpr double kShiftEps = 1e-6;
/// Added to the mean square of the numerator under Normalizer::kNone (its RMSNorm).
inline constexpr double kOutNormEps = 1e-6;
/// Added to |x|^2 (l2) and mean(x^2) (rms) by the input conditioning: keeps the norms differentiable at x = 0.
inline constexpr double kInputNormEps = 1e-6;

/// attention.mode: the three computations of the same operator.
enum class LinearAttentionForm {
  kQuadratic,  ///< masked phi(Q) phi(K)^T per sequence: the O(L^2) reference
  kChunk,      ///< chunked causal scan: O(T C F + T F Dv), working memory O(C^2 + F Dv) per head
  kRecurrent,  ///< token-by-token state update, as in decoding
};

/// Per-sequence state of causal linear attention: for every sequence and head, S = sum_s phi(k_s) v_s^T and
/// z = sum_s phi(k_s) over the tokens seen so far. Kept in fp32 (fp64 for fp64 inputs) whatever the input dtype.
struct LinearAttentionState {
  torch::Tensor s;  ///< [n_seq, heads, F, Dv]
  torch::Tensor z;  ///< [n_seq, heads, F]
};

/// Result of causal_linear_attention; y_t = numerator_t / denominator_t is the kernelised attention average.
struct LinearAttentionOutput {
  torch::Tensor numerator;          ///< [T, heads, Dv]: phi(q_t)^T S_t
  torch::Tensor denominator;        ///< [T, heads]: phi(q_t)^T z_t
  LinearAttentionState final_state; ///< each sequence's state after its last token; set only when requested
};

/// Causal linear attention over a packed stream of features, unnormalised (Katharopoulos et al. 2020; chunked
/// form as fla's naive_chunk_linear_attn). Sequence i is tokens [cu_seqlens[i], cu_seqlens[i+1]); each starts
/// from `initial` (null: zero state) and nothing crosses a boundary. S_t includes token t.
/// phi_q, phi_k: [T, heads, F]; v: [T, heads, Dv]; all of one dtype, float32 or float64, on one device.
/// cu_seqlens: [n_seq + 1] int64, non-decreasing from 0 to T (read on the host). chunk_size (>= 1) is used by
/// kChunk only. The three forms give the same result up to rounding.
/// Throws std::invalid_argument naming the argument for a bad shape, dtype, cu_seqlens, chunk_size or state.
LinearAttentionOutput causal_linear_attention(const torch::Tensor& phi_q, const torch::Tensor& phi_k,
                                              const torch::Tensor& v, const torch::Tensor& cu_seqlens,
                                              LinearAttentionForm form, int64_t chunk_size,
                                              const LinearAttentionState* initial = nullptr,
                                              bool return_final_state = false);

// ---- the fused kernel ----------------------------------------------------------------------------------------

/// Flexformer's feature map and normaliser as the fused kernel computes them, with the parameters of the h heads
/// of one call (docs/flexformer.md "Formulation"): a = cond(q), b = cond(k) by input_norm; phi_q = [alpha;
/// phi(a)], phi_k = w [alpha; phi(b)] with the key weight w = exp(|b|^2/2 - c) where key_offset is given (else
/// w = 1) and the shift feature alpha where alpha is given. Parameters may be fp32 or fp64 (any layout); the
/// kernel computes with them in its accumulator precision and returns their gradients in their dtype.
struct FusedFeatureMap {
  FeatureMap feature_map = FeatureMap::kStationary;
  InputNorm input_norm = InputNorm::kL2;
  Normalizer normalizer = Normalizer::kShift;
  torch::Tensor omega;       ///< [h, m, head_dim]: Omega (Omega1 for nonstationary); undefined for elu
  torch::Tensor omega2;      ///< [h, m, head_dim]: Omega2 for nonstationary, else undefined
  torch::Tensor alpha;       ///< [h]: the shift feature alpha for normalizer shift, else undefined
  torch::Tensor key_offset;  ///< [h]: c of the key weight (input_norm scale with a trig map), else undefined
};

/// Which tile products the fused kernel runs on; kAuto picks the fastest this CPU has for the input dtype.
enum class LinearAttentionPath {
  kAuto,
  kPortable,    ///< plain C++ loops in the accumulator precision (fp64 inputs always; any CPU)
  kAvx512,      ///< fp32 products on AVX-512F registers (fp32 inputs; bf16 inputs read into fp32 tiles)
  kAvx512Bf16,  ///< bf16 inputs: the scan's products on bf16 operands with vdpbf16ps (AVX512-BF16), fp32 accumulators
  kAmx,         ///< bf16 inputs: the scan's products on AMX tiles (tdpbf16ps), fp32 accumulators
};
/// "auto", "portable", "avx512", "avx512-bf16", "amx".
const char* to_string(LinearAttentionPath path);

/// Tunables of the fused kernel.
struct FusedLinearAttentionOptions {
  int64_t chunk_size = 64;  ///< tokens per chunk C (>= 1): intra-chunk work C^2 per head, state products F x head_dim
  LinearAttentionPath path = LinearAttentionPath::kAuto;  ///< forced paths throw where the CPU or dtype lacks them
};

/// The path `requested` resolves to for inputs of `dtype` on this CPU (kAuto: fp64 -> portable; fp32 -> avx512 where
/// usable; bf16 -> amx, else avx512-bf16, else avx512, else portable). Throws std::invalid_argument naming the path,
/// the dtype and the missing CPU feature when a forced path cannot run.
LinearAttentionPath resolve_linear_attention_path(torch::ScalarType dtype, LinearAttentionPath requested);

/// Bytes of the per-thread workspace one pass of the fused kernel takes (fixed tiles of chunk_size tokens, its state
/// and, on the bf16 paths, the operand packs) for inputs of `dtype` on the resolved `path`; num_frequencies is m
/// (unused for elu). A pass allocates one per intra-op thread, beside its outputs.
int64_t fused_linear_attention_workspace_bytes(torch::ScalarType dtype, LinearAttentionPath path, FeatureMap map,
                                               int64_t head_dim, int64_t num_frequencies, int64_t chunk_size);

/// Forward of the fused kernel.
struct FusedLinearAttentionResult {
  /// [T, h, head_dim] in v's dtype: y_t = numerator_t / denominator_t (shift: + kShiftEps; clamp: max with
  /// kClampEps) or, for normalizer none, numerator_t * rsqrt(mean(numerator_t^2) + kOutNormEps) without the
  /// gain (the caller multiplies by it, so that its gradient stays with autograd).
  torch::Tensor out;
  /// [T, h] fp32 (fp64 for fp64 inputs): the denominator (shift, clamp) or the RMS factor (none), kept for the
  /// backward as the tiled softmax keeps its logsumexp.
  torch::Tensor stat;
  /// [T, h, head_dim] bf16, for bf16 inputs only (else undefined): out's rounding residual, bf16(y - out), so that
  /// the backward's dden = -(dy . y) / den sees y to about 16 bits. Alpha's gradient is a difference of two nearly
  /// equal sums over all tokens; from the bf16 out alone it was measured 1-10% off (docs/flexformer.md).
  torch::Tensor out_residual;
  LinearAttentionState final_state;  ///< set only when requested; the reference forms' layout (shift feature first)
};

/// Gradients of the fused kernel. Undefined where the map has no such parameter.
struct FusedLinearAttentionGrads {
  torch::Tensor dq, dk, dv;  ///< [T, h, head_dim], dtype of q
  torch::Tensor domega;      ///< [h, m, head_dim], dtype of omega
  torch::Tensor domega2;     ///< [h, m, head_dim]
  torch::Tensor dalpha;      ///< [h]
};

/// Flexformer's causal linear attention in one pass (docs/flexformer.md "The fused kernel"): per (sequence, head)
/// and chunk of C tokens, the conditioned inputs and their features are computed from the parameters, then
/// y = (mask(phi_q phi_k^T) V + phi_q S) / (mask(phi_q phi_k^T) 1 + phi_q z) with the running state S, z carried
/// from chunk to chunk in fp32 (fp64) accumulators (fla's fused_chunk form; Katharopoulos et al. 2020, eq. 9-10,
/// 16-20), and the normaliser applied. q, k, v: [T, h, head_dim], one dtype among fp32, bf16, fp64, on the CPU,
/// last dimension contiguous. cu_seqlens: [n_seq + 1] int64, non-decreasing from 0 to T; every sequence starts
/// from `initial` (null: zero state; its tensors [n_seq, h, F', head_dim] and [n_seq, h, F'] in the accumulator
/// dtype, F' = F + 1 with the shift feature first, as the reference forms) and nothing crosses a boundary.
/// Parallel over (sequence, head) and, for a long sequence, over chunk ranges: each range's state sum is
/// computed first (the state pass) and the ranges start from their prefix. Throws std::invalid_argument naming
/// the argument for bad shapes, dtypes, devices, cu_seqlens, chunk_size, parameters or path.
FusedLinearAttentionResult fused_linear_attention_forward(const torch::Tensor& q, const torch::Tensor& k,
                                                          const torch::Tensor& v, const torch::Tensor& cu_seqlens,
                                                          const FusedFeatureMap& map,
                                                          const FusedLinearAttentionOptions& options = {},
                                                          const LinearAttentionState* initial = nullptr,
                                                          bool return_final_state = false);

/// The explicit backward (Katharopoulos et al. 2020 section 3.3.1, by chunks as fla's fused_chunk): nothing of
/// the forward is kept but its output and `stat`. Per (sequence, head), a forward sweep over the chunks recomputes
/// the features and the running state and gives dq (dq_t needs the state before t), then a reverse sweep carries
/// the state's gradient dS, dz from the end and gives dk and dv; frequency, alpha gradients accumulate per unit
/// and are summed in a fixed order (the same bits for a given thread count). The trade: features and states are
/// recomputed (about 1.6x the forward's products again) instead of storing a state per chunk (F x head_dim per C
/// tokens and head, 1.3-2.6x the inputs' bytes at the defaults). Besides dq, dk, dv it allocates, with a
/// denominator (normalizer shift or clamp), one [T, h] fp32 (fp64 for fp64 inputs) tensor of the denominator's
/// gradient per token, which the first sweep writes and the second reads instead of the output (2 / head_dim of
/// dq's bytes in bf16, 1 / head_dim in fp32). dout: [T, h, head_dim] in q's dtype; `saved` the forward's result
/// (out, stat, out_residual; its final_state is not read). Throws as the forward.
FusedLinearAttentionGrads fused_linear_attention_backward(const torch::Tensor& dout, const torch::Tensor& q,
                                                          const torch::Tensor& k, const torch::Tensor& v,
                                                          const FusedLinearAttentionResult& saved,
                                                          const torch::Tensor& cu_seqlens, const FusedFeatureMap& map,
                                                          const FusedLinearAttentionOptions& options = {},
                                                          const LinearAttentionState* initial = nullptr);

/// The fused kernel as a differentiable function (a custom autograd Function around the two above; the backward
/// is not itself differentiable): out [T, h, head_dim], with gradients for q, k, v, map.omega, map.omega2 and
/// map.alpha. With `final_state` not null, each sequence's final state is written there (no gradient flows
/// through states, nor into `initial`).
torch::Tensor fused_linear_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     const torch::Tensor& cu_seqlens, const FusedFeatureMap& map,
                                     const FusedLinearAttentionOptions& options = {},
                                     const LinearAttentionState* initial = nullptr,
                                     LinearAttentionState* final_state = nullptr);

}  // namespace dcp
