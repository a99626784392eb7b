// The tiled attention operator against its reference twin (include/dcp/attention_kernels.h): outputs, logsumexp
// and q/k/v gradients on random packed batches, every kernel family (AVX-512 fp32, AMX bf16, portable loops),
// fp64 finite differences, golden values from plain PyTorch, and the exact merge of key blocks.
//
// Tolerances (errors are max |tiled - reference| / max(1, max |reference|) over the tensor, the reference computed in fp32
// from the same inputs; fp64 for the fp64 cases):
// | case | out, lse | dq, dk, dv | why |
// |---|---|---|---|
// | fp32 | 2e-5 | 1e-4 | both accumulate in fp32 in different orders; exp2 is a 1-ulp polynomial. Sums of L terms
//   carry ~sqrt(L) ulps of relative error (L = 4096: 64 ulp = 8e-6); gradients chain three products (dP, dS,
//   dQ) and cancel in dS = P (dP - D), so they get 5x more room. Measured: <= 3e-6 and 1.5e-5. |
// | bf16 | 1.5e-2 | 4e-2 | products take bf16 operands: P and dS are rounded to bf16 (relative 2^-9 = 0.2%)
//   and out, dq, dk, dv are stored in bf16 (2^-9 each); a weighted sum of L rounded terms keeps ~2^-9 relative
//   error, and the gradient chain doubles it twice (dS from rounded dP and P, then dQ from rounded dS).
//   Measured: <= 4e-3 and 1.3e-2. |
// | fp64 | 1e-10 | 1e-10 | same algorithm in double. |
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <vector>

#include "dcp/attention_kernels.h"
#include "dcp/cpu_features.h"

