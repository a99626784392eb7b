#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "dcp/model.h"
#include "model/weight_cast.h"

using namespace dcp;

namespace {

ModelConfig tiny_config() {
  ModelConfig cfg;
  cfg.d_model = 32;
  cfg.n_layers = 3;
  cfg.n_heads = 4;
  cfg.d_ff = 64;
  return cfg;
}

// Built directly rather than through Corpus so the model is testable on its own; uses the global torch RNG.
PackedBatch random_batch(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> cu{0};
  std::vector<torch::Tensor> positions;
  for (int64_t len : lengths) {
    cu.push_back(cu.back() + len);
    positions.push_back(torch::arange(len, torch::kInt64));
  }
  PackedBatch b;
  b.tokens = torch::randint(0, kVocabSize, {cu.back()}, torch::kInt64);
  b.targets = torch::randint(0, 256, {cu.back()}, torch::kInt64);
  b.positions = torch::cat(positions);
  b.cu_seqlens = torch::tensor(cu, torch::kInt64);
  for (size_t i = 0; i < lengths.size(); ++i) b.sample_ids.push_back(static_cast<int64_t>(i));
  return b;
}

PackedBatch sample_of(const PackedBatch& b, int64_t i) {
  const int64_t start = b.cu_seqlens[i].item<int64_t>(), end = b.cu_seqlens[i + 1].item<int64_t>();
  PackedBatch s;
  s.tokens = b.tokens.slice(0, start, end);
  s.targets = b.targets.slice(0, start, end);
  s.positions = b.positions.slice(0, start, end);
  s.cu_seqlens = torch::tensor(std::vector<int64_t>{0, end - start}, torch::kInt64);
  s.sample_ids = {b.sample_ids[static_cast<size_t>(i)]};
  return s;
}

std::vector<std::pair<std::string, torch::Tensor>> grads_of(const Transformer& model) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : model->named_parameters()) out.emplace_back(p.key(), p.value().grad().clone());
  return out;
}

void expect_grads_close(const std::vector<std::pair<std::string, torch::Tensor>>& a,
                        const std::vector<std::pair<std::string, torch::Tensor>>& b, double rtol, double atol) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    EXPECT_TRUE(torch::allclose(a[i].second, b[i].second, rtol, atol))
        << a[i].first << ": max abs diff " << (a[i].second - b[i].second).abs().max().item<double>();
  }
}

// Block-diagonal causal mask over the whole packed stream: [T, T], true where query t may attend to key s.
torch::Tensor packed_causal_mask(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> owner;
  for (size_t i = 0; i < lengths.size(); ++i) owner.insert(owner.end(), static_cast<size_t>(lengths[i]), static_cast<int64_t>(i));
  auto doc = torch::tensor(owner, torch::kInt64);
  const int64_t total = doc.numel();
  auto same_doc = doc.unsqueeze(1) == doc.unsqueeze(0);
  auto causal = torch::ones({total, total}, torch::kBool).tril();
  return same_doc & causal;
}

}  // namespace

TEST(Packing, SameLogitsAndGradientsAsOneSampleAtATime) {
  torch::manual_seed(1);
  Transformer model(tiny_config());
  const std::vector<int64_t> lengths{5, 17, 9};
  PackedBatch batch = random_batch(lengths);

  model->zero_grad();
  auto packed_logits = model->forward(batch);
  model->loss_sum(batch).backward();
  auto packed_grads = grads_of(model);

  model->zero_grad();
  std::vector<torch::Tensor> single_logits;
  for (int64_t i = 0; i < static_cast<int64_t>(lengths.size()); ++i) {
    PackedBatch one = sample_of(batch, i);
    single_logits.push_back(model->forward(one));
    model->loss_sum(one).backward();
  }
  auto one_by_one = torch::cat(single_logits);
  EXPECT_TRUE(torch::allclose(packed_logits, one_by_one, 1e-5, 1e-5))
      << "max abs diff " << (packed_logits - one_by_one).abs().max().item<double>();
  expect_grads_close(packed_grads, grads_of(model), 1e-5, 1e-6);
}

