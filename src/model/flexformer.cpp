// The Flexformer attention module (per-layer, per-head frequencies), its options and recurrent decoding.
#include "dcp/flexformer.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace dcp {
namespace {

// sigma0 of the frequency init: Omega ~ N(0, I) makes phi(a)^T phi(b) estimate exp(-|a - b|^2 / 2).
constexpr double kOmegaInitStd = 1.0;
// Nonstationary pairs start this close (relative to sigma0), i.e. at the stationary kernel (spec section 4).
constexpr double kPairInitNoise = 1e-2;
// alpha = 1 + softplus(alpha_raw) starts at 1.05: denominators >= (alpha^2 - 1) t = 0.1 t from step 0.
constexpr double kAlphaInit = 1.05;

template <typename E>
E pick(const std::string& key, const std::string& value, std::initializer_list<std::pair<const char*, E>> choices) {
  std::string allowed;
  for (const auto& [name, e] : choices) {
    if (value == name) return e;
    allowed += (allowed.empty() ? "" : ", ") + std::string(name);
  }
  throw ConfigError("config key '" + key + "': bad value '" + value + "' (allowed: " + allowed + ")");
}

bool is_trig(FeatureMap f) { return f != FeatureMap::kElu; }

}  // namespace

FlexformerOptions FlexformerOptions::from_config(const AttentionConfig& cfg) {
  FlexformerOptions o;
  o.feature_map = pick<FeatureMap>("attention.feature_map", cfg.feature_map,
                                   {{"stationary", FeatureMap::kStationary},
                                    {"nonstationary", FeatureMap::kNonstationary},
                                    {"fixed", FeatureMap::kFixed},
                                    {"elu", FeatureMap::kElu}});
  o.input_norm = pick<InputNorm>("attention.input_norm", cfg.input_norm,
                                 {{"l2", InputNorm::kL2}, {"rms", InputNorm::kRms}, {"scale", InputNorm::kScale}});
  o.normalizer = pick<Normalizer>("attention.normalizer", cfg.normalizer,
                                  {{"shift", Normalizer::kShift}, {"clamp", Normalizer::kClamp}, {"none", Normalizer::kNone}});
  o.mode = pick<LinearAttentionForm>("attention.mode", cfg.mode,
                                     {{"chunk", LinearAttentionForm::kChunk},
                                      {"quadratic", LinearAttentionForm::kQuadratic},
                                      {"recurrent", LinearAttentionForm::kRecurrent}});
  o.impl = pick<LinearAttentionImpl>("attention.linear_impl", cfg.linear_impl,
                                     {{"fused", LinearAttentionImpl::kFused}, {"reference", LinearAttentionImpl::kReference}});
  if (cfg.num_features < 1) {
    throw ConfigError("config key 'attention.num_features': bad value '" + std::to_string(cfg.num_features) +
                      "' (allowed: >= 1)");
  }
  if (cfg.chunk_size < 1) {
    throw ConfigError("config key 'attention.chunk_size': bad value '" + std::to_string(cfg.chunk_size) +
                      "' (allowed: >= 1)");
  }
  o.num_features = cfg.num_features;
  o.chunk_size = cfg.chunk_size;
  return o;
}