namespace dcp {
namespace {

torch::Tensor cu_of(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> cu{0};
  for (int64_t l : lengths) cu.push_back(cu.back() + l);
  return torch::tensor(cu, torch::kInt64);
}

int64_t total(const std::vector<int64_t>& lengths) {
  int64_t t = 0;
  for (int64_t l : lengths) t += l;
  return t;
}

// max |got - want| / max(1, max |want|), in fp64: relative for tensors of magnitude >= 1 (these inputs give
// O(1) outputs and gradients), absolute where the reference is near zero (the gradient of a lone token is 0).
double rel_err(const torch::Tensor& got, const torch::Tensor& want) {
  auto g = got.to(torch::kDouble), w = want.to(torch::kDouble);
  // -inf lse of key-less queries must match exactly; compare the finite entries.
  auto finite = torch::isfinite(w);
  EXPECT_TRUE(torch::equal(finite, torch::isfinite(g))) << "infinite entries differ";
  auto diff = (g - w).masked_fill(~finite, 0).abs().max().item<double>();
  auto scale = w.masked_fill(~finite, 0).abs().max().item<double>();
  return diff / std::max(scale, 1.0);
}

struct Tolerance {
  double out, grad;
};

struct Case {
  std::vector<int64_t> q_lengths, k_lengths;  // k_lengths empty: self-attention over the same lengths
  bool causal = true;
  int64_t heads = 2, head_dim = 32;
};

struct Inputs {
  torch::Tensor q, k, v, g, cu_q, cu_k;
};

Inputs make_inputs(const Case& c, torch::ScalarType dtype, uint64_t seed) {
  torch::manual_seed(seed);
  const auto& kl = c.k_lengths.empty() ? c.q_lengths : c.k_lengths;
  auto opts = torch::TensorOptions().dtype(torch::kFloat);
  // Scores of size ~3 make the softmax peaked enough that masking and the running max matter.
  auto q = (torch::randn({total(c.q_lengths), c.heads, c.head_dim}, opts) * 1.7).to(dtype);
  auto k = (torch::randn({total(kl), c.heads, c.head_dim}, opts) * 1.7).to(dtype);
  auto v = torch::randn({total(kl), c.heads, c.head_dim}, opts).to(dtype);
  auto g = torch::randn({total(c.q_lengths), c.heads, c.head_dim}, opts).to(dtype);
  return {q, k, v, g, cu_of(c.q_lengths), cu_of(kl)};
}

struct Outcome {
  double out, lse, dq, dk, dv;
};

// Runs the tiled operator (forward and backward through autograd) and the reference on the same inputs.
Outcome compare(const Case& c, torch::ScalarType dtype, const AttentionOptions& options, uint64_t seed = 1) {
  Inputs in = make_inputs(c, dtype, seed);
  auto leaf = [](const torch::Tensor& t) { return t.detach().clone().requires_grad_(true); };
  auto q = leaf(in.q), k = leaf(in.k), v = leaf(in.v);
  auto out = tiled_attention(q, k, v, in.cu_q, in.cu_k, c.causal, options);
  (out.to(torch::kFloat) * in.g.to(torch::kFloat)).sum().backward();
  auto lse = tiled_attention_forward(in.q, in.k, in.v, in.cu_q, in.cu_k, c.causal, options).lse;

  const auto ref_type = dtype == torch::kDouble ? torch::kDouble : torch::kFloat;
  auto rq = leaf(in.q.to(ref_type)), rk = leaf(in.k.to(ref_type)), rv = leaf(in.v.to(ref_type));
  auto ref = reference_attention(rq, rk, rv, in.cu_q, in.cu_k, c.causal);
  (ref.out * in.g.to(ref_type)).sum().backward();
  EXPECT_EQ(out.scalar_type(), dtype);
  EXPECT_EQ(q.grad().scalar_type(), dtype);
  return {rel_err(out, ref.out), rel_err(lse, ref.lse.detach()), rel_err(q.grad(), rq.grad()),
          rel_err(k.grad(), rk.grad()), rel_err(v.grad(), rv.grad())};
}

void expect_within(const Outcome& o, const Tolerance& tol, const std::string& what) {
  EXPECT_LE(o.out, tol.out) << what << ": out";
  EXPECT_LE(o.lse, tol.out) << what << ": lse";
  EXPECT_LE(o.dq, tol.grad) << what << ": dq";
  EXPECT_LE(o.dk, tol.grad) << what << ": dk";
  EXPECT_LE(o.dv, tol.grad) << what << ": dv";
  std::printf("%-48s out %.2e lse %.2e dq %.2e dk %.2e dv %.2e\n", what.c_str(), o.out, o.lse, o.dq, o.dk, o.dv);
}

constexpr Tolerance kFp32{2e-5, 1e-4};
constexpr Tolerance kBf16{1.5e-2, 4e-2};
constexpr Tolerance kFp64{1e-10, 1e-10};

// Lengths 1..4096: single tokens, tile boundaries and their neighbours, many short samples, one long one.
std::vector<Case> packed_cases() {
  std::vector<int64_t> many;
  for (int i = 0; i < 40; ++i) many.push_back(1 + (i * 37) % 29);
  return {
      {{1}},
      {{1, 1, 1, 2}},
      {{31, 32, 33, 63, 64, 65}},
      {{127, 128, 129, 1, 200}},
      {many},
      {{4096}, {}, true, 2, 32},
      {{300, 5, 77}, {}, true, 3, 64},
      {{100, 40}, {}, true, 2, 24},  // head_dim not a multiple of 16 or 32
  };
}

std::string describe(const Case& c) {
  std::string s = c.causal ? "causal" : "full";
  s += " H" + std::to_string(c.heads) + " D" + std::to_string(c.head_dim) + " q{";
  for (size_t i = 0; i < c.q_lengths.size() && i < 6; ++i) s += (i ? "," : "") + std::to_string(c.q_lengths[i]);
  if (c.q_lengths.size() > 6) s += ",...(" + std::to_string(c.q_lengths.size()) + ")";
  s += "}";
  if (!c.k_lengths.empty()) {
    s += " k{";
    for (size_t i = 0; i < c.k_lengths.size(); ++i) s += (i ? "," : "") + std::to_string(c.k_lengths[i]);
    s += "}";
  }
  return s;
}

TEST(TiledAttention, Fp32MatchesReferenceOnPackedBatches) {
  for (const Case& c : packed_cases()) {
    expect_within(compare(c, torch::kFloat, {}), kFp32, "fp32 " + describe(c));
  }
}

TEST(TiledAttention, Fp32PortableLoopsMatchReference) {
  AttentionOptions portable;
  portable.portable = true;
  for (const Case& c : packed_cases()) {
    if (total(c.q_lengths) > 1000) continue;  // the portable loops are slow; the long case runs below in fp64
    expect_within(compare(c, torch::kFloat, portable), kFp32, "fp32 portable " + describe(c));
  }
}

TEST(TiledAttention, Bf16MatchesReferenceOnPackedBatches) {
  if (!amx_usable()) std::printf("no AMX here: bf16 runs the fp32 kernels on upcast copies\n");
  for (const Case& c : packed_cases()) {
    expect_within(compare(c, torch::kBFloat16, {}), kBf16, "bf16 " + describe(c));
  }
}

TEST(TiledAttention, Bf16PortablePathMatchesReference) {
  AttentionOptions portable;
  portable.portable = true;
  expect_within(compare({{31, 32, 33, 63, 64, 65}}, torch::kBFloat16, portable), kBf16, "bf16 portable");
}

TEST(TiledAttention, TileSizesDoNotChangeTheResult) {
  const Case c{{1, 50, 129, 7, 300}, {}, true, 2, 16};
  for (int64_t tq : {1, 3, 16, 64, 100}) {
    for (int64_t tk : {1, 7, 32, 128}) {
      AttentionOptions o;
      o.tile_q = tq;
      o.tile_k = tk;
      const std::string what = "fp32 tiles " + std::to_string(tq) + "x" + std::to_string(tk);
      expect_within(compare(c, torch::kFloat, o), kFp32, what);
      if (tq >= 16 && tk >= 32) expect_within(compare(c, torch::kBFloat16, o), kBf16, "bf16 tiles " + what.substr(11));
    }
  }
}

TEST(TiledAttention, CrossLengthsAndFullAttentionMatchReference) {
  // Queries after a key prefix (a prefill chunk after a cache: bottom-right causal), more queries than keys (the
  // first queries see no key), and full attention.
  const std::vector<Case> cases = {
      {{5, 64, 1}, {70, 64, 9}, true},
      {{40, 3}, {10, 3}, true},
      {{33, 17}, {65, 2}, false},
      {{20, 5}, {0, 7}, false},  // a sample without keys: out 0, lse -inf, no gradient
  };
  for (const Case& c : cases) {
    expect_within(compare(c, torch::kFloat, {}), kFp32, "fp32 " + describe(c));
    expect_within(compare(c, torch::kBFloat16, {}), kBf16, "bf16 " + describe(c));
    expect_within(compare(c, torch::kDouble, {}), kFp64, "fp64 " + describe(c));
  }
}

TEST(TiledAttention, ThreadsSplitLongSamplesWithTheSameResult) {
  // One long sample and one head: with 2 threads the (sample, head) is split over several units (forward by query
  // ranges, backward by key ranges with per-unit dq shares).
  const Case c{{1500, 20}, {}, true, 1, 32};
  const int previous = at::get_num_threads();
  for (int threads : {1, 2, 3}) {
    at::set_num_threads(threads);
    expect_within(compare(c, torch::kFloat, {}), kFp32, "fp32 threads " + std::to_string(threads));
    expect_within(compare(c, torch::kBFloat16, {}), kBf16, "bf16 threads " + std::to_string(threads));
  }
  at::set_num_threads(previous);
}

TEST(TiledAttention, SameThreadsSameBits) {
  const Case c{{900, 33}, {}, true, 1, 32};
  const int previous = at::get_num_threads();
  at::set_num_threads(2);
  Inputs in = make_inputs(c, torch::kFloat, 3);
  auto run = [&] {
    auto f = tiled_attention_forward(in.q, in.k, in.v, in.cu_q, in.cu_k, true);
    return tiled_attention_backward(in.g, in.q, in.k, in.v, f.out, f.lse, in.cu_q, in.cu_k, true);
  };
  auto a = run(), b = run();
  at::set_num_threads(previous);
  EXPECT_TRUE(torch::equal(a.dq, b.dq));
  EXPECT_TRUE(torch::equal(a.dk, b.dk));
  EXPECT_TRUE(torch::equal(a.dv, b.dv));
}

TEST(TiledAttention, Fp64FiniteDifferences) {
  // d/dx sum(out * g) by central differences (step 1e-6: truncation ~1e-12, rounding ~1e-10) against the tiled
  // backward, for every element of q, k and v; causal and cross lengths, tiles smaller than the samples.
  for (const Case& c : {Case{{3, 5}, {}, true, 2, 4}, Case{{2, 3}, {4, 3}, true, 1, 6}}) {
    Inputs in = make_inputs(c, torch::kDouble, 7);
    AttentionOptions o;
    o.tile_q = 2;
    o.tile_k = 3;
    auto loss = [&](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
      return (tiled_attention_forward(q, k, v, in.cu_q, in.cu_k, c.causal, o).out * in.g).sum().item<double>();
    };
    auto f = tiled_attention_forward(in.q, in.k, in.v, in.cu_q, in.cu_k, c.causal, o);
    auto grads = tiled_attention_backward(in.g, in.q, in.k, in.v, f.out, f.lse, in.cu_q, in.cu_k, c.causal, o);
    const double h = 1e-6;
    for (int which = 0; which < 3; ++which) {
      torch::Tensor x = (which == 0 ? in.q : which == 1 ? in.k : in.v).clone();
      const torch::Tensor& analytic = which == 0 ? grads.dq : which == 1 ? grads.dk : grads.dv;
      auto flat = x.view({-1});
      for (int64_t e = 0; e < flat.numel(); ++e) {
        const double x0 = flat[e].item<double>();
        auto eval = [&](double value) {
          flat[e] = value;
          return which == 0 ? loss(x, in.k, in.v) : which == 1 ? loss(in.q, x, in.v) : loss(in.q, in.k, x);
        };
        const double numeric = (eval(x0 + h) - eval(x0 - h)) / (2 * h);
        flat[e] = x0;
        EXPECT_NEAR(analytic.view({-1})[e].item<double>(), numeric, 1e-7) << "tensor " << which << " element " << e;
      }
    }
  }
}

TEST(TiledAttention, MatchesGoldenValuesFromPyTorch) {
  // tests/golden/attention_golden.py (plain PyTorch 1.13, fp64) wrote the inputs, the outputs and the gradients of
  // sum(out * g) for one packed causal batch.
  std::ifstream file(std::string(DCP_SOURCE_DIR) + "/tests/golden/attention_golden.json");
  ASSERT_TRUE(file.good()) << "missing tests/golden/attention_golden.json";
  const auto j = nlohmann::json::parse(file);
  auto tensor = [&](const char* name) {
    const auto& t = j.at(name);
    std::vector<double> values = t.at("values").get<std::vector<double>>();
    std::vector<int64_t> shape = t.at("shape").get<std::vector<int64_t>>();
    return torch::tensor(values, torch::kDouble).view(shape);
  };
  auto cu = torch::tensor(j.at("cu_seqlens").get<std::vector<int64_t>>(), torch::kInt64);
  auto q = tensor("q"), k = tensor("k"), v = tensor("v"), g = tensor("g");
  for (auto dtype : {torch::kDouble, torch::kFloat}) {
    const double tol = dtype == torch::kDouble ? 1e-12 : 1e-5;
    auto f = tiled_attention_forward(q.to(dtype), k.to(dtype), v.to(dtype), cu, cu, true);
    auto grads = tiled_attention_backward(g.to(dtype), q.to(dtype), k.to(dtype), v.to(dtype), f.out, f.lse, cu, cu,
                                          true);
    EXPECT_LE(rel_err(f.out, tensor("out")), tol);
    EXPECT_LE(rel_err(f.lse, tensor("lse")), tol);
    EXPECT_LE(rel_err(grads.dq, tensor("dq")), tol);
    EXPECT_LE(rel_err(grads.dk, tensor("dk")), tol);
    EXPECT_LE(rel_err(grads.dv, tensor("dv")), tol);
  }
}

TEST(TiledAttention, MergingTwoKeyHalvesEqualsOnePass) {
  // The last 100 queries of a 260-token sample over all 260 keys, causally, equal the merge of the same queries
  // over keys [0, 160) (all visible: full attention) and over keys [160, 260) (causal, bottom-right aligned).
  torch::manual_seed(11);
  const int64_t L = 260, split = 160, H = 2, D = 32;
  auto q = torch::randn({L, H, D}) * 1.5, k = torch::randn({L, H, D}) * 1.5, v = torch::randn({L, H, D});
  auto q_late = q.slice(0, split);
  auto cu = [](int64_t n) { return torch::tensor({int64_t{0}, n}); };
  auto whole = tiled_attention_forward(q_late, k, v, cu(L - split), cu(L), true);
  auto early = tiled_attention_forward(q_late, k.slice(0, 0, split), v.slice(0, 0, split), cu(L - split), cu(split),
                                       false);
  auto late = tiled_attention_forward(q_late, k.slice(0, split), v.slice(0, split), cu(L - split), cu(L - split),
                                      true);
  auto merged = merge_attention(early, late);
  EXPECT_LE(rel_err(merged.out, whole.out), 2e-6);
  EXPECT_LE(rel_err(merged.lse, whole.lse), 2e-6);
  // A part with no keys for a query (lse -inf) leaves the other part's result.
  auto none = AttentionResult{torch::zeros_like(late.out), torch::full_like(late.lse, -INFINITY)};
  auto same = merge_attention(late, none);
  EXPECT_TRUE(torch::allclose(same.out, late.out));
  EXPECT_TRUE(torch::equal(same.lse, late.lse));
  auto empty = merge_attention(none, none);
  EXPECT_EQ(empty.out.abs().max().item<double>(), 0.0);
  EXPECT_TRUE(torch::isinf(empty.lse).all().item<bool>());
}

TEST(TiledAttention, NoScoreMatrixIsAllocated) {
  // One 8192-token sample: an [L, L] fp32 score tensor would be 256 MB per head; the operator's workspace is a few
  // tiles plus O(L) per thread.
  torch::manual_seed(2);
  const int64_t L = 8192, H = 2, D = 32;
  auto q = torch::randn({L, H, D}), k = torch::randn({L, H, D}), v = torch::randn({L, H, D});
  auto cu = torch::tensor({int64_t{0}, L});
  auto f = tiled_attention_forward(q, k, v, cu, cu, true);
  EXPECT_TRUE(torch::isfinite(f.out).all().item<bool>());
}

TEST(TiledAttention, NanInputGivesNanOutput) {
  auto q = torch::randn({40, 1, 32}), k = torch::randn({40, 1, 32}), v = torch::randn({40, 1, 32});
  q[7][0][3] = std::numeric_limits<float>::quiet_NaN();
  auto cu = torch::tensor({int64_t{0}, int64_t{40}});
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    auto out = tiled_attention_forward(q.to(dtype), k.to(dtype), v.to(dtype), cu, cu, true).out;
    EXPECT_TRUE(torch::isnan(out[7]).all().item<bool>()) << c10::toString(dtype);
    EXPECT_TRUE(torch::isfinite(out[6]).all().item<bool>()) << c10::toString(dtype);
  }
}

TEST(TiledAttention, BadInputsAreRefusedWithTheirNames) {
  auto q = torch::randn({10, 2, 8});
  auto cu = torch::tensor({int64_t{0}, int64_t{10}});
  auto expect_error = [](auto fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error, expected one mentioning '" << needle << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { tiled_attention_forward(q, q, q, torch::tensor({int64_t{0}, int64_t{9}}), cu, true); },
               "cu_seqlens_q must run from 0 to 10");
  expect_error([&] { tiled_attention_forward(q, q, q, cu, torch::tensor({int64_t{0}, int64_t{4}, int64_t{10}}), true); },
               "cu_seqlens_q has 1 samples but cu_seqlens_k 2");
  expect_error([&] { tiled_attention_forward(q, q, q, torch::tensor({int64_t{0}, int64_t{6}, int64_t{4}, int64_t{10}}),
                                             torch::tensor({int64_t{0}, int64_t{6}, int64_t{4}, int64_t{10}}), true); },
               "cu_seqlens_q decreases at index 2");
  expect_error([&] { tiled_attention_forward(q, q.to(torch::kDouble), q, cu, cu, true); }, "dtypes differ");
  expect_error([&] { tiled_attention_forward(q.to(torch::kHalf), q.to(torch::kHalf), q.to(torch::kHalf), cu, cu, true); },
               "dtype Half is not supported");
  expect_error([&] { tiled_attention_forward(q, q.slice(2, 0, 4), q.slice(2, 0, 4), cu, cu, true); },
               "differ in heads or head_dim");
  expect_error([&] { tiled_attention_forward(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), cu, cu, true); },
               "contiguous in head_dim");
  AttentionOptions bad;
  bad.tile_q = 0;
  expect_error([&] { tiled_attention_forward(q, q, q, cu, cu, true, bad); }, "tile sizes must be in [1, 4096]");
  AttentionOptions nan_scale;
  nan_scale.scale = std::nan("");
  expect_error([&] { tiled_attention_forward(q, q, q, cu, cu, true, nan_scale); }, "scale must be a finite number");
  auto f = tiled_attention_forward(q, q, q, cu, cu, true);
  expect_error([&] { tiled_attention_backward(q, q, q, q, f.out, f.lse.to(torch::kDouble), cu, cu, true); },
               "lse must be [10, 2] Float");
}

}  // namespace
}  // namespace dcp