TEST(Recompute, SameLossAndGradientsForAnyNumberOfLayers) {
  torch::manual_seed(2);
  Transformer model(tiny_config());
  PackedBatch batch = random_batch({5, 17, 9});

  std::vector<double> losses;
  std::vector<std::vector<std::pair<std::string, torch::Tensor>>> grads;
  for (int64_t layers : {0, 1, 3}) {
    model->zero_grad();
    auto loss = model->loss_sum(batch, layers);
    loss.backward();
    losses.push_back(loss.item<double>());
    grads.push_back(grads_of(model));
  }
  for (size_t i = 1; i < losses.size(); ++i) {
    EXPECT_NEAR(losses[i], losses[0], 1e-6 * std::abs(losses[0]));
    expect_grads_close(grads[i], grads[0], 1e-6, 1e-9);
  }
}

TEST(Recompute, NoGradForwardMatches) {
  torch::manual_seed(3);
  Transformer model(tiny_config());
  PackedBatch batch = random_batch({7, 4});
  auto expected = model->forward(batch).detach();
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::allclose(model->forward(batch, 3), expected, 1e-6, 1e-7));
}

TEST(Recompute, MatchesPlainAutogradIncludingNestedRecompute) {
  torch::manual_seed(4);
  auto w = torch::randn({6}, torch::requires_grad());
  auto x0 = torch::randn({3, 6});
  auto inner_calls = std::make_shared<int>(0);
  auto inner = [w, inner_calls](const torch::Tensor& h) {
    ++*inner_calls;
    return torch::tanh(h * w);
  };
  // The inner recompute runs while the outer one is being recomputed inside backward.
  auto outer = [w, inner](const torch::Tensor& h) { return recompute(inner, h * w).sin(); };
  auto plain = [w, inner](const torch::Tensor& h) { return inner(h * w).sin(); };

  auto run = [&](const std::function<torch::Tensor(const torch::Tensor&)>& f, bool checkpoint) {
    if (w.grad().defined()) w.mutable_grad().zero_();
    auto x = x0.clone().requires_grad_(true);
    auto y = checkpoint ? recompute(f, x * 2) : f(x * 2);
    (y * y).sum().backward();
    return std::make_pair(x.grad().clone(), w.grad().clone());
  };
  auto expected = run(plain, false);
  *inner_calls = 0;
  auto got = run(outer, true);
  // Once in the outer forward, once when backward reruns the outer fn, once when it reruns the inner one.
  EXPECT_EQ(*inner_calls, 3);
  EXPECT_TRUE(torch::allclose(got.first, expected.first, 1e-6, 1e-8));
  EXPECT_TRUE(torch::allclose(got.second, expected.second, 1e-6, 1e-8));
}

TEST(Model, CausalInsideSampleAndNothingAcrossSamples) {
  torch::manual_seed(5);
  Transformer model(tiny_config());
  PackedBatch batch = random_batch({5, 17, 9});
  torch::NoGradGuard no_grad;
  auto before = model->forward(batch);

  const int64_t start = 5, p = 6, changed = start + p;  // position 6 of the second sample
  PackedBatch edited = batch;
  edited.tokens = batch.tokens.clone();
  edited.tokens[changed] = (batch.tokens[changed].item<int64_t>() + 1) % kVocabSize;
  auto after = model->forward(edited);

  EXPECT_TRUE(torch::allclose(after.slice(0, 0, changed), before.slice(0, 0, changed), 0.0, 1e-6))
      << "first sample or earlier positions of the edited sample changed";
  EXPECT_TRUE(torch::allclose(after.slice(0, 22), before.slice(0, 22), 0.0, 1e-6)) << "third sample changed";
  EXPECT_FALSE(torch::allclose(after.slice(0, changed, 22), before.slice(0, changed, 22), 0.0, 1e-6))
      << "the edit did not reach its own and later positions";
}

