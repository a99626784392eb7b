// The fused chunked Flexformer kernel (src/kernels/linear_attention/fused.cpp) against its reference twins: the
// naive quadratic form in fp64 (outputs and every gradient), central finite differences on a tiny case, today's
// chunked autograd form in fp32 and bf16 on every kernel path this CPU has (forced on purpose), packed
// variable-length input, 1-token documents, chunk sizes that do not divide the lengths, the state pass that splits
// one long sequence over threads, states (split and resume, decoding), the model's fused/reference switch and the
// errors. Tolerances and the errors measured: docs/flexformer.md, "The fused kernel".
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "dcp/cpu_features.h"
#include "dcp/flexformer.h"
#include "dcp/linear_attention.h"
#include "dcp/model.h"
#include "unit/error_of.h"

using namespace dcp;
using dcp::test::error_of;

namespace {

const std::vector<FeatureMap> kMaps{FeatureMap::kStationary, FeatureMap::kNonstationary, FeatureMap::kFixed,
                                    FeatureMap::kElu};
const std::vector<Normalizer> kNormalizers{Normalizer::kShift, Normalizer::kClamp, Normalizer::kNone};

std::string name_of(FeatureMap f, Normalizer n, InputNorm in) {
  const char* fm[] = {"stationary", "nonstationary", "fixed", "elu"};
  const char* nm[] = {"shift", "clamp", "none"};
  const char* im[] = {"l2", "rms", "scale"};
  return std::string(fm[static_cast<int>(f)]) + "/" + nm[static_cast<int>(n)] + "/" + im[static_cast<int>(in)];
}

FlexformerOptions options(FeatureMap f, Normalizer n, InputNorm in = InputNorm::kL2, int64_t m = 8) {
  FlexformerOptions o;
  o.feature_map = f;
  o.normalizer = n;
  o.input_norm = in;
  o.num_features = m;
  return o;
}

torch::Tensor cu_of(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> cu{0};
  for (int64_t l : lengths) cu.push_back(cu.back() + l);
  return torch::tensor(cu, torch::kInt64);
}

int64_t total_of(const std::vector<int64_t>& lengths) {
  int64_t t = 0;
  for (int64_t l : lengths) t += l;
  return t;
}

struct QKV {
  torch::Tensor q, k, v;
};

QKV random_qkv(int64_t tokens, int64_t heads, int64_t dim, torch::ScalarType dtype = torch::kFloat) {
  // Drawn in fp32 and rounded, so that every dtype sees the same values.
  return {torch::randn({tokens, heads, dim}).to(dtype), torch::randn({tokens, heads, dim}).to(dtype),
          torch::randn({tokens, heads, dim}).to(dtype)};
}

// max |x - ref| / max(1, max |ref|): the tiled softmax's error metric (docs/attention.md).
double rel_err(const torch::Tensor& x, const torch::Tensor& ref) {
  const auto a = x.to(torch::kDouble), b = ref.to(torch::kDouble);
  return (a - b).abs().max().item<double>() / std::max(1.0, b.abs().max().item<double>());
}

// A module with non-trivial parameters: alpha != 1.05 per head, Omega2 away from Omega, gains and key offsets
// distinct per head.
FlexformerAttention module(FeatureMap f, Normalizer n, InputNorm in, int64_t heads, int64_t d, int64_t m = 8,
                           torch::ScalarType dtype = torch::kFloat) {
  FlexformerAttention att(options(f, n, in, m), heads, d);
  torch::NoGradGuard no_grad;
  if (att.alpha_raw.defined()) att.alpha_raw.uniform_(-1.0, 0.5);
  if (att.omega2.defined()) att.omega2.add_(0.3 * torch::randn_like(att.omega2));
  if (att.out_norm_weight.defined()) att.out_norm_weight.uniform_(0.5, 1.5);
  if (att.key_norm_offset.defined()) att.key_norm_offset.uniform_(0.2, 0.6);
  att.to(dtype);
  return att;
}

// Outputs and gradients of one call: q, k, v, then every parameter that requires grad, in named order.
struct CallResult {
  torch::Tensor out;
  std::vector<std::pair<std::string, torch::Tensor>> grads;
};

CallResult run_case(FlexformerAttention& att, const QKV& x, const torch::Tensor& g,
        const std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&)>& f) {
  auto q = x.q.clone().requires_grad_(true), k = x.k.clone().requires_grad_(true), v = x.v.clone().requires_grad_(true);
  att.zero_grad();
  CallResult r;
  r.out = f(q, k, v);
  (r.out.to(g.scalar_type()) * g).sum().backward();
  r.grads = {{"dq", q.grad()}, {"dk", k.grad()}, {"dv", v.grad()}};
  for (const auto& p : att.named_parameters()) r.grads.emplace_back("d" + p.key(), p.value().grad().clone());
  return r;
}