FlexformerAttention::FlexformerAttention(const FlexformerOptions& opt, int64_t n_heads, int64_t head_dim)
    : opt_(opt), n_heads_(n_heads), head_dim_(head_dim) {
  if (n_heads < 1 || head_dim < 1 || opt.num_features < 1 || opt.chunk_size < 1) {
    throw std::invalid_argument("FlexformerAttention: n_heads " + std::to_string(n_heads) + ", head_dim " +
                                std::to_string(head_dim) + ", num_features " + std::to_string(opt.num_features) +
                                " and chunk_size " + std::to_string(opt.chunk_size) + " must all be >= 1");
  }
  const int64_t m = opt.num_features;
  auto gaussian = [&] { return torch::randn({n_heads, m, head_dim}) * kOmegaInitStd; };
  switch (opt.feature_map) {
    case FeatureMap::kStationary: omega = register_parameter("omega", gaussian()); break;
    case FeatureMap::kFixed: omega = register_buffer("omega", gaussian()); break;
    case FeatureMap::kNonstationary: {
      auto base = gaussian();
      omega = register_parameter("omega", base + kPairInitNoise * gaussian());
      omega2 = register_parameter("omega2", base);
      break;
    }
    case FeatureMap::kElu: break;
  }
  if (opt.normalizer == Normalizer::kShift) {
    alpha_raw = register_parameter("alpha_raw", torch::full({n_heads}, std::log(std::expm1(kAlphaInit - 1.0))));
  }
  if (opt.normalizer == Normalizer::kNone) {
    // Flat [heads * head_dim]: a gain, like the model's other norm gains (1-D, so not weight-decayed).
    out_norm_weight = register_parameter("out_norm_weight", torch::ones({n_heads * head_dim}));
  }
  if (opt.input_norm == InputNorm::kScale && is_trig(opt.feature_map)) {
    key_norm_offset = register_buffer("key_norm_offset", torch::zeros({n_heads}));
  }
}

int64_t FlexformerAttention::feature_dim() const {
  const int64_t base = is_trig(opt_.feature_map) ? 2 * opt_.num_features : head_dim_;
  return base + (opt_.normalizer == Normalizer::kShift ? 1 : 0);
}

void FlexformerAttention::check_heads(const torch::Tensor& x, int64_t head_offset, const char* what) const {
  if (x.dim() != 3 || x.size(2) != head_dim_ || head_offset < 0 || head_offset + x.size(1) > n_heads_) {
    throw std::invalid_argument(
        std::string("FlexformerAttention: ") + what + " must be [T, h, " + std::to_string(head_dim_) +
        "] with head_offset + h <= " + std::to_string(n_heads_) + ", got " + std::to_string(x.dim()) + " dims" +
        (x.dim() == 3 ? " [" + std::to_string(x.size(0)) + ", " + std::to_string(x.size(1)) + ", " +
                            std::to_string(x.size(2)) + "]"
                      : std::string()) +
        " and head_offset " + std::to_string(head_offset));
  }
}

torch::Tensor FlexformerAttention::features(const torch::Tensor& x_in, int64_t head_offset, bool is_key) const {
  check_heads(x_in, head_offset, is_key ? "k" : "q");
  // Features and states in fp32 (fp64 for fp64 inputs) whatever the input dtype: sums over long sequences.
  const auto dtype = x_in.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  const torch::Tensor x = condition_input(x_in.to(dtype), opt_.input_norm);
  const int64_t h = x.size(1);
  auto heads_of = [&](const torch::Tensor& p) { return p.narrow(0, head_offset, h).to(dtype); };
  torch::Tensor phi;
  switch (opt_.feature_map) {
    case FeatureMap::kStationary:
    case FeatureMap::kFixed: phi = fourier_features(x, heads_of(omega)); break;
    case FeatureMap::kNonstationary: phi = nonstationary_fourier_features(x, heads_of(omega), heads_of(omega2)); break;
    case FeatureMap::kElu: phi = elu_features(x); break;
  }
  if (opt_.normalizer == Normalizer::kShift) {
    // [alpha; phi] on both sides: kernel alpha^2 + K >= alpha^2 - 1 >= 0 because |K| <= 1 for trig features.
    auto alpha = (1.0 + torch::softplus(heads_of(alpha_raw))).view({1, h, 1}).expand({x.size(0), h, 1});
    phi = torch::cat({alpha, phi}, -1);
  }
  if (is_key && key_norm_offset.defined()) {
    // exp(q.k / sqrt d) = exp(|a|^2/2) exp(|b|^2/2) exp(-|a-b|^2/2): the query factor cancels in the average,
    // the key factor stays as a positive per-key weight; c is a fixed constant, never a max over the batch.
    auto c = heads_of(key_norm_offset).view({1, h, 1});
    phi = phi * torch::exp(0.5 * x.pow(2).sum(-1, /*keepdim=*/true) - c);
  }
  return phi;
}

torch::Tensor FlexformerAttention::query_features(const torch::Tensor& x, int64_t head_offset) const {
  return features(x, head_offset, /*is_key=*/false);
}