TEST(Model, ParameterNamesAndInit) {
  torch::manual_seed(6);
  ModelConfig cfg = tiny_config();
  Transformer model(cfg);
  auto params = model->named_parameters();
  for (const char* name : {"embed.weight", "blocks.0.wqkv.weight", "blocks.0.attn_norm.weight", "blocks.2.wo.weight",
                           "blocks.2.w_gate.weight", "blocks.2.w_up.weight", "blocks.2.w_down.weight",
                           "blocks.1.mlp_norm.weight", "final_norm.weight", "head.weight"}) {
    EXPECT_NE(params.find(name), nullptr) << name;
  }
  EXPECT_EQ(params.size(), 3 + 7 * static_cast<size_t>(cfg.n_layers));
  EXPECT_TRUE(torch::equal(params["final_norm.weight"], torch::ones({cfg.d_model})));
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(cfg.n_layers));
  EXPECT_NEAR(params["blocks.0.w_down.weight"].std().item<double>(), residual_std, 0.15 * residual_std);
  EXPECT_NEAR(params["head.weight"].std().item<double>(), 0.02, 0.1 * 0.02);
}

TEST(Attention, SoftmaxMatchesDenseBlockDiagonalReference) {
  torch::manual_seed(7);
  const std::vector<int64_t> lengths{5, 17, 9};
  const int64_t total = 31, heads = 4, head_dim = 8;
  auto q = torch::randn({total, heads, head_dim});
  auto k = torch::randn({total, heads, head_dim});
  auto v = torch::randn({total, heads, head_dim});
  auto cu = torch::tensor(std::vector<int64_t>{0, 5, 22, 31}, torch::kInt64);

  auto scores = torch::matmul(q.transpose(0, 1), k.transpose(0, 1).transpose(1, 2)) / std::sqrt(double(head_dim));
  scores = scores.masked_fill(packed_causal_mask(lengths).logical_not(), -INFINITY);  // [H, T, T]
  auto expected = torch::matmul(torch::softmax(scores, -1), v.transpose(0, 1)).transpose(0, 1);

  auto got = SoftmaxAttention().forward(q, k, v, cu);
  ASSERT_EQ(got.sizes(), q.sizes());
  EXPECT_TRUE(torch::allclose(got, expected, 1e-5, 1e-6));
}

TEST(Attention, UnknownBackendThrowsConfigError) {
  AttentionConfig attn;
  EXPECT_NE(std::dynamic_pointer_cast<SoftmaxAttention>(make_attention_backend(attn, tiny_config())), nullptr);
  attn.backend = "bogus";
  EXPECT_THROW(make_attention_backend(attn, tiny_config()), ConfigError);
  EXPECT_THROW(Transformer(tiny_config(), attn), ConfigError);
}

TEST(Attention, EveryBlockOwnsItsBackendAndSoftmaxRegistersNothing) {
  Transformer model(tiny_config());
  std::set<const AttentionBackend*> backends;
  for (size_t i = 0; i < model->blocks->size(); ++i) backends.insert(model->blocks->ptr<BlockImpl>(i)->attention.get());
  EXPECT_EQ(backends.size(), model->blocks->size());
  for (const auto& p : model->named_parameters()) EXPECT_EQ(p.key().find("attention"), std::string::npos) << p.key();
  for (const auto& b : model->named_buffers()) EXPECT_EQ(b.key().find("attention"), std::string::npos) << b.key();
}

TEST(Rotary, HalfSplitPairsAndFrequencies) {
  const double theta = 10000.0;
  const int64_t p = 3;
  auto x = torch::zeros({1, 1, 4});
  x[0][0][1] = 1.0;  // dimension 1 rotates with dimension 3 at frequency theta^(-2/4)
  auto out = apply_rotary(x, torch::tensor(std::vector<int64_t>{p}, torch::kInt64), theta);
  const double angle = p * std::pow(theta, -0.5);
  EXPECT_NEAR(out[0][0][1].item<double>(), std::cos(angle), 1e-6);
  EXPECT_NEAR(out[0][0][3].item<double>(), std::sin(angle), 1e-6);
  EXPECT_NEAR(out[0][0][0].item<double>(), 0.0, 1e-7);
  EXPECT_NEAR(out[0][0][2].item<double>(), 0.0, 1e-7);
  EXPECT_THROW(apply_rotary(torch::zeros({1, 1, 3}), torch::zeros({1}, torch::kInt64), theta), std::invalid_argument);
}