auto fused(FlexformerAttention& att, const torch::Tensor& cu, int64_t chunk,
           LinearAttentionPath path = LinearAttentionPath::kAuto) {
  return [&att, cu, chunk, path](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
    return att.attend_fused(q, k, v, cu, 0, chunk, nullptr, nullptr, path);
  };
}

auto reference(FlexformerAttention& att, const torch::Tensor& cu, LinearAttentionForm form, int64_t chunk) {
  return [&att, cu, form, chunk](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
    auto out = att.attend(q, k, v, cu, 0, form, chunk);
    return out;
  };
}

struct Errors {
  double out = 0, grad = 0;  // the output's; the worst gradient's
  double alpha = 0;          // dalpha_raw's (also in grad)
  double grad_but_alpha = 0;
};

Errors compare(const CallResult& a, const CallResult& ref, const std::string& what) {
  Errors e;
  e.out = rel_err(a.out, ref.out);
  EXPECT_EQ(a.grads.size(), ref.grads.size()) << what;
  for (size_t i = 0; i < std::min(a.grads.size(), ref.grads.size()); ++i) {
    EXPECT_EQ(a.grads[i].first, ref.grads[i].first);
    if (!ref.grads[i].second.defined()) {
      ADD_FAILURE() << what << ": no reference gradient for " << ref.grads[i].first;
      continue;
    }
    const double err = rel_err(a.grads[i].second, ref.grads[i].second);
    if (std::getenv("DCP_TEST_VERBOSE")) std::printf("  %s %s %.2e\n", what.c_str(), a.grads[i].first.c_str(), err);
    e.grad = std::max(e.grad, err);
    if (a.grads[i].first == "dalpha_raw") {
      e.alpha = err;
    } else {
      e.grad_but_alpha = std::max(e.grad_but_alpha, err);
    }
  }
  return e;
}

const std::vector<int64_t> kLengths{5, 17, 1, 0, 70, 9};  // 1-token and empty documents, none a chunk multiple

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// fp64: the naive quadratic form and finite differences

TEST(FusedLinearAttention, MatchesTheNaiveFormInFp64ForEveryMapNormaliserAndInputNorm) {
  torch::manual_seed(1);
  const auto cu = cu_of(kLengths);
  const int64_t total = total_of(kLengths);
  double worst_out = 0, worst_grad = 0;
  for (InputNorm in : {InputNorm::kL2, InputNorm::kRms, InputNorm::kScale}) {
    for (FeatureMap f : kMaps) {
      for (Normalizer n : kNormalizers) {
        if (in != InputNorm::kL2 && n == Normalizer::kClamp) continue;  // clamp's kink is covered with l2
        FlexformerAttention att = module(f, n, in, 2, 8, 8, torch::kDouble);
        auto x = random_qkv(total, 2, 8, torch::kDouble);
        if (in == InputNorm::kScale) {  // keep exp(|b|^2/2) moderate
          x.q = x.q * 0.5;
          x.k = x.k * 0.5;
        }
        const auto g = torch::randn({total, 2, 8}, torch::kDouble);
        const CallResult ref = run_case(att, x, g, reference(att, cu, LinearAttentionForm::kQuadratic, 1));
        for (int64_t c : {1, 3, 16, 64}) {
          const CallResult got = run_case(att, x, g, fused(att, cu, c));
          const Errors e = compare(got, ref, name_of(f, n, in));
          EXPECT_LT(e.out, 1e-12) << name_of(f, n, in) << " chunk " << c;
          EXPECT_LT(e.grad, 1e-11) << name_of(f, n, in) << " chunk " << c;
          worst_out = std::max(worst_out, e.out);
          worst_grad = std::max(worst_grad, e.grad);
        }
      }
    }
  }
  std::printf("fp64 fused vs naive: worst output error %.2e, worst gradient error %.2e\n", worst_out, worst_grad);
}