torch::Tensor FlexformerAttention::key_features(const torch::Tensor& x, int64_t head_offset) const {
  return features(x, head_offset, /*is_key=*/true);
}

torch::Tensor FlexformerAttention::normalize(const torch::Tensor& numerator, const torch::Tensor& denominator,
                                             int64_t head_offset) const {
  switch (opt_.normalizer) {
    case Normalizer::kShift: return numerator / (denominator + kShiftEps).unsqueeze(-1);
    case Normalizer::kClamp:
      // clamp_min passes no gradient where it clamps, as RFA's backward masks it.
      return numerator / denominator.clamp_min(kClampEps).unsqueeze(-1);
    case Normalizer::kNone: {
      const int64_t h = numerator.size(1), dv = numerator.size(2);
      auto gain = out_norm_weight.narrow(0, head_offset * dv, h * dv).view({h, dv}).to(numerator.scalar_type());
      return numerator * torch::rsqrt(numerator.pow(2).mean(-1, /*keepdim=*/true) + kOutNormEps) * gain;
    }
  }
  throw std::invalid_argument("FlexformerAttention: unknown normalizer");
}

torch::Tensor FlexformerAttention::attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                          const torch::Tensor& cu_seqlens, int64_t head_offset,
                                          LinearAttentionForm form, int64_t chunk_size,
                                          const LinearAttentionState* initial,
                                          LinearAttentionState* final_state) const {
  check_heads(v, head_offset, "v");
  if (q.sizes() != v.sizes() || k.sizes() != v.sizes()) {
    throw std::invalid_argument("FlexformerAttention: q, k and v must have the same shape");
  }
  auto phi_q = query_features(q, head_offset);
  auto phi_k = key_features(k, head_offset);
  auto out = causal_linear_attention(phi_q, phi_k, v.to(phi_q.scalar_type()), cu_seqlens, form, chunk_size, initial,
                                     final_state != nullptr);
  if (final_state) *final_state = out.final_state;
  return normalize(out.numerator, out.denominator, head_offset).to(v.scalar_type());
}

torch::Tensor FlexformerAttention::attend_fused(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                                const torch::Tensor& cu_seqlens, int64_t head_offset,
                                                int64_t chunk_size, const LinearAttentionState* initial,
                                                LinearAttentionState* final_state, LinearAttentionPath path) const {
  check_heads(q, head_offset, "q");
  check_heads(v, head_offset, "v");
  if (q.sizes() != v.sizes() || k.sizes() != v.sizes()) {
    throw std::invalid_argument("FlexformerAttention: q, k and v must have the same shape");
  }
  const int64_t h = q.size(1);
  auto heads_of = [&](const torch::Tensor& p) { return p.defined() ? p.narrow(0, head_offset, h) : torch::Tensor(); };
  FusedFeatureMap map;
  map.feature_map = opt_.feature_map;
  map.input_norm = opt_.input_norm;
  map.normalizer = opt_.normalizer;
  map.omega = heads_of(omega);
  map.omega2 = heads_of(omega2);
  if (alpha_raw.defined()) map.alpha = 1.0 + torch::softplus(heads_of(alpha_raw));
  map.key_offset = heads_of(key_norm_offset);
  FusedLinearAttentionOptions options;
  options.chunk_size = chunk_size;
  options.path = path;
  torch::Tensor out = fused_linear_attention(q, k, v, cu_seqlens, map, options, initial, final_state);
  if (opt_.normalizer == Normalizer::kNone) {
    // The kernel returns the RMS-normalised numerator; the gain stays with autograd.
    const int64_t dv = v.size(2);
    out = (out * out_norm_weight.narrow(0, head_offset * dv, h * dv).view({h, dv})).to(v.scalar_type());
  }
  return out;
}

torch::Tensor FlexformerAttention::forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                           const torch::Tensor& cu_seqlens) const {
  if (q.dim() == 3 && q.size(1) != n_heads_) {
    throw std::invalid_argument("FlexformerAttention: forward needs all " + std::to_string(n_heads_) +
                                " heads, got " + std::to_string(q.size(1)) + " (use forward_heads for a slice)");
  }
  return forward_heads(q, k, v, cu_seqlens, 0);
}