TEST(Rotary, PreservesNormAndDependsOnlyOnRelativePosition) {
  torch::manual_seed(8);
  const double theta = 10000.0;
  const int64_t heads = 4, head_dim = 8;
  auto positions = torch::tensor(std::vector<int64_t>{0, 1, 5, 17, 40, 1000}, torch::kInt64);
  auto x = torch::randn({positions.numel(), heads, head_dim});
  auto rotated = apply_rotary(x, positions, theta);
  EXPECT_TRUE(torch::allclose(rotated.norm(2, -1), x.norm(2, -1), 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(rotated[0], x[0])) << "position 0 must be the identity";

  auto q = torch::randn({1, heads, head_dim});
  auto k = torch::randn({1, heads, head_dim});
  auto at = [&](const torch::Tensor& t, int64_t pos) {
    return apply_rotary(t, torch::tensor(std::vector<int64_t>{pos}, torch::kInt64), theta);
  };
  auto dot = [&](int64_t m, int64_t n) { return (at(q, m) * at(k, n)).sum(-1); };  // [1, heads]
  for (int64_t offset : {0, 3, -2, 11}) {
    auto reference = dot(20 + offset, 20);
    for (int64_t n : {2, 9, 33}) {
      EXPECT_TRUE(torch::allclose(dot(n + offset, n), reference, 1e-4, 1e-4)) << "offset " << offset << " n " << n;
    }
  }
  EXPECT_FALSE(torch::allclose(dot(3, 0), dot(0, 0), 1e-4, 1e-4)) << "scores must change with the offset";
}

TEST(Model, RecomputeLayersOutOfRangeThrows) {
  torch::manual_seed(9);
  Transformer model(tiny_config());
  PackedBatch batch = random_batch({4});
  EXPECT_THROW(model->forward(batch, -1), std::invalid_argument);
  try {
    model->forward(batch, 4);
    FAIL() << "recompute_layers 4 > n_layers 3 was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("4"), std::string::npos) << e.what();
  }
}

TEST(Model, AdamReducesLossOnFixedBatch) {
  torch::manual_seed(10);
  Transformer model(tiny_config());
  PackedBatch batch = random_batch({5, 17, 9});
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    opt.zero_grad();
    auto loss = model->loss_sum(batch, step % 2);  // alternate recompute so training also goes through it
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_NEAR(first, 31 * std::log(double(kVocabSize)), 0.1 * first) << "initial loss should be near uniform";
  EXPECT_LT(last, 0.5 * first);
}

namespace {

// An MHA model equal to a GQA one: every query head's K/V rows are a copy of its group's K/V head's rows
// (d_model rows of q, then kv_heads x head_dim rows of k and of v in wqkv), every other parameter copied.
Transformer expanded_twin(const Transformer& gqa, const ModelConfig& gqa_cfg, const AttentionConfig& attn) {
  ModelConfig mha_cfg = gqa_cfg;
  mha_cfg.n_kv_heads = 0;
  Transformer mha(mha_cfg, attn);
  torch::NoGradGuard no_grad;
  const int64_t d = gqa_cfg.d_model, hd = d / gqa_cfg.n_heads, kv = gqa_cfg.kv_heads(), g = gqa_cfg.n_heads / kv;
  auto src = gqa->named_parameters();
  for (auto& item : mha->named_parameters()) {
    const torch::Tensor& from = src[item.key()];
    if (item.key().find("wqkv") == std::string::npos) {
      item.value().copy_(from);
      continue;
    }
    item.value().narrow(0, 0, d).copy_(from.narrow(0, 0, d));
    for (int64_t part = 0; part < 2; ++part) {  // k, then v
      const torch::Tensor rows = from.narrow(0, d + part * kv * hd, kv * hd).view({kv, hd, d});
      item.value().narrow(0, d + part * d, d).copy_(rows.repeat_interleave(g, 0).reshape({d, d}));
    }
  }
  return mha;
}

}  // namespace

TEST(Gqa, ForwardEqualsTheExpandedMhaForwardAndGradientsSumOverEachGroup) {
  // Grouped-query attention (n_kv_heads 2 of 4 heads) against the MHA model whose K/V heads are copies: the same
  // logits (fp32, 1e-6: the same products, K/V repeated before the same kernel), and the GQA model's K/V rows get
  // the sum of their group's MHA gradients (repeat_interleave's backward).
  for (const char* impl : {"tiled", "reference"}) {
    SCOPED_TRACE(impl);
    torch::manual_seed(60);
    ModelConfig cfg = tiny_config();
    cfg.n_kv_heads = 2;
    AttentionConfig attn;
    attn.impl = impl;
    Transformer gqa(cfg, attn);
    EXPECT_EQ(gqa->blocks->ptr<BlockImpl>(0)->wqkv->weight.size(0), 32 + 2 * 2 * 8);  // d + 2 kv_heads x head_dim
    Transformer mha = expanded_twin(gqa, cfg, attn);
    torch::manual_seed(61);
    const PackedBatch batch = random_batch({9, 17, 4});
    const torch::Tensor a = gqa->forward(batch), b = mha->forward(batch);
    EXPECT_LT((a - b).abs().max().item<double>(), 1e-6);
    gqa->loss_sum(batch).backward();
    mha->loss_sum(batch).backward();
    auto gg = gqa->named_parameters(), mg = mha->named_parameters();
    const int64_t d = 32, hd = 8;
    for (int64_t layer = 0; layer < cfg.n_layers; ++layer) {
      const std::string key = "blocks." + std::to_string(layer) + ".wqkv.weight";
      const torch::Tensor g_gqa = gg[key].grad(), g_mha = mg[key].grad();
      EXPECT_TRUE(torch::allclose(g_gqa.narrow(0, 0, d), g_mha.narrow(0, 0, d), 1e-4, 1e-6)) << key << " q";
      for (int64_t part = 0; part < 2; ++part) {
        const torch::Tensor summed = g_mha.narrow(0, d + part * d, d).view({2, 2, hd, d}).sum(1).reshape({2 * hd, d});
        EXPECT_TRUE(torch::allclose(g_gqa.narrow(0, d + part * 2 * hd, 2 * hd), summed, 1e-4, 1e-6))
            << key << (part == 0 ? " k" : " v");
      }
      const std::string wo = "blocks." + std::to_string(layer) + ".wo.weight";
      EXPECT_TRUE(torch::allclose(gg[wo].grad(), mg[wo].grad(), 1e-4, 1e-6)) << wo;
    }
  }
}

TEST(Gqa, KvHeadsMustDivideTheHeadsAndDefaultToThem) {
  ModelConfig cfg = tiny_config();
  EXPECT_EQ(cfg.kv_heads(), 4);  // 0 = n_heads: every checkpoint without the key keeps its shapes
  EXPECT_EQ(Transformer(cfg)->blocks->ptr<BlockImpl>(0)->wqkv->weight.size(0), 3 * 32);
  cfg.n_kv_heads = 3;
  EXPECT_THROW(Transformer{cfg}, std::invalid_argument);
  cfg.n_kv_heads = 1;  // multi-query attention
  EXPECT_EQ(Transformer(cfg)->blocks->ptr<BlockImpl>(0)->wqkv->weight.size(0), 32 + 2 * 8);
  AttentionConfig flex;
  flex.backend = "flexformer";
  cfg.n_kv_heads = 2;
  EXPECT_THROW(Transformer(cfg, flex), std::invalid_argument);
}

// weights_in (src/model/weight_cast.h): inside a CastWeightsScope with gradients off a cast is made once and given
// again while the weights stay as they are; any change the version counter sees (an in-place update, new data)
// makes a fresh one; with gradients on, or outside the scope, it casts every time inside autograd.
TEST(WeightCast, KeptWhileTheWeightsStayAndRemadeWhenTheyChange) {
  torch::manual_seed(3);
  auto w = torch::randn({8, 4}), u = torch::randn({6, 4});
  torch::NoGradGuard no_grad;
  {
    const CastWeightsScope scope;
    const torch::Tensor a = weights_in({w}, torch::kBFloat16), b = weights_in({w}, torch::kBFloat16);
    EXPECT_EQ(a.data_ptr(), b.data_ptr());                     // kept
    EXPECT_TRUE(torch::equal(a, w.to(torch::kBFloat16)));      // the same bits as a cast
    const torch::Tensor wu = weights_in({w, u}, torch::kBFloat16);
    EXPECT_TRUE(torch::equal(wu, torch::cat({w, u}).to(torch::kBFloat16)));
    EXPECT_EQ(weights_in({w, u}, torch::kBFloat16).data_ptr(), wu.data_ptr());
    EXPECT_EQ(weights_in({w}, torch::kFloat).data_ptr(), w.data_ptr());  // no cast needed: the weight itself
    w.add_(1.0);                                                // an optimizer step, in place
    const torch::Tensor c = weights_in({w}, torch::kBFloat16);
    EXPECT_TRUE(torch::equal(c, w.to(torch::kBFloat16)));
    EXPECT_FALSE(torch::equal(c, a));
    u.mul_(2.0);                                                // the second part of a concatenation
    EXPECT_TRUE(torch::equal(weights_in({w, u}, torch::kBFloat16), torch::cat({w, u}).to(torch::kBFloat16)));
    w.set_data(torch::randn({8, 4}));                           // new storage (as a checkpoint load may give)
    EXPECT_TRUE(torch::equal(weights_in({w}, torch::kBFloat16), w.to(torch::kBFloat16)));
  }
  // Outside a scope: a fresh cast every call.
  EXPECT_NE(weights_in({w}, torch::kBFloat16).data_ptr(), weights_in({w}, torch::kBFloat16).data_ptr());
}

TEST(WeightCast, GradientsStillReachTheFp32WeightsInsideAScope) {
  auto w = torch::randn({5, 3}).requires_grad_(true);
  const CastWeightsScope scope;
  const torch::Tensor x = torch::randn({2, 3}).to(torch::kBFloat16);
  torch::linear(x, weights_in({w}, torch::kBFloat16)).to(torch::kFloat).sum().backward();
  ASSERT_TRUE(w.grad().defined());
  EXPECT_GT(w.grad().abs().sum().item<double>(), 0);
}

// A bf16 model's logits under the scope equal those without it, before and after its weights change in place, and
// the casts go with the model.
TEST(WeightCast, ModelLogitsEqualUncachedOnesAndTheCastsGoWithTheModel) {
  torch::manual_seed(11);
  const size_t before = kept_weight_casts();
  {
    Transformer model(tiny_config(), AttentionConfig{}, Precision::kBf16);
    const PackedBatch batch = random_batch({7, 3});
    torch::NoGradGuard no_grad;
    for (int round = 0; round < 2; ++round) {
      const torch::Tensor plain = model->forward(batch);
      torch::Tensor kept, again;
      {
        const CastWeightsScope scope;
        kept = model->forward(batch);
        again = model->forward(batch);
      }
      EXPECT_TRUE(torch::equal(kept, plain)) << "round " << round;
      EXPECT_TRUE(torch::equal(again, plain)) << "round " << round;
      for (auto& p : model->parameters()) p.mul_(1.25);  // every weight changes in place
    }
    EXPECT_GT(kept_weight_casts(), before);
  }
  EXPECT_EQ(kept_weight_casts(), before);
}