TEST(FusedLinearAttention, BackwardMatchesCentralFiniteDifferences) {
  torch::manual_seed(2);
  const std::vector<int64_t> lengths{3, 1, 4};
  const auto cu = cu_of(lengths);
  const double h = 1e-6;
  double worst = 0;
  for (FeatureMap f : kMaps) {
    for (Normalizer n : kNormalizers) {
      for (InputNorm in : {InputNorm::kL2, InputNorm::kScale}) {
        if (in == InputNorm::kScale && n != Normalizer::kShift) continue;
        FlexformerAttention att = module(f, n, in, 2, 3, 2, torch::kDouble);
        auto x = random_qkv(8, 2, 3, torch::kDouble);
        const auto g = torch::randn({8, 2, 3}, torch::kDouble);
        const CallResult got = run_case(att, x, g, fused(att, cu, 2));
        auto loss = [&] {
          torch::NoGradGuard no_grad;
          return (att.attend_fused(x.q, x.k, x.v, cu, 0, 2) * g).sum().item<double>();
        };
        std::vector<torch::Tensor> wrt{x.q, x.k, x.v};
        for (const auto& p : att.named_parameters()) wrt.push_back(p.value());
        ASSERT_EQ(wrt.size(), got.grads.size());
        for (size_t w = 0; w < wrt.size(); ++w) {
          torch::Tensor t = wrt[w];
          auto flat = t.view(-1);
          double scale = 1;
          std::vector<double> fd(static_cast<size_t>(flat.numel()));
          for (int64_t e = 0; e < flat.numel(); ++e) {
            torch::NoGradGuard no_grad;
            const double keep = flat[e].item<double>();
            flat[e] = keep + h;
            const double up = loss();
            flat[e] = keep - h;
            const double down = loss();
            flat[e] = keep;
            fd[static_cast<size_t>(e)] = (up - down) / (2 * h);
            scale = std::max(scale, std::abs(fd[static_cast<size_t>(e)]));
          }
          const auto analytic = got.grads[w].second.reshape(-1);
          for (int64_t e = 0; e < flat.numel(); ++e) {
            const double err = std::abs(analytic[e].item<double>() - fd[static_cast<size_t>(e)]) / scale;
            worst = std::max(worst, err);
            EXPECT_LT(err, 1e-7) << name_of(f, n, in) << " " << got.grads[w].first << "[" << e << "]";
          }
        }
      }
    }
  }
  std::printf("fused backward vs central differences (h = 1e-6): worst relative error %.2e\n", worst);
}

// ---------------------------------------------------------------------------------------------------------------
// fp32 and bf16 against today's chunked form, every path this CPU has

TEST(FusedLinearAttention, MatchesTheChunkedFormInFp32OnEveryPath) {
  torch::manual_seed(3);
  const auto cu = cu_of(kLengths);
  const int64_t total = total_of(kLengths);
  std::vector<LinearAttentionPath> paths{LinearAttentionPath::kPortable};
  if (avx512_usable()) {
    paths.push_back(LinearAttentionPath::kAvx512);
  } else {
    std::printf("no AVX-512 here: the fp32 AVX-512 path is not tested\n");
  }
  for (LinearAttentionPath path : paths) {
    double worst_out = 0, worst_grad = 0;
    for (FeatureMap f : kMaps) {
      for (Normalizer n : kNormalizers) {
        FlexformerAttention att = module(f, n, InputNorm::kL2, 2, 32, 16);
        auto x = random_qkv(total, 2, 32);
        const auto g = torch::randn({total, 2, 32});
        const CallResult ref = run_case(att, x, g, reference(att, cu, LinearAttentionForm::kChunk, 16));
        for (int64_t c : {3, 16, 64}) {
          const CallResult got = run_case(att, x, g, fused(att, cu, c, path));
          const Errors e = compare(got, ref, name_of(f, n, InputNorm::kL2));
          EXPECT_LT(e.out, 2e-5) << to_string(path) << " " << name_of(f, n, InputNorm::kL2) << " chunk " << c;
          EXPECT_LT(e.grad, 1e-4) << to_string(path) << " " << name_of(f, n, InputNorm::kL2) << " chunk " << c;
          worst_out = std::max(worst_out, e.out);
          worst_grad = std::max(worst_grad, e.grad);
        }
      }
    }
    std::printf("fp32 %s vs the chunked form: worst output error %.2e, worst gradient error %.2e\n", to_string(path),
                worst_out, worst_grad);
  }
}

// Head dims that are not multiples of 16 take the masked edges of the row loads, stores and 16 x 16 transposes.
TEST(FusedLinearAttention, HeadDimsOffTheVectorWidthMatchTheChunkedForm) {
  torch::manual_seed(5);
  const auto cu = cu_of(kLengths);
  const int64_t total = total_of(kLengths);
  std::vector<LinearAttentionPath> paths{LinearAttentionPath::kPortable};
  if (avx512_usable()) paths.push_back(LinearAttentionPath::kAvx512);
  for (LinearAttentionPath path : paths) {
    for (int64_t d : {24, 40}) {
      for (FeatureMap f : {FeatureMap::kStationary, FeatureMap::kElu}) {
        FlexformerAttention att = module(f, Normalizer::kShift, InputNorm::kL2, 2, d, 12);
        auto x = random_qkv(total, 2, d);
        const auto g = torch::randn({total, 2, d});
        const CallResult ref = run_case(att, x, g, reference(att, cu, LinearAttentionForm::kChunk, 16));
        for (int64_t c : {7, 40}) {
          const CallResult got = run_case(att, x, g, fused(att, cu, c, path));
          const Errors e = compare(got, ref, name_of(f, Normalizer::kShift, InputNorm::kL2));
          // The fp32 table of MatchesTheChunkedFormInFp32OnEveryPath.
          EXPECT_LT(e.out, 2e-5) << to_string(path) << " head_dim " << d << " chunk " << c;
          EXPECT_LT(e.grad, 1e-4) << to_string(path) << " head_dim " << d << " chunk " << c;
        }
      }
    }
  }
}