torch::Tensor FlexformerAttention::forward_heads(const torch::Tensor& q, const torch::Tensor& k,
                                                 const torch::Tensor& v, const torch::Tensor& cu_seqlens,
                                                 int64_t head_offset) const {
  if (opt_.impl == LinearAttentionImpl::kFused && opt_.mode == LinearAttentionForm::kChunk) {
    return attend_fused(q, k, v, cu_seqlens, head_offset, opt_.chunk_size);
  }
  return attend(q, k, v, cu_seqlens, head_offset, opt_.mode, opt_.chunk_size);
}

FlexformerDecoding::FlexformerDecoding(int64_t n_layers) {
  if (n_layers < 1) throw std::invalid_argument("FlexformerDecoding: n_layers must be >= 1, got " + std::to_string(n_layers));
  states_.resize(static_cast<size_t>(n_layers));
}

void FlexformerDecoding::reset() {
  for (auto& s : states_) s = LinearAttentionState{};
}

const LinearAttentionState& FlexformerDecoding::state(int64_t layer) const {
  if (layer < 0 || layer >= static_cast<int64_t>(states_.size())) {
    throw std::invalid_argument("FlexformerDecoding: layer " + std::to_string(layer) + " outside [0, " +
                                std::to_string(states_.size()) + ")");
  }
  return states_[static_cast<size_t>(layer)];
}

void FlexformerDecoding::set_state(int64_t layer, LinearAttentionState st) {
  state(layer);  // checks the layer
  if (st.s.defined() != st.z.defined()) {
    throw std::invalid_argument("FlexformerDecoding::set_state: layer " + std::to_string(layer) +
                                ": s and z must both be defined or both undefined");
  }
  if (st.s.defined() && (st.s.dim() != 4 || st.z.dim() != 3 || st.s.size(0) != st.z.size(0) ||
                         st.s.size(1) != st.z.size(1) || st.s.size(2) != st.z.size(2) ||
                         st.s.scalar_type() != st.z.scalar_type())) {
    throw std::invalid_argument("FlexformerDecoding::set_state: layer " + std::to_string(layer) + ": s " +
                                c10::str(st.s.sizes()) + " and z " + c10::str(st.z.sizes()) +
                                " must be [n_seq, heads, F, Dv] and [n_seq, heads, F] of one dtype");
  }
  states_[static_cast<size_t>(layer)] = std::move(st);
}

torch::Tensor FlexformerDecoding::forward(const AttentionBackend& inner, int64_t layer, const torch::Tensor& q,
                                          const torch::Tensor& k, const torch::Tensor& v,
                                          const torch::Tensor& cu_seqlens) const {
  const auto* flex = dynamic_cast<const FlexformerAttention*>(&inner);
  if (!flex) {
    throw std::invalid_argument("FlexformerDecoding: the attention backend of layer " + std::to_string(layer) +
                                " is not flexformer (recurrent decoding needs attention.backend: flexformer)");
  }
  const LinearAttentionState& carried = state(layer);
  const int64_t n_seq = cu_seqlens.numel() - 1;
  LinearAttentionState next;
  torch::Tensor out;
  if (flex->options().impl == LinearAttentionImpl::kFused) {
    // Prefill and one-token steps alike: the fused kernel from the carried state (a one-token sequence is one
    // chunk: S += phi(k) [v, 1]^T, out = phi(q)^T S, the recurrent step).
    out = flex->attend_fused(q, k, v, cu_seqlens, 0, flex->options().chunk_size,
                             carried.s.defined() ? &carried : nullptr, &next);
  } else {
    // One new token per sequence: the plain recurrence; a prompt: the chunked form, which also returns the state.
    const auto form = q.size(0) == n_seq ? LinearAttentionForm::kRecurrent : LinearAttentionForm::kChunk;
    out = flex->attend(q, k, v, cu_seqlens, 0, form, flex->options().chunk_size,
                       carried.s.defined() ? &carried : nullptr, &next);
  }
  states_[static_cast<size_t>(layer)] = next;
  return out;
}

}  // namespace dcp
