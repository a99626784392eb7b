// Flexformer: linear attention whose random-Fourier-feature kernel has trainable frequencies (Zhang & Zhou,
// "Flexformer: Flexible Linear Transformer with Learnable Attention Kernel", arXiv:2606.27748), built on
// random feature attention (Peng et al. ICLR 2021, RFA) and causal linear attention (Katharopoulos et al. 2020).
// The paper's exact feature map and normaliser are not public; the formulation implemented here is the one
// derived in docs/flexformer.md (spec: shared/specs/flexformer.md).
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dcp/config.h"
#include "dcp/linear_attention.h"
#include "dcp/model.h"

namespace dcp {

/// attention.linear_impl: how training's chunked form and decoding are computed.
enum class LinearAttentionImpl {
  kFused,      ///< the fused chunked kernel with its explicit backward (fused_linear_attention)
  kReference,  ///< autograd over the reference forms (causal_linear_attention), the kernel's twin
};

/// The attention.* switches of the flexformer backend, parsed.
struct FlexformerOptions {
  FeatureMap feature_map = FeatureMap::kStationary;
  int64_t num_features = 64;  ///< m: frequencies per head; features F = 2m (trig) or head_dim (elu)
  InputNorm input_norm = InputNorm::kL2;
  Normalizer normalizer = Normalizer::kShift;
  LinearAttentionForm mode = LinearAttentionForm::kChunk;
  int64_t chunk_size = 64;
  /// kFused runs mode chunk (and decoding) on the fused kernel; modes quadratic and recurrent are reference forms
  /// whatever this says.
  LinearAttentionImpl impl = LinearAttentionImpl::kFused;

  /// Throws ConfigError naming the attention.* key and value that is not allowed.
  static FlexformerOptions from_config(const AttentionConfig& cfg);
};

/// Conditions q or k [T, heads, d] for the feature map (see InputNorm); same shape and dtype.
torch::Tensor condition_input(const torch::Tensor& x, InputNorm norm);

/// Stationary random Fourier features (Rahimi & Recht 2007; RFA): x [T, heads, d], omega [heads, m, d] ->
/// m^{-1/2} [cos(omega x); sin(omega x)], [T, heads, 2m]. phi(x)^T phi(y) = (1/m) sum_i cos(omega_i^T (x - y)).
/// Throws std::invalid_argument for mismatched shapes.
torch::Tensor fourier_features(const torch::Tensor& x, const torch::Tensor& omega);

/// Nonstationary Fourier features (Ton et al. 2018): (4m)^{-1/2} [cos(omega1 x) + cos(omega2 x);
/// sin(omega1 x) + sin(omega2 x)], [T, heads, 2m]; equals fourier_features(x, omega1) when omega2 == omega1.
/// Throws std::invalid_argument for mismatched shapes.
torch::Tensor nonstationary_fourier_features(const torch::Tensor& x, const torch::Tensor& omega1,
                                             const torch::Tensor& omega2);

/// elu(x) + 1 (Katharopoulos et al. 2020): [T, heads, d] -> [T, heads, d], strictly positive.
torch::Tensor elu_features(const torch::Tensor& x);

/// The Flexformer attention operator of one layer: trained frequencies per head, the chosen input norm,
/// feature map and normaliser, computed in one of the three forms. Parameters (names as in checkpoints):
/// "omega" [heads, m, head_dim] (Omega1 for nonstationary; a buffer for fixed), "omega2" [heads, m, head_dim]
/// (nonstationary), "alpha_raw" [heads] (shift: alpha = 1 + softplus(alpha_raw)), "out_norm_weight"
/// [heads * head_dim] (none), buffer "key_norm_offset" [heads] (the constant c of the scale mode's key weight).
/// Initialisation: Omega ~ N(0, I) (sigma0 = 1), so that at step 0 phi(q)^T phi(k) is an unbiased estimate of
/// exp(-|a - b|^2 / 2) for the conditioned a, b: softmax over cosine similarity (l2), over RMS-normalised q, k
/// with 1/sqrt(d) (rms), or softmax itself (scale, with the key weight). Nonstationary: Omega2 ~ N(0, I),
/// Omega1 = Omega2 + 0.01 N(0, I), i.e. it starts at the stationary kernel.
class FlexformerAttention : public torch::nn::Module, public AttentionBackend {
 public:
  /// Throws std::invalid_argument for n_heads, head_dim, num_features or chunk_size < 1.
  FlexformerAttention(const FlexformerOptions& opt, int64_t n_heads, int64_t head_dim);