TEST(FusedLinearAttention, MatchesTheChunkedFormInBf16OnEveryPath) {
  torch::manual_seed(4);
  const std::vector<int64_t> lengths{200, 1, 33, 300};
  const auto cu = cu_of(lengths);
  const int64_t total = total_of(lengths);
  std::vector<LinearAttentionPath> paths{LinearAttentionPath::kPortable};
  if (avx512_usable()) paths.push_back(LinearAttentionPath::kAvx512);
  if (avx512_usable() && cpu_features().avx512_bf16) {
    paths.push_back(LinearAttentionPath::kAvx512Bf16);
  } else {
    std::printf("no AVX512-BF16 here: the vdpbf16ps path is not tested\n");
  }
  if (amx_usable()) {
    paths.push_back(LinearAttentionPath::kAmx);
  } else {
    std::printf("no AMX here (CPU features: %s): the AMX path is not tested on this machine\n",
                cpu_features().summary().c_str());
  }
  for (LinearAttentionPath path : paths) {
    double worst_out = 0, worst_grad = 0, worst_alpha = 0;
    for (FeatureMap f : kMaps) {
      for (Normalizer n : {Normalizer::kShift, Normalizer::kNone}) {
        FlexformerAttention att = module(f, n, InputNorm::kL2, 2, 64, 32);
        auto x = random_qkv(total, 2, 64, torch::kBFloat16);
        const auto g = torch::randn({total, 2, 64});
        // The reference computes in fp32 inside from the same bf16 inputs and rounds its output to bf16.
        const CallResult ref = run_case(att, x, g, reference(att, cu, LinearAttentionForm::kChunk, 64));
        const CallResult got = run_case(att, x, g, fused(att, cu, 64, path));
        const Errors e = compare(got, ref, name_of(f, n, InputNorm::kL2));
        const bool bf16_products = path == LinearAttentionPath::kAvx512Bf16 || path == LinearAttentionPath::kAmx;
        const std::string what = std::string(to_string(path)) + " " + name_of(f, n, InputNorm::kL2);
        EXPECT_LT(e.out, 1.5e-2) << what;
        EXPECT_LT(e.grad_but_alpha, bf16_products ? 2e-2 : 1.5e-2) << what;
        // dalpha sums a per-token difference of nearly equal terms over 534 tokens of random-sign upstream
        // gradient: bf16 products' 2^-9 score rounding times sqrt(534) = 23 is 4.5%.
        EXPECT_LT(e.alpha, bf16_products ? 1e-1 : 1e-3) << what;
        worst_out = std::max(worst_out, e.out);
        worst_grad = std::max(worst_grad, e.grad_but_alpha);
        worst_alpha = std::max(worst_alpha, e.alpha);
      }
    }
    std::printf("bf16 %s vs the chunked form: worst output error %.2e, worst gradient error %.2e (dalpha %.2e)\n",
                to_string(path), worst_out, worst_grad, worst_alpha);
  }
}

