// Flexformer: the three forms agree, gradients (finite differences), causality and isolation, decoding state,
// the kernel estimate, learnability of the nonstationary map, and the backend inside a Transformer.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "dcp/flexformer.h"
#include "dcp/infer.h"
#include "dcp/model.h"
#include "unit/error_of.h"

using namespace dcp;
using dcp::test::error_of;

namespace {

FlexformerOptions options(FeatureMap f = FeatureMap::kStationary, Normalizer n = Normalizer::kShift,
                          InputNorm in = InputNorm::kL2, int64_t m = 8) {
  FlexformerOptions o;
  o.feature_map = f;
  o.normalizer = n;
  o.input_norm = in;
  o.num_features = m;
  return o;
}

const std::vector<FeatureMap> kMaps{FeatureMap::kStationary, FeatureMap::kNonstationary, FeatureMap::kFixed,
                                    FeatureMap::kElu};
const std::vector<Normalizer> kNormalizers{Normalizer::kShift, Normalizer::kClamp, Normalizer::kNone};
const std::vector<InputNorm> kInputNorms{InputNorm::kL2, InputNorm::kRms, InputNorm::kScale};

std::string name_of(FeatureMap f, Normalizer n, InputNorm in) {
  const char* fm[] = {"stationary", "nonstationary", "fixed", "elu"};
  const char* nm[] = {"shift", "clamp", "none"};
  const char* im[] = {"l2", "rms", "scale"};
  return std::string(fm[static_cast<int>(f)]) + "/" + nm[static_cast<int>(n)] + "/" + im[static_cast<int>(in)];
}

torch::Tensor cu_of(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> cu{0};
  for (int64_t l : lengths) cu.push_back(cu.back() + l);
  return torch::tensor(cu, torch::kInt64);
}

struct QKV {
  torch::Tensor q, k, v;
};

QKV random_qkv(int64_t tokens, int64_t heads, int64_t dim, torch::ScalarType dtype = torch::kFloat) {
  auto opt = torch::TensorOptions().dtype(dtype);
  return {torch::randn({tokens, heads, dim}, opt), torch::randn({tokens, heads, dim}, opt),
          torch::randn({tokens, heads, dim}, opt)};
}

double max_diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

// Tokens of a stream of tiny vocabulary-free "documents" for model-level tests.
PackedBatch random_batch(const std::vector<int64_t>& lengths) {
  std::vector<torch::Tensor> positions;
  for (int64_t len : lengths) positions.push_back(torch::arange(len, torch::kInt64));
  PackedBatch b;
  b.cu_seqlens = cu_of(lengths);
  const int64_t total = b.cu_seqlens[-1].item<int64_t>();
  b.tokens = torch::randint(0, kVocabSize, {total}, torch::kInt64);
  b.targets = torch::randint(0, 256, {total}, torch::kInt64);
  b.positions = torch::cat(positions);
  for (size_t i = 0; i < lengths.size(); ++i) b.sample_ids.push_back(static_cast<int64_t>(i));
  return b;
}

ModelConfig tiny_model() {
  ModelConfig cfg;
  cfg.d_model = 32;
  cfg.n_layers = 3;
  cfg.n_heads = 4;
  cfg.d_ff = 64;
  return cfg;
}

AttentionConfig flex_config(const std::string& feature_map = "stationary", const std::string& normalizer = "shift") {
  AttentionConfig a;
  a.backend = "flexformer";
  a.feature_map = feature_map;
  a.normalizer = normalizer;
  a.num_features = 8;
  a.chunk_size = 4;
  return a;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// Forms

TEST(FlexformerForms, QuadraticChunkAndRecurrentAgreeOnPackedInput) {
  torch::manual_seed(1);
  // A long sequence, a 1-token one, an empty segment, several not dividing any chunk size.
  const std::vector<int64_t> lengths{5, 17, 1, 0, 70, 9};
  const auto cu = cu_of(lengths);
  auto x = random_qkv(102, 2, 8);
  for (FeatureMap f : kMaps) {
    for (Normalizer n : kNormalizers) {
      FlexformerAttention att(options(f, n), 2, 8);
      auto ref = att.attend(x.q, x.k, x.v, cu, 0, LinearAttentionForm::kQuadratic, 1);
      auto rec = att.attend(x.q, x.k, x.v, cu, 0, LinearAttentionForm::kRecurrent, 1);
      // Relative: clamp and none can amplify (small denominators, small numerator norms) rounding alike.
      EXPECT_TRUE(torch::allclose(rec, ref, 1e-4, 2e-5)) << name_of(f, n, InputNorm::kL2) << ": " << max_diff(rec, ref);
      // 1 << 20: a chunk longer than the whole stream is capped to it (it used to allocate C^2 of padding).
      for (int64_t c : {int64_t{1}, int64_t{3}, int64_t{16}, int64_t{64}, int64_t{1} << 20}) {
        auto chunk = att.attend(x.q, x.k, x.v, cu, 0, LinearAttentionForm::kChunk, c);
        EXPECT_TRUE(torch::allclose(chunk, ref, 1e-4, 2e-5))
            << name_of(f, n, InputNorm::kL2) << " chunk " << c << ": " << max_diff(chunk, ref);
      }
    }
  }
}

TEST(FlexformerForms, UnnormalisedCoreMatchesDenseMaskedProduct) {
  torch::manual_seed(2);
  const std::vector<int64_t> lengths{6, 13, 4};
  const int64_t total = 23, heads = 3, f = 5, dv = 4;
  auto p = torch::randn({total, heads, f}), r = torch::randn({total, heads, f}), v = torch::randn({total, heads, dv});
  // Plain dense reference over the whole stream: block-diagonal causal mask.
  std::vector<int64_t> owner;
  for (size_t i = 0; i < lengths.size(); ++i) owner.insert(owner.end(), static_cast<size_t>(lengths[i]), int64_t(i));
  auto doc = torch::tensor(owner, torch::kInt64);
  auto mask = (doc.unsqueeze(1) == doc.unsqueeze(0)) & torch::ones({total, total}, torch::kBool).tril();
  auto a = torch::matmul(p.transpose(0, 1), r.transpose(0, 1).transpose(1, 2)) * mask;  // [H, T, T]
  auto num = torch::matmul(a, v.transpose(0, 1)).transpose(0, 1);
  auto den = a.sum(-1).transpose(0, 1);
  for (auto form : {LinearAttentionForm::kQuadratic, LinearAttentionForm::kChunk, LinearAttentionForm::kRecurrent}) {
    auto out = causal_linear_attention(p, r, v, cu_of(lengths), form, 5);
    EXPECT_LT(max_diff(out.numerator, num), 1e-5);
    EXPECT_LT(max_diff(out.denominator, den), 1e-5);
  }
}

TEST(FlexformerForms, GradientsAgreeAcrossForms) {
  torch::manual_seed(3);
  const auto cu = cu_of({9, 30, 2});
  auto x = random_qkv(41, 2, 8);
  FlexformerAttention att(options(FeatureMap::kNonstationary, Normalizer::kShift), 2, 8);
  auto w = torch::randn({41, 2, 8});
  std::vector<std::vector<torch::Tensor>> grads;
  for (auto form : {LinearAttentionForm::kQuadratic, LinearAttentionForm::kChunk, LinearAttentionForm::kRecurrent}) {
    auto q = x.q.clone().requires_grad_(true), k = x.k.clone().requires_grad_(true),
         v = x.v.clone().requires_grad_(true);
    att.zero_grad();
    (att.attend(q, k, v, cu, 0, form, 7) * w).sum().backward();
    grads.push_back({q.grad(), k.grad(), v.grad(), att.omega.grad().clone(), att.omega2.grad().clone(),
                     att.alpha_raw.grad().clone()});
  }
  for (size_t f = 1; f < grads.size(); ++f) {
    for (size_t i = 0; i < grads[0].size(); ++i) {
      EXPECT_TRUE(torch::allclose(grads[f][i], grads[0][i], 1e-4, 1e-5))
          << "form " << f << " grad " << i << ": " << max_diff(grads[f][i], grads[0][i]);
    }
  }
}

TEST(FlexformerForms, PackedEqualsSeparateAndSequencesAreIsolated) {
  torch::manual_seed(4);
  const std::vector<int64_t> lengths{11, 25, 7};
  auto x = random_qkv(43, 2, 8);
  FlexformerAttention att(options(), 2, 8);
  auto packed = att.attend(x.q, x.k, x.v, cu_of(lengths), 0, LinearAttentionForm::kChunk, 8);
  int64_t start = 0;
  for (int64_t len : lengths) {
    auto one = att.attend(x.q.slice(0, start, start + len), x.k.slice(0, start, start + len),
                          x.v.slice(0, start, start + len), cu_of({len}), 0, LinearAttentionForm::kChunk, 8);
    EXPECT_LT(max_diff(one, packed.slice(0, start, start + len)), 1e-6);
    start += len;
  }
  // Perturbing the middle sequence leaves the others bit-identical.
  auto k2 = x.k.clone(), v2 = x.v.clone();
  k2.slice(0, 11, 36) += 3.0;
  v2.slice(0, 11, 36) -= 1.0;
  auto edited = att.attend(x.q, k2, v2, cu_of(lengths), 0, LinearAttentionForm::kChunk, 8);
  EXPECT_TRUE(torch::equal(edited.slice(0, 0, 11), packed.slice(0, 0, 11)));
  EXPECT_TRUE(torch::equal(edited.slice(0, 36), packed.slice(0, 36)));
  EXPECT_FALSE(torch::allclose(edited.slice(0, 11, 36), packed.slice(0, 11, 36)));
}

TEST(FlexformerForms, CausalityAFutureTokenNeverChangesAPastOutput) {
  torch::manual_seed(5);
  auto x = random_qkv(50, 2, 8);
  const auto cu = cu_of({50});
  for (FeatureMap f : kMaps) {
    FlexformerAttention att(options(f, Normalizer::kShift), 2, 8);
    for (auto form : {LinearAttentionForm::kQuadratic, LinearAttentionForm::kChunk, LinearAttentionForm::kRecurrent}) {
      auto before = att.attend(x.q, x.k, x.v, cu, 0, form, 16);
      for (int64_t t : {0, 15, 16, 33, 49}) {
        auto q = x.q.clone(), k = x.k.clone(), v = x.v.clone();
        q[t] += 1.0;
        k[t] -= 2.0;
        v[t] += 5.0;
        auto after = att.attend(q, k, v, cu, 0, form, 16);
        EXPECT_TRUE(torch::equal(after.slice(0, 0, t), before.slice(0, 0, t)))
            << name_of(f, Normalizer::kShift, InputNorm::kL2) << " t " << t;
        EXPECT_FALSE(torch::allclose(after[t], before[t]));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// States

TEST(FlexformerState, DecodingTokenByTokenMatchesChunkedOutputsAndState) {
  torch::manual_seed(6);
  const int64_t n = 37;
  auto x = random_qkv(n, 2, 8);
  FlexformerAttention att(options(FeatureMap::kNonstationary, Normalizer::kShift), 2, 8);
  LinearAttentionState chunk_state;
  auto full = att.attend(x.q, x.k, x.v, cu_of({n}), 0, LinearAttentionForm::kChunk, 16, nullptr, &chunk_state);
  ASSERT_EQ(chunk_state.s.sizes(), (std::vector<int64_t>{1, 2, att.feature_dim(), 8}));
  ASSERT_EQ(chunk_state.z.sizes(), (std::vector<int64_t>{1, 2, att.feature_dim()}));
  LinearAttentionState state;
  for (int64_t t = 0; t < n; ++t) {
    LinearAttentionState next;
    auto y = att.attend(x.q.slice(0, t, t + 1), x.k.slice(0, t, t + 1), x.v.slice(0, t, t + 1), cu_of({1}), 0,
                        LinearAttentionForm::kRecurrent, 1, t == 0 ? nullptr : &state, &next);
    EXPECT_LT(max_diff(y[0], full[t]), 1e-5) << "token " << t;
    state = next;
  }
  EXPECT_LT(max_diff(state.s, chunk_state.s), 1e-4);
  EXPECT_LT(max_diff(state.z, chunk_state.z), 1e-4);
  // z is the plain sum of key features: a direct check of what the state means.
  EXPECT_LT(max_diff(state.z[0], att.key_features(x.k, 0).sum(0)), 1e-4);
}

TEST(FlexformerState, SplitAndResumeEqualsOnePassForEveryForm) {
  torch::manual_seed(7);
  const std::vector<int64_t> lengths{20, 45};
  auto x = random_qkv(65, 2, 8);
  FlexformerAttention att(options(), 2, 8);
  auto whole = att.attend(x.q, x.k, x.v, cu_of(lengths), 0, LinearAttentionForm::kQuadratic, 1);
  for (auto form : {LinearAttentionForm::kQuadratic, LinearAttentionForm::kChunk, LinearAttentionForm::kRecurrent}) {
    for (int64_t split : {1, 7, 19}) {
      // Both sequences split after `split` tokens: first parts packed, then the rests packed.
      auto part = [&](int64_t a0, int64_t a1, int64_t b0, int64_t b1, const torch::Tensor& t) {
        return torch::cat({t.slice(0, a0, a1), t.slice(0, b0, b1)});
      };
      LinearAttentionState mid, end;
      auto first = att.attend(part(0, split, 20, 20 + split, x.q), part(0, split, 20, 20 + split, x.k),
                              part(0, split, 20, 20 + split, x.v), cu_of({split, split}), 0, form, 4, nullptr, &mid);
      auto second = att.attend(part(split, 20, 20 + split, 65, x.q), part(split, 20, 20 + split, 65, x.k),
                               part(split, 20, 20 + split, 65, x.v), cu_of({20 - split, 45 - split}), 0, form, 4,
                               &mid, &end);
      auto got = torch::cat({first.slice(0, 0, split), second.slice(0, 0, 20 - split), first.slice(0, split),
                             second.slice(0, 20 - split)});
      EXPECT_LT(max_diff(got, whole), 2e-5) << "form " << static_cast<int>(form) << " split " << split;
    }
  }
}

TEST(FlexformerState, StatesAreFp32ForReducedPrecisionInputs) {
  torch::manual_seed(8);
  auto x = random_qkv(30, 2, 8);
  FlexformerAttention att(options(), 2, 8);
  LinearAttentionState st;
  auto ref = att.attend(x.q, x.k, x.v, cu_of({30}), 0, LinearAttentionForm::kChunk, 8);
  auto half = att.attend(x.q.to(torch::kBFloat16), x.k.to(torch::kBFloat16), x.v.to(torch::kBFloat16), cu_of({30}),
                         0, LinearAttentionForm::kChunk, 8, nullptr, &st);
  EXPECT_EQ(half.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(st.s.scalar_type(), torch::kFloat);
  EXPECT_EQ(st.z.scalar_type(), torch::kFloat);
  EXPECT_LT(max_diff(half.to(torch::kFloat), ref), 0.1);  // bf16 rounding of inputs and output only
}

// ---------------------------------------------------------------------------------------------------------------
// Feature maps and normalisers

TEST(FlexformerFeatures, NonstationaryWithEqualPairsIsStationary) {
  torch::manual_seed(9);
  auto x = torch::randn({12, 3, 5}, torch::kDouble);
  auto omega = torch::randn({3, 7, 5}, torch::kDouble);
  EXPECT_LT(max_diff(nonstationary_fourier_features(x, omega, omega), fourier_features(x, omega)), 1e-12);
  // And the whole operator: nonstationary with omega2 := omega equals stationary with the same omega.
  FlexformerAttention ns(options(FeatureMap::kNonstationary), 3, 5), st(options(FeatureMap::kStationary), 3, 5);
  ns.to(torch::kDouble);
  st.to(torch::kDouble);
  {
    torch::NoGradGuard no_grad;
    ns.omega2.copy_(ns.omega);
    st.omega.copy_(ns.omega);
  }
  auto y = random_qkv(12, 3, 5, torch::kDouble);
  auto a = ns.forward(y.q, y.k, y.v, cu_of({5, 7}));
  auto b = st.forward(y.q, y.k, y.v, cu_of({5, 7}));
  EXPECT_LT(max_diff(a, b), 1e-12);
  // Different pairs: not stationary any more, K(x, x) varies with x (spec section 4).
  auto other = torch::randn({3, 7, 5}, torch::kDouble);
  auto f = nonstationary_fourier_features(x, omega, other);
  auto diag = (f * f).sum(-1);
  EXPECT_GT((diag.max() - diag.min()).item<double>(), 1e-3);
  EXPECT_LE(diag.max().item<double>(), 1.0 + 1e-12);  // still bounded by 1
}

TEST(FlexformerFeatures, TrigFeaturesHaveUnitNormAndEluIsPositive) {
  torch::manual_seed(10);
  auto x = torch::randn({20, 2, 4}) * 3;
  auto f = fourier_features(x, torch::randn({2, 9, 4}) * 5);
  EXPECT_EQ(f.sizes(), (std::vector<int64_t>{20, 2, 18}));
  EXPECT_LT(max_diff((f * f).sum(-1), torch::ones({20, 2})), 1e-5);
  EXPECT_GT(elu_features(x).min().item<double>(), 0.0);
}

TEST(FlexformerFeatures, ShiftKeepsEveryAttentionWeightNonNegative) {
  torch::manual_seed(11);
  FlexformerAttention att(options(FeatureMap::kStationary, Normalizer::kShift, InputNorm::kL2, 2), 2, 4);
  {
    torch::NoGradGuard no_grad;
    att.omega.mul_(6.0);  // a spiky kernel: many raw estimates are negative
  }
  auto x = random_qkv(40, 2, 4);
  auto p = att.query_features(x.q, 0), r = att.key_features(x.k, 0);
  auto weights = torch::matmul(p.transpose(0, 1), r.transpose(0, 1).transpose(1, 2));  // [H, T, T]
  auto raw = weights - (p.select(-1, 0) * r.select(-1, 0)).transpose(0, 1).unsqueeze(-1);
  EXPECT_LT(raw.min().item<double>(), -0.2) << "test needs negative raw kernel values";
  const double alpha = 1.0 + torch::softplus(att.alpha_raw).min().item<double>();
  EXPECT_GE(weights.min().item<double>(), alpha * alpha - 1.0 - 1e-6);
}

TEST(FlexformerFeatures, InitialKernelEstimatesSoftmaxOfTheConditionedInputs) {
  // With Omega ~ N(0, I) and many features, phi(q)^T S / phi(q)^T z is softmax attention: over cosine
  // similarity (l2), over RMS-normalised q, k scaled by 1/sqrt(d) (rms), or over q.k / sqrt(d) itself (scale).
  // Checked on the unnormalised core so that no normaliser choice enters.
  torch::manual_seed(12);
  const int64_t d = 4, n = 24;
  auto x = random_qkv(n, 1, d);
  x.q *= 0.5;
  x.k *= 0.5;
  auto softmax_of = [&](const torch::Tensor& scores) {
    auto masked = scores.masked_fill(torch::ones({n, n}, torch::kBool).triu(1), -INFINITY);
    return torch::matmul(torch::softmax(masked, -1), x.v.select(1, 0));
  };
  auto unit = [](const torch::Tensor& t) { return t / t.norm(2, -1, true); };
  auto rms = [&](const torch::Tensor& t) { return t * torch::rsqrt(t.pow(2).mean(-1, true)); };
  const auto q = x.q.select(1, 0), k = x.k.select(1, 0);
  const std::vector<std::pair<InputNorm, torch::Tensor>> cases{
      {InputNorm::kL2, softmax_of(torch::matmul(unit(q), unit(k).t()))},
      {InputNorm::kRms, softmax_of(torch::matmul(rms(q), rms(k).t()) / std::sqrt(double(d)))},
      {InputNorm::kScale, softmax_of(torch::matmul(q, k.t()) / std::sqrt(double(d)))}};
  for (const auto& [norm, expected] : cases) {
    std::vector<double> errors;
    for (int64_t m : {16, 4096}) {
      FlexformerAttention att(options(FeatureMap::kFixed, Normalizer::kClamp, norm, m), 1, d);
      auto out = causal_linear_attention(att.query_features(x.q, 0), att.key_features(x.k, 0), x.v, cu_of({n}),
                                         LinearAttentionForm::kChunk, 8);
      auto got = (out.numerator / out.denominator.unsqueeze(-1)).select(1, 0);
      errors.push_back((got - expected).pow(2).mean().sqrt().item<double>());
    }
    EXPECT_LT(errors[1], 0.05) << name_of(FeatureMap::kFixed, Normalizer::kClamp, norm) << " m=16 error " << errors[0];
    EXPECT_LT(errors[1], 0.4 * errors[0]) << name_of(FeatureMap::kFixed, Normalizer::kClamp, norm);
  }
}

TEST(FlexformerFeatures, ScaleModeKeyOffsetCancels) {
  torch::manual_seed(13);
  FlexformerAttention att(options(FeatureMap::kStationary, Normalizer::kShift, InputNorm::kScale), 2, 8);
  ASSERT_TRUE(att.key_norm_offset.defined());
  auto x = random_qkv(25, 2, 8);
  auto before = att.forward(x.q, x.k, x.v, cu_of({25}));
  {
    torch::NoGradGuard no_grad;
    att.key_norm_offset.fill_(1.5);
  }
  EXPECT_LT(max_diff(att.forward(x.q, x.k, x.v, cu_of({25})), before), 1e-4);
}

TEST(FlexformerKernel, EstimateErrorFallsAsOneOverSqrtM) {
  // Bochner: with omega ~ N(0, I), (1/m) sum_i cos(omega_i^T (x - y)) estimates exp(-|x - y|^2 / 2) with
  // variance (1 - k^2)^2 / (2m) (spec section 6), so the RMS error has slope -1/2 in log m.
  torch::manual_seed(14);
  const int64_t d = 4, pairs = 512, repeats = 8;
  std::vector<double> log_m, log_err;
  for (int64_t m = 16; m <= 1024; m *= 2) {
    double mse = 0;
    for (int r = 0; r < repeats; ++r) {
      auto x = torch::randn({pairs, 1, d}, torch::kDouble) * 0.5;
      auto y = torch::randn({pairs, 1, d}, torch::kDouble) * 0.5;
      auto omega = torch::randn({1, m, d}, torch::kDouble);
      auto estimate = (fourier_features(x, omega) * fourier_features(y, omega)).sum(-1).squeeze(1);
      auto exact = torch::exp(-0.5 * (x - y).pow(2).sum(-1)).squeeze(1);
      mse += (estimate - exact).pow(2).mean().item<double>() / repeats;
    }
    log_m.push_back(std::log(double(m)));
    log_err.push_back(0.5 * std::log(mse));
  }
  const double n = double(log_m.size());
  double mx = 0, my = 0;
  for (size_t i = 0; i < log_m.size(); ++i) mx += log_m[i] / n, my += log_err[i] / n;
  double sxy = 0, sxx = 0;
  for (size_t i = 0; i < log_m.size(); ++i) sxy += (log_m[i] - mx) * (log_err[i] - my), sxx += std::pow(log_m[i] - mx, 2);
  const double slope = sxy / sxx;
  EXPECT_GT(slope, -0.6);
  EXPECT_LT(slope, -0.4);
}

TEST(FlexformerKernel, NonstationaryFitsWhatStationaryCannot) {
  // Target (spec section 10.8): K(x, y) = (cos(a.x) cos(a.y) + exp(-|x - y|^2 / 2)) / 2. Its first term is not
  // a function of x - y, so no stationary kernel fits it; pairs omega1 = a, omega2 = -a give it exactly.
  torch::manual_seed(15);
  const int64_t d = 2, n = 48, m = 16;
  auto x = torch::randn({n, 1, d}, torch::kDouble);
  auto a = torch::tensor({2.0, 0.5}, torch::kDouble);
  auto ax = torch::matmul(x.squeeze(1), a);
  auto sq = (x.squeeze(1).unsqueeze(1) - x.squeeze(1).unsqueeze(0)).pow(2).sum(-1);
  auto target = 0.5 * (ax.cos().unsqueeze(1) * ax.cos().unsqueeze(0) + torch::exp(-0.5 * sq));

  auto init = torch::randn({1, m, d}, torch::kDouble);
  auto fit = [&](bool nonstationary) {
    auto w1 = (init + (nonstationary ? 0.01 : 0.0) * torch::randn_like(init)).requires_grad_(true);
    auto w2 = init.clone().requires_grad_(true);
    std::vector<torch::Tensor> params{w1};
    if (nonstationary) params.push_back(w2);
    torch::optim::Adam opt(params, torch::optim::AdamOptions(0.05));
    double loss_value = 0;
    for (int step = 0; step < 800; ++step) {
      opt.zero_grad();
      auto phi = nonstationary ? nonstationary_fourier_features(x, w1, w2) : fourier_features(x, w1);
      auto k = torch::matmul(phi.squeeze(1), phi.squeeze(1).t());
      auto loss = (k - target).pow(2).mean();
      loss.backward();
      opt.step();
      loss_value = loss.item<double>();
    }
    return loss_value;
  };
  const double stationary = fit(false), nonstationary = fit(true);
  EXPECT_GT(stationary, 4.0 * nonstationary) << "stationary " << stationary << ", nonstationary " << nonstationary;
}

// ---------------------------------------------------------------------------------------------------------------
// Gradients: fp64 finite differences of the whole operator, frequencies included

namespace {

// Checks d(sum(forward * w))/d(tensor) by central differences for every element of every tensor.
void expect_gradients_match_finite_differences(const std::function<torch::Tensor()>& loss_fn,
                                               const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
                                               const std::string& what) {
  for (const auto& [name, t] : tensors) {
    if (t.grad().defined()) t.mutable_grad().zero_();
  }
  loss_fn().backward();
  const double h = 1e-6;
  for (const auto& [name, t] : tensors) {
    ASSERT_TRUE(t.grad().defined()) << what << ": no gradient for " << name;
    auto analytic = t.grad().reshape(-1);
    auto flat = t.detach().view(-1);  // shares storage: perturbs the tensor itself
    double worst = 0;
    for (int64_t i = 0; i < flat.numel(); ++i) {
      double plus, minus;
      {
        torch::NoGradGuard no_grad;
        const double orig = flat[i].item<double>();
        flat[i] = orig + h;
        plus = loss_fn().item<double>();
        flat[i] = orig - h;
        minus = loss_fn().item<double>();
        flat[i] = orig;
      }
      const double numeric = (plus - minus) / (2 * h), g = analytic[i].item<double>();
      worst = std::max(worst, std::abs(numeric - g) / (1.0 + std::abs(g)));
    }
    EXPECT_LT(worst, 1e-6) << what << ": d/d" << name;
  }
}

}  // namespace

TEST(FlexformerGradients, MatchFiniteDifferencesInFp64) {
  torch::manual_seed(16);
  const int64_t heads = 2, d = 4, m = 3;
  const auto cu = cu_of({4, 5});
  struct Case {
    FeatureMap f;
    Normalizer n;
    InputNorm in;
  };
  std::vector<Case> cases;
  for (FeatureMap f : kMaps)
    for (Normalizer n : kNormalizers) cases.push_back({f, n, InputNorm::kL2});
  for (InputNorm in : {InputNorm::kRms, InputNorm::kScale}) cases.push_back({FeatureMap::kNonstationary, Normalizer::kShift, in});
  for (const Case& c : cases) {
    FlexformerAttention att(options(c.f, c.n, c.in, m), heads, d);
    att.to(torch::kDouble);
    auto x = random_qkv(9, heads, d, torch::kDouble);
    if (c.n == Normalizer::kClamp) {
      // Clamping is not differentiable at the kink: use keys close to the queries so denominators stay large.
      x.k = x.q + 0.1 * x.k;
    }
    auto q = x.q.requires_grad_(true), k = x.k.requires_grad_(true), v = x.v.requires_grad_(true);
    auto w = torch::randn({9, heads, d}, torch::kDouble);
    for (auto form : {LinearAttentionForm::kChunk, LinearAttentionForm::kQuadratic}) {
      if (c.n == Normalizer::kClamp) {
        torch::NoGradGuard no_grad;
        auto den = causal_linear_attention(att.query_features(q, 0), att.key_features(k, 0), v, cu, form, 2).denominator;
        ASSERT_GT(den.min().item<double>(), 2 * kClampEps) << "denominators near the clamp";
      }
      std::vector<std::pair<std::string, torch::Tensor>> tensors{{"q", q}, {"k", k}, {"v", v}};
      for (const auto& p : att.named_parameters()) tensors.emplace_back(p.key(), p.value());
      auto loss = [&] { return (att.attend(q, k, v, cu, 0, form, 2) * w).sum(); };
      expect_gradients_match_finite_differences(loss, tensors, name_of(c.f, c.n, c.in));
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Heads: what Ulysses SP relies on

TEST(FlexformerHeads, HeadSlicesUseTheirOwnParametersAndGradientsAddUp) {
  torch::manual_seed(17);
  const int64_t heads = 4;
  FlexformerAttention att(options(FeatureMap::kNonstationary, Normalizer::kNone), heads, 8);
  {
    torch::NoGradGuard no_grad;
    att.out_norm_weight.uniform_(0.5, 1.5);  // distinct per head so a wrong slice shows
  }
  auto x = random_qkv(30, heads, 8);
  auto w = torch::randn({30, heads, 8});
  const auto cu = cu_of({12, 18});
  att.zero_grad();
  auto full = att.forward(x.q, x.k, x.v, cu);
  (full * w).sum().backward();
  std::vector<torch::Tensor> expected{att.omega.grad().clone(), att.omega2.grad().clone(),
                                      att.out_norm_weight.grad().clone()};
  att.zero_grad();
  for (int64_t part : {0, 1}) {  // two "ranks" of an SP group of 2, each with heads [2 part, 2 part + 2)
    auto sl = [&](const torch::Tensor& t) { return t.slice(1, 2 * part, 2 * part + 2); };
    auto y = att.forward_heads(sl(x.q), sl(x.k), sl(x.v), cu, 2 * part);
    EXPECT_LT(max_diff(y, sl(full)), 1e-6) << "part " << part;
    (y * sl(w)).sum().backward();
  }
  EXPECT_LT(max_diff(att.omega.grad(), expected[0]), 1e-5);
  EXPECT_LT(max_diff(att.omega2.grad(), expected[1]), 1e-5);
  EXPECT_LT(max_diff(att.out_norm_weight.grad(), expected[2]), 1e-5);
}

// ---------------------------------------------------------------------------------------------------------------
// Errors and options

TEST(FlexformerErrors, BadInputsNameTheProblem) {
  FlexformerAttention att(options(), 4, 8);
  auto x = random_qkv(10, 2, 8);
  EXPECT_NE(error_of([&] { att.forward_heads(x.q, x.k, x.v, cu_of({10}), 3); }).find("head_offset 3"), std::string::npos);
  EXPECT_NE(error_of([&] { att.forward_heads(x.q, x.k, x.v, cu_of({4, 5}), 0); }).find("from 0 to T = 10"), std::string::npos);
  EXPECT_NE(error_of([&] { att.forward(x.q, x.k, x.v, cu_of({10})); }).find("forward_heads"), std::string::npos);
  auto bad = torch::randn({10, 4, 6});
  EXPECT_NE(error_of([&] { att.forward(bad, bad, bad, cu_of({10})); }).find("[10, 4, 6]"), std::string::npos);
  EXPECT_NE(error_of([&] { att.attend(x.q, x.k, x.v, cu_of({10}), 0, LinearAttentionForm::kChunk, 0); })
                .find("chunk_size"),
            std::string::npos);
  LinearAttentionState wrong{torch::zeros({2, 2, att.feature_dim(), 8}), torch::zeros({2, 2, att.feature_dim()})};
  EXPECT_NE(error_of([&] { att.attend(x.q, x.k, x.v, cu_of({10}), 0, LinearAttentionForm::kChunk, 4, &wrong); })
                .find("initial state"),
            std::string::npos);
  EXPECT_THROW(FlexformerAttention(options(), 0, 8), std::invalid_argument);
}

TEST(FlexformerErrors, OptionsFromConfig) {
  AttentionConfig a = flex_config("nonstationary", "none");
  a.input_norm = "rms";
  a.mode = "recurrent";
  FlexformerOptions o = FlexformerOptions::from_config(a);
  EXPECT_EQ(o.feature_map, FeatureMap::kNonstationary);
  EXPECT_EQ(o.normalizer, Normalizer::kNone);
  EXPECT_EQ(o.input_norm, InputNorm::kRms);
  EXPECT_EQ(o.mode, LinearAttentionForm::kRecurrent);
  EXPECT_EQ(o.num_features, 8);
  a.feature_map = "gaussian";
  EXPECT_NE(error_of([&] { FlexformerOptions::from_config(a); }).find("attention.feature_map"), std::string::npos);
  EXPECT_THROW(FlexformerOptions::from_config(a), ConfigError);
}

TEST(FlexformerErrors, ParametersPerOption) {
  auto names = [](const FlexformerAttention& att) {
    std::vector<std::string> out;
    for (const auto& p : att.named_parameters()) out.push_back(p.key());
    return out;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(names(FlexformerAttention(options(FeatureMap::kStationary), 2, 4)), (V{"omega", "alpha_raw"}));
  EXPECT_EQ(names(FlexformerAttention(options(FeatureMap::kNonstationary), 2, 4)), (V{"omega", "omega2", "alpha_raw"}));
  EXPECT_EQ(names(FlexformerAttention(options(FeatureMap::kFixed, Normalizer::kClamp), 2, 4)), V{});
  EXPECT_EQ(names(FlexformerAttention(options(FeatureMap::kElu, Normalizer::kNone), 2, 4)), V{"out_norm_weight"});
  FlexformerAttention fixed(options(FeatureMap::kFixed), 2, 4);
  EXPECT_EQ(fixed.named_buffers().size(), 1u);  // frequencies are a buffer: saved, not trained
  EXPECT_EQ(fixed.omega.sizes(), (std::vector<int64_t>{2, 8, 4}));
  EXPECT_NEAR(torch::softplus(fixed.alpha_raw).add(1.0)[0].item<double>(), 1.05, 1e-6);
}

// ---------------------------------------------------------------------------------------------------------------
// Inside a Transformer

TEST(FlexformerModel, EveryBlockOwnsItsFrequencies) {
  torch::manual_seed(18);
  Transformer model(tiny_model(), flex_config("nonstationary"));
  auto params = model->named_parameters();
  for (int layer = 0; layer < 3; ++layer) {
    for (const char* p : {"omega", "omega2", "alpha_raw"}) {
      const std::string name = "blocks." + std::to_string(layer) + ".attention." + p;
      ASSERT_NE(params.find(name), nullptr) << name;
    }
  }
  EXPECT_FALSE(torch::equal(params["blocks.0.attention.omega"], params["blocks.1.attention.omega"]));
  EXPECT_EQ(params["blocks.2.attention.omega"].sizes(), (std::vector<int64_t>{4, 8, 8}));
}

TEST(FlexformerModel, TrainsAndRecomputeGivesTheSameGradients) {
  torch::manual_seed(19);
  for (const char* map : {"stationary", "nonstationary", "elu"}) {
    Transformer model(tiny_model(), flex_config(map));
    PackedBatch batch = random_batch({5, 17, 9});
    std::vector<std::vector<torch::Tensor>> grads;
    std::vector<double> losses;
    for (int64_t layers : {0, 1, 3}) {
      model->zero_grad();
      auto loss = model->loss_sum(batch, layers);
      loss.backward();
      losses.push_back(loss.item<double>());
      std::vector<torch::Tensor> g;
      for (const auto& p : model->parameters()) g.push_back(p.grad().clone());
      grads.push_back(g);
    }
    for (size_t i = 1; i < grads.size(); ++i) {
      EXPECT_NEAR(losses[i], losses[0], 1e-6 * losses[0]) << map;
      for (size_t j = 0; j < grads[0].size(); ++j) {
        EXPECT_TRUE(torch::allclose(grads[i][j], grads[0][j], 1e-5, 1e-8)) << map << " param " << j;
      }
    }
    EXPECT_GT(model->named_parameters()["blocks.0.attention.alpha_raw"].grad().abs().sum().item<double>(), 0.0);

    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
    double first = 0, last = 0;
    for (int step = 0; step < 30; ++step) {
      opt.zero_grad();
      auto loss = model->loss_sum(batch, step % 2);
      loss.backward();
      opt.step();
      (step == 0 ? first : last) = loss.item<double>();
    }
    EXPECT_LT(last, 0.5 * first) << map;
  }
}

TEST(FlexformerModel, DecodingWithCarriedStatesMatchesTheFullForward) {
  torch::manual_seed(20);
  Transformer model(tiny_model(), flex_config());
  model->eval();
  torch::NoGradGuard no_grad;
  PackedBatch whole = random_batch({23});
  auto expected = model->forward(whole);
  auto decoding = std::make_shared<FlexformerDecoding>(3);
  auto step = [&](int64_t a, int64_t b) {
    PackedBatch part;
    part.tokens = whole.tokens.slice(0, a, b);
    part.targets = whole.targets.slice(0, a, b);
    part.positions = whole.positions.slice(0, a, b);
    part.cu_seqlens = cu_of({b - a});
    part.attention = decoding;
    return model->forward(part);
  };
  EXPECT_LT(max_diff(step(0, 7), expected.slice(0, 0, 7)), 1e-4);  // prefill (chunked form)
  for (int64_t t = 7; t < 23; ++t) EXPECT_LT(max_diff(step(t, t + 1)[0], expected[t]), 1e-4) << "token " << t;
  EXPECT_EQ(decoding->state(2).s.size(0), 1);
  decoding->reset();
  EXPECT_FALSE(decoding->state(0).s.defined());
  // Softmax blocks cannot be decoded recurrently.
  Transformer softmax(tiny_model());
  PackedBatch one = random_batch({3});
  one.attention = decoding;
  EXPECT_NE(error_of([&] { softmax->forward(one); }).find("not flexformer"), std::string::npos);
}

TEST(FlexformerModel, CheckpointRoundTripKeepsFrequencies) {
  torch::manual_seed(21);
  Transformer model(tiny_model(), flex_config("fixed"));
  const auto path = (std::filesystem::temp_directory_path() / "dcp_test_flexformer_model.pt").string();
  torch::save(model, path);
  torch::manual_seed(99);
  Transformer loaded(tiny_model(), flex_config("fixed"));
  ASSERT_FALSE(torch::equal(loaded->named_buffers()["blocks.0.attention.omega"],
                            model->named_buffers()["blocks.0.attention.omega"]));
  torch::load(loaded, path);
  std::filesystem::remove(path);
  PackedBatch batch = random_batch({6, 10});
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(loaded->forward(batch), model->forward(batch)));
}

TEST(FlexformerModel, GenerateDecodesRecurrentlyWithTheSameTokensAsRecomputingTheWindow) {
  torch::manual_seed(22);
  Transformer model(tiny_model(), flex_config());
  const std::string prompt = "abcdefghij";
  // Greedy reference: the whole window recomputed every token, no carried state.
  auto reference = [&](int64_t context, int64_t count) {
    torch::NoGradGuard no_grad;
    std::vector<int64_t> tokens{kBosToken};
    for (unsigned char c : prompt) tokens.push_back(c);
    std::string out;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t start = std::max<int64_t>(0, static_cast<int64_t>(tokens.size()) - context);
      const int64_t n = static_cast<int64_t>(tokens.size()) - start;
      PackedBatch b;
      b.tokens = torch::tensor(std::vector<int64_t>(tokens.begin() + start, tokens.end()), torch::kInt64);
      b.targets = torch::zeros({n}, torch::kInt64);
      b.positions = torch::arange(n, torch::kInt64);
      b.cu_seqlens = cu_of({n});
      const int64_t next = model->forward(b)[n - 1].slice(0, 0, 256).argmax().item<int64_t>();
      tokens.push_back(next);
      out.push_back(static_cast<char>(next));
    }
    return out;
  };
  for (int64_t context : {64, 8}) {  // the window never slides / slides from the start
    GenerateOptions opt;
    opt.max_new_tokens = 16;
    opt.temperature = 0;
    opt.context = context;
    EXPECT_EQ(generate(model, prompt, opt), reference(context, 16)) << "context " << context;
  }
}