  /// Causal attention with options().mode and options().chunk_size over all heads: q, k, v [T, heads,
  /// head_dim] -> [T, heads, head_dim] in v's dtype; on the fused kernel when options().impl is kFused and the mode
  /// chunk (attend_fused), else by the reference form (attend).
  torch::Tensor forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& cu_seqlens) const override;
  /// The same on heads [head_offset, head_offset + h) of the layer, q, k, v [T, h, head_dim], with those
  /// heads' parameters (gradients reach only their slices).
  torch::Tensor forward_heads(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& cu_seqlens, int64_t head_offset) const override;

  /// forward with an explicit form and chunk size, an optional initial state per sequence and, when
  /// `final_state` is not null, each sequence's state after its last token written there (decoding: prefill,
  /// then one token per sequence with the previous state). States cover the h heads of the call.
  /// Throws std::invalid_argument for shapes that do not match the layer (naming them) or bad cu_seqlens.
  torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const torch::Tensor& cu_seqlens, int64_t head_offset, LinearAttentionForm form,
                       int64_t chunk_size, const LinearAttentionState* initial = nullptr,
                       LinearAttentionState* final_state = nullptr) const;

  /// The same operator on the fused kernel (fused_linear_attention: features, scan and normaliser in one pass,
  /// explicit backward) with chunks of chunk_size tokens; initial and final states as for attend (same layout;
  /// no gradient flows through them). path forces a kernel path (tests); kAuto picks the fastest. Throws as
  /// attend, and std::invalid_argument for a path this CPU or dtype cannot run.
  torch::Tensor attend_fused(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& cu_seqlens, int64_t head_offset, int64_t chunk_size,
                             const LinearAttentionState* initial = nullptr,
                             LinearAttentionState* final_state = nullptr,
                             LinearAttentionPath path = LinearAttentionPath::kAuto) const;

  /// Query / key features of heads [head_offset, head_offset + x.size(1)) including the shift feature and the
  /// key weight: x [T, h, head_dim] -> [T, h, feature_dim()] in fp32 (fp64 for fp64 x).
  torch::Tensor query_features(const torch::Tensor& x, int64_t head_offset) const;
  torch::Tensor key_features(const torch::Tensor& x, int64_t head_offset) const;

  /// Turns numerator [T, h, Dv] and denominator [T, h] into the output per the normaliser.
  torch::Tensor normalize(const torch::Tensor& numerator, const torch::Tensor& denominator,
                          int64_t head_offset) const;

  const FlexformerOptions& options() const { return opt_; }
  int64_t num_heads() const { return n_heads_; }
  int64_t head_dim() const { return head_dim_; }
  int64_t feature_dim() const;  ///< F' = (2m or head_dim) + 1 for the shift feature

  torch::Tensor omega, omega2, alpha_raw, out_norm_weight, key_norm_offset;  ///< undefined when not used

 private:
  torch::Tensor features(const torch::Tensor& x, int64_t head_offset, bool is_key) const;
  void check_heads(const torch::Tensor& x, int64_t head_offset, const char* what) const;

  FlexformerOptions opt_;
  int64_t n_heads_, head_dim_;
};

/// Recurrent decoding of a flexformer Transformer: passed as PackedBatch::attention, it runs every block's
/// FlexformerAttention from that layer's carried state and keeps the state after the batch. With impl kFused both
/// the prefill and every one-token step run the fused kernel (one kernel, one state layout); with kReference a
/// call with one token per sequence uses the recurrent form, a longer one (the prefill) the chunked form. Positions must
/// continue where the previous batch stopped; call reset() to start new sequences.
/// Throws std::invalid_argument when a block's backend is not a FlexformerAttention or the sequence count
/// differs from the carried state's.
class FlexformerDecoding : public AttentionWrapper {
 public:
  explicit FlexformerDecoding(int64_t n_layers);
  torch::Tensor forward(const AttentionBackend& inner, int64_t layer, const torch::Tensor& q,
                        const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& cu_seqlens) const override;
  void reset();
  /// Layer `layer`'s carried state (undefined tensors before the first batch).
  const LinearAttentionState& state(int64_t layer) const;
  /// Sets layer `layer`'s carried state (the next batch continues from it; RecurrentSession::step_batch stacks its
  /// sessions' states here): s [n_seq, heads, F, Dv] and z [n_seq, heads, F] of one dtype, or both undefined (a
  /// zero state). Throws std::invalid_argument for a layer outside [0, n_layers) or shapes that do not fit together.
  void set_state(int64_t layer, LinearAttentionState state);

 private:
  // Mutable: forward is const in the AttentionWrapper interface, and carrying this state is its purpose.
  mutable std::vector<LinearAttentionState> states_;
};

}  // namespace dcp