TEST(FusedLinearAttention, ForcedPathsAreRefusedWhereTheyCannotRun) {
  const auto x = random_qkv(4, 1, 8);
  FlexformerAttention att = module(FeatureMap::kStationary, Normalizer::kShift, InputNorm::kL2, 1, 8);
  const auto cu = cu_of({4});
  EXPECT_NE(error_of([&] { att.attend_fused(x.q, x.k, x.v, cu, 0, 4, nullptr, nullptr, LinearAttentionPath::kAmx); })
                .find("bf16 products need bf16 inputs"),
            std::string::npos);
  auto d = random_qkv(4, 1, 8, torch::kDouble);
  EXPECT_NE(error_of([&] { att.attend_fused(d.q, d.k, d.v, cu, 0, 4, nullptr, nullptr, LinearAttentionPath::kAvx512); })
                .find("fp64 runs the portable loops only"),
            std::string::npos);
  if (!amx_usable()) {
    auto b = random_qkv(4, 1, 8, torch::kBFloat16);
    EXPECT_NE(error_of([&] { att.attend_fused(b.q, b.k, b.v, cu, 0, 4, nullptr, nullptr, LinearAttentionPath::kAmx); })
                  .find("path amx cannot run"),
              std::string::npos);
  }
  EXPECT_EQ(resolve_linear_attention_path(torch::kDouble, LinearAttentionPath::kAuto), LinearAttentionPath::kPortable);
  if (avx512_usable()) {
    EXPECT_EQ(resolve_linear_attention_path(torch::kFloat, LinearAttentionPath::kAuto), LinearAttentionPath::kAvx512);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Variable length, isolation, causality, the state pass

TEST(FusedLinearAttention, PackedEqualsSeparateAndSequencesAreIsolated) {
  torch::manual_seed(5);
  const std::vector<int64_t> lengths{11, 1, 25, 7};
  const auto cu = cu_of(lengths);
  auto x = random_qkv(44, 2, 16);
  FlexformerAttention att = module(FeatureMap::kStationary, Normalizer::kShift, InputNorm::kL2, 2, 16);
  auto packed = att.attend_fused(x.q, x.k, x.v, cu, 0, 8);
  int64_t start = 0;
  for (int64_t len : lengths) {
    auto sl = [&](const torch::Tensor& t) { return t.slice(0, start, start + len); };
    auto one = att.attend_fused(sl(x.q), sl(x.k), sl(x.v), cu_of({len}), 0, 8);
    EXPECT_TRUE(torch::equal(one, sl(packed))) << "sequence at " << start;
    start += len;
  }
  auto k2 = x.k.clone(), v2 = x.v.clone();
  k2.slice(0, 12, 37) += 3.0;
  v2.slice(0, 12, 37) -= 1.0;
  auto edited = att.attend_fused(x.q, k2, v2, cu, 0, 8);
  EXPECT_TRUE(torch::equal(edited.slice(0, 0, 12), packed.slice(0, 0, 12)));
  EXPECT_TRUE(torch::equal(edited.slice(0, 37), packed.slice(0, 37)));
  EXPECT_FALSE(torch::allclose(edited.slice(0, 12, 37), packed.slice(0, 12, 37)));
  // Causality: a later token never changes an earlier output.
  for (int64_t t : {0, 15, 16, 30}) {
    auto q = x.q.clone(), k = x.k.clone(), v = x.v.clone();
    q[12 + t] += 1.0;
    k[12 + t] -= 2.0;
    v[12 + t] += 5.0;
    auto after = att.attend_fused(q, k, v, cu, 0, 8);
    if (t < 25) {
      EXPECT_TRUE(torch::equal(after.slice(0, 0, 12 + t), packed.slice(0, 0, 12 + t))) << t;
      EXPECT_FALSE(torch::allclose(after[12 + t], packed[12 + t])) << t;
    }
  }
}

TEST(FusedLinearAttention, OneLongSequenceSplitOverThreadsEqualsOneThread) {
  torch::manual_seed(6);
  const int previous = at::get_num_threads();
  for (FeatureMap f : {FeatureMap::kStationary, FeatureMap::kNonstationary, FeatureMap::kElu}) {
    FlexformerAttention att = module(f, Normalizer::kShift, InputNorm::kL2, 1, 8, 8, torch::kDouble);
    // One head, so that any thread count above 1 cuts the sequence into ranges (the state pass); plus short ones.
    const std::vector<int64_t> lengths{700, 3, 40};
    const auto cu = cu_of(lengths);
    auto x = random_qkv(743, 1, 8, torch::kDouble);
    const auto g = torch::randn({743, 1, 8}, torch::kDouble);
    at::set_num_threads(1);
    const CallResult one = run_case(att, x, g, fused(att, cu, 16));
    for (int threads : {2, 3, 4}) {
      at::set_num_threads(threads);
      const CallResult many = run_case(att, x, g, fused(att, cu, 16));
      const Errors e = compare(many, one, "threads");
      EXPECT_LT(e.out, 1e-12) << threads << " threads";
      EXPECT_LT(e.grad, 1e-11) << threads << " threads";
      const CallResult again = run_case(att, x, g, fused(att, cu, 16));
      EXPECT_TRUE(torch::equal(again.out, many.out)) << "same threads, same bits";
      for (size_t i = 0; i < many.grads.size(); ++i) {
        EXPECT_TRUE(torch::equal(again.grads[i].second, many.grads[i].second)) << many.grads[i].first;
      }
    }
  }
  at::set_num_threads(previous);
}

// The passes run a thread's heads of one sequence in lockstep, chunk by chunk (fused.cpp, bundles_of), each head
// from its own state: every head must give the same bits as when it is the only head of the call.
TEST(FusedLinearAttention, HeadsRunTogetherGiveTheSameBitsAsEachHeadAlone) {
  torch::manual_seed(7);
  const int previous = at::get_num_threads();
  const std::vector<int64_t> lengths{130, 1, 77};
  const auto cu = cu_of(lengths);
  const int64_t T = total_of(lengths), H = 3, d = 16, m = 8;
  for (FeatureMap f : {FeatureMap::kStationary, FeatureMap::kNonstationary, FeatureMap::kElu}) {
    for (torch::ScalarType dtype : {torch::kFloat, torch::kBFloat16}) {
      FusedFeatureMap map;
      map.feature_map = f;
      if (f != FeatureMap::kElu) map.omega = torch::randn({H, m, d});
      if (f == FeatureMap::kNonstationary) map.omega2 = torch::randn({H, m, d});
      map.alpha = torch::rand({H}) + 0.5;
      const auto x = random_qkv(T, H, d, dtype);
      const auto g = torch::randn({T, H, d}).to(dtype);
      FusedLinearAttentionOptions o;
      o.chunk_size = 16;
      const std::string what = name_of(f, Normalizer::kShift, InputNorm::kL2) + " " + c10::toString(dtype);
      // One thread: a single head is one unit per sequence as it is among three (two threads would cut a lone
      // head's sequence into ranges, which sums its state differently).
      at::set_num_threads(1);
      const auto all = fused_linear_attention_forward(x.q, x.k, x.v, cu, map, o);
      const auto all_g = fused_linear_attention_backward(g, x.q, x.k, x.v, all, cu, map, o);
      for (int64_t h = 0; h < H; ++h) {
        auto head = [&](const torch::Tensor& t) { return t.narrow(1, h, 1).contiguous(); };
        auto param = [&](const torch::Tensor& t) { return t.defined() ? t.narrow(0, h, 1).contiguous() : t; };
        FusedFeatureMap one_map = map;
        one_map.omega = param(map.omega);
        one_map.omega2 = param(map.omega2);
        one_map.alpha = param(map.alpha);
        const auto one = fused_linear_attention_forward(head(x.q), head(x.k), head(x.v), cu, one_map, o);
        const auto one_g = fused_linear_attention_backward(head(g), head(x.q), head(x.k), head(x.v), one, cu,
                                                           one_map, o);
        const std::string at = what + " head " + std::to_string(h);
        EXPECT_TRUE(torch::equal(one.out, head(all.out))) << at;
        EXPECT_TRUE(torch::equal(one.stat, all.stat.narrow(1, h, 1).contiguous())) << at;
        EXPECT_TRUE(torch::equal(one_g.dq, head(all_g.dq))) << at;
        EXPECT_TRUE(torch::equal(one_g.dk, head(all_g.dk))) << at;
        EXPECT_TRUE(torch::equal(one_g.dv, head(all_g.dv))) << at;
        EXPECT_TRUE(torch::equal(one_g.dalpha, param(all_g.dalpha))) << at;
        if (map.omega.defined()) EXPECT_TRUE(torch::equal(one_g.domega, param(all_g.domega))) << at;
        if (map.omega2.defined()) EXPECT_TRUE(torch::equal(one_g.domega2, param(all_g.domega2))) << at;
      }
    }
  }
  at::set_num_threads(previous);
}

// The kernel reads q, k, v and dout through their token and head strides (the model hands it slices of a fused
// projection). Strided views must give the same bits as contiguous copies on every path this CPU has: the row
// loads, elu's transposing load and the second backward sweep's dout-only reads all address rows by those strides.
// d = 24 leaves a partial 16-lane block in every row; shift and clamp reuse the first sweep's dden in the second,
// none takes the second sweep's path that reads y.
TEST(FusedLinearAttention, StridedInputsGiveTheSameBitsAsContiguousCopiesOnEveryPath) {
  torch::manual_seed(8);
  const std::vector<int64_t> lengths{70, 1, 45};
  const auto cu = cu_of(lengths);
  const int64_t T = total_of(lengths), H = 2, d = 24, m = 8;
  struct Case {
    LinearAttentionPath path;
    torch::ScalarType dtype;
  };
  std::vector<Case> cases{{LinearAttentionPath::kPortable, torch::kFloat},
                          {LinearAttentionPath::kPortable, torch::kBFloat16}};
  if (avx512_usable()) {
    cases.push_back({LinearAttentionPath::kAvx512, torch::kFloat});
    cases.push_back({LinearAttentionPath::kAvx512, torch::kBFloat16});
  }
  if (avx512_usable() && cpu_features().avx512_bf16) {
    cases.push_back({LinearAttentionPath::kAvx512Bf16, torch::kBFloat16});
  }
  if (amx_usable()) cases.push_back({LinearAttentionPath::kAmx, torch::kBFloat16});
  for (const Case& c : cases) {
    for (FeatureMap f : {FeatureMap::kStationary, FeatureMap::kElu}) {
      for (Normalizer n : kNormalizers) {
        FusedFeatureMap map;
        map.feature_map = f;
        map.normalizer = n;
        if (f != FeatureMap::kElu) map.omega = torch::randn({H, m, d});
        if (n == Normalizer::kShift) map.alpha = torch::rand({H}) + 0.5;
        // q, k, v: slices of one [T, 3, H, d] projection (token stride 3 H d); dout: the first half of each head's
        // 2 d columns (head stride 2 d).
        const auto qkv = torch::randn({T, 3, H, d}).to(c.dtype);
        const auto q = qkv.select(1, 0), k = qkv.select(1, 1), v = qkv.select(1, 2);
        const auto g = torch::randn({T, H, 2 * d}).to(c.dtype).narrow(2, 0, d);
        ASSERT_FALSE(q.is_contiguous());
        ASSERT_FALSE(g.is_contiguous());
        FusedLinearAttentionOptions o;
        o.chunk_size = 16;
        o.path = c.path;
        const std::string what = name_of(f, n, InputNorm::kL2) + " " + to_string(c.path) + " " +
                                 c10::toString(c.dtype);
        const auto strided = fused_linear_attention_forward(q, k, v, cu, map, o);
        const auto strided_g = fused_linear_attention_backward(g, q, k, v, strided, cu, map, o);
        const auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
        const auto dense = fused_linear_attention_forward(qc, kc, vc, cu, map, o);
        const auto dense_g = fused_linear_attention_backward(g.contiguous(), qc, kc, vc, dense, cu, map, o);
        EXPECT_TRUE(torch::equal(strided.out, dense.out)) << what;
        EXPECT_TRUE(torch::equal(strided.stat, dense.stat)) << what;
        EXPECT_TRUE(torch::equal(strided_g.dq, dense_g.dq)) << what;
        EXPECT_TRUE(torch::equal(strided_g.dk, dense_g.dk)) << what;
        EXPECT_TRUE(torch::equal(strided_g.dv, dense_g.dv)) << what;
        if (map.alpha.defined()) EXPECT_TRUE(torch::equal(strided_g.dalpha, dense_g.dalpha)) << what;
        if (map.omega.defined()) EXPECT_TRUE(torch::equal(strided_g.domega, dense_g.domega)) << what;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// States

TEST(FusedLinearAttention, StatesHaveTheReferenceLayoutAndSplitAndResumeEqualsOnePass) {
  torch::manual_seed(7);
  for (Normalizer n : kNormalizers) {
    FlexformerAttention att = module(FeatureMap::kNonstationary, n, InputNorm::kL2, 2, 8, 8, torch::kDouble);
    auto x = random_qkv(50, 2, 8, torch::kDouble);
    LinearAttentionState ref_state, fused_state;
    auto ref = att.attend(x.q, x.k, x.v, cu_of({50}), 0, LinearAttentionForm::kChunk, 16, nullptr, &ref_state);
    auto all = att.attend_fused(x.q, x.k, x.v, cu_of({50}), 0, 16, nullptr, &fused_state);
    EXPECT_LT(rel_err(all, ref), 1e-12);
    ASSERT_EQ(fused_state.s.sizes(), ref_state.s.sizes());
    EXPECT_LT(rel_err(fused_state.s, ref_state.s), 1e-12);
    EXPECT_LT(rel_err(fused_state.z, ref_state.z), 1e-12);
    for (int64_t split : {1, 17, 32}) {
      LinearAttentionState mid, end;
      auto first = att.attend_fused(x.q.slice(0, 0, split), x.k.slice(0, 0, split), x.v.slice(0, 0, split),
                                    cu_of({split}), 0, 16, nullptr, &mid);
      auto second = att.attend_fused(x.q.slice(0, split), x.k.slice(0, split), x.v.slice(0, split),
                                     cu_of({50 - split}), 0, 16, &mid, &end);
      EXPECT_LT(rel_err(torch::cat({first, second}), all), 1e-12) << split;
      EXPECT_LT(rel_err(end.s, fused_state.s), 1e-12) << split;
    }
    // Token by token from the carried state (the decoding step) equals the whole sequence.
    LinearAttentionState carried;
    std::vector<torch::Tensor> steps;
    for (int64_t t = 0; t < 50; ++t) {
      LinearAttentionState next;
      steps.push_back(att.attend_fused(x.q.slice(0, t, t + 1), x.k.slice(0, t, t + 1), x.v.slice(0, t, t + 1),
                                       cu_of({1}), 0, 16, t ? &carried : nullptr, &next));
      carried = next;
    }
    EXPECT_LT(rel_err(torch::cat(steps), all), 1e-12);
    EXPECT_LT(rel_err(carried.s, fused_state.s), 1e-12);
  }
}

TEST(FusedLinearAttention, GradientsFlowWithAnInitialState) {
  torch::manual_seed(8);
  FlexformerAttention att = module(FeatureMap::kStationary, Normalizer::kShift, InputNorm::kL2, 2, 8, 8, torch::kDouble);
  auto x = random_qkv(30, 2, 8, torch::kDouble);
  LinearAttentionState init{torch::randn({2, 2, att.feature_dim(), 8}, torch::kDouble).abs(),
                            torch::rand({2, 2, att.feature_dim()}, torch::kDouble) + 1.0};
  const auto cu = cu_of({12, 18});
  const auto g = torch::randn({30, 2, 8}, torch::kDouble);
  const CallResult ref = run_case(att, x, g, [&](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
    return att.attend(q, k, v, cu, 0, LinearAttentionForm::kQuadratic, 1, &init);
  });
  const CallResult got = run_case(att, x, g, [&](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
    return att.attend_fused(q, k, v, cu, 0, 5, &init);
  });
  const Errors e = compare(got, ref, "initial state");
  EXPECT_LT(e.out, 1e-12);
  EXPECT_LT(e.grad, 1e-11);
}

// ---------------------------------------------------------------------------------------------------------------
// Errors

TEST(FusedLinearAttention, BadInputsNameTheArgument) {
  auto x = random_qkv(10, 2, 8);
  FusedFeatureMap map;
  map.omega = torch::randn({2, 4, 8});
  map.alpha = torch::ones({2}) * 1.1;
  const auto cu = cu_of({10});
  EXPECT_NE(error_of([&] { fused_linear_attention(x.q, x.k, x.v, cu_of({4, 5}), map); }).find("from 0 to T = 10"),
            std::string::npos);
  FusedLinearAttentionOptions zero;
  zero.chunk_size = 0;
  EXPECT_NE(error_of([&] { fused_linear_attention(x.q, x.k, x.v, cu, map, zero); }).find("chunk_size"),
            std::string::npos);
  FusedFeatureMap no_omega = map;
  no_omega.omega = torch::Tensor();
  EXPECT_NE(error_of([&] { fused_linear_attention(x.q, x.k, x.v, cu, no_omega); }).find("map.omega"), std::string::npos);
  FusedFeatureMap wrong_alpha = map;
  wrong_alpha.alpha = torch::ones({3});
  EXPECT_NE(error_of([&] { fused_linear_attention(x.q, x.k, x.v, cu, wrong_alpha); }).find("map.alpha"),
            std::string::npos);
  FusedFeatureMap elu = map;
  elu.feature_map = FeatureMap::kElu;
  EXPECT_NE(error_of([&] { fused_linear_attention(x.q, x.k, x.v, cu, elu); }).find("use none"), std::string::npos);
  FusedFeatureMap weight = map;
  weight.key_offset = torch::zeros({2});
  EXPECT_NE(error_of([&] { fused_linear_attention(x.q, x.k, x.v, cu, weight); }).find("input_norm scale"),
            std::string::npos);
  EXPECT_NE(error_of([&] { fused_linear_attention(x.q, x.k.slice(0, 0, 9), x.v, cu, map); }).find("[9, 2, 8]"),
            std::string::npos);
  LinearAttentionState bad{torch::zeros({1, 2, 9, 8}), torch::zeros({1, 2, 7})};
  EXPECT_NE(error_of([&] { fused_linear_attention(x.q, x.k, x.v, cu, map, {}, &bad); }).find("initial state"),
            std::string::npos);
}

// ---------------------------------------------------------------------------------------------------------------
// The model's switch

TEST(FusedLinearAttention, TheModelUsesItByDefaultAndItsTwinGivesTheSameLossAndGradients) {
  torch::manual_seed(9);
  ModelConfig cfg;
  cfg.d_model = 32;
  cfg.n_layers = 2;
  cfg.n_heads = 4;
  cfg.d_ff = 64;
  AttentionConfig a;
  a.backend = "flexformer";
  a.num_features = 8;
  a.chunk_size = 4;
  EXPECT_EQ(FlexformerOptions::from_config(a).impl, LinearAttentionImpl::kFused);
  a.linear_impl = "reference";
  EXPECT_EQ(FlexformerOptions::from_config(a).impl, LinearAttentionImpl::kReference);
  a.linear_impl = "tiled";
  EXPECT_NE(error_of([&] { FlexformerOptions::from_config(a); }).find("attention.linear_impl"), std::string::npos);
  for (const char* map : {"stationary", "elu"}) {
    a.feature_map = map;
    a.linear_impl = "fused";
    torch::manual_seed(10);
    Transformer fused_model(cfg, a);
    a.linear_impl = "reference";
    torch::manual_seed(10);
    Transformer reference_model(cfg, a);
    PackedBatch b;
    b.cu_seqlens = cu_of({5, 17, 1, 9});
    b.tokens = torch::randint(0, kVocabSize, {32}, torch::kInt64);
    b.targets = torch::randint(0, 256, {32}, torch::kInt64);
    b.positions = torch::cat({torch::arange(5), torch::arange(17), torch::arange(1), torch::arange(9)}).to(torch::kInt64);
    b.sample_ids = {0, 1, 2, 3};
    auto lf = fused_model->loss_sum(b, 1), lr = reference_model->loss_sum(b, 1);
    lf.backward();
    lr.backward();
    EXPECT_NEAR(lf.item<double>(), lr.item<double>(), 1e-5 * std::abs(lr.item<double>())) << map;
    auto pf = fused_model->named_parameters(), pr = reference_model->named_parameters();
    for (const auto& p : pr) {
      EXPECT_LT(rel_err(pf[p.key()].grad(), p.value().grad()), 1e-4) << map << " " << p.key();
    }
  }
}
