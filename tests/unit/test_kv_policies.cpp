// KV-cache compression policies: what each keeps on small hand-checkable caches, the recorded observations,
// budget 1 equal to the full cache bit for bit over a decode, the leave-one-out identity, released memory, and
// every option of make_kv_policy checked.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "dcp/config.h"
#include "dcp/infer.h"
#include "dcp/kv_cache.h"
#include "dcp/kv_observations.h"
#include "dcp/kv_policies.h"
#include "infer/kv/policies/adakv.h"
#include "infer/kv/policies/scored.h"
#include "infer/kv/policies/tova.h"
#include "unit/error_of.h"
#include "unit/kv_test_model.h"

using namespace dcp;
using dcp::test::error_of;
using dcp::test::random_tokens;
using dcp::test::session_logits;
using dcp::test::sharp_model;

namespace {

KvCacheSpec spec(int64_t layers = 1, int64_t heads = 2, int64_t dim = 4, torch::ScalarType dtype = torch::kFloat) {
  KvCacheSpec s;
  s.layers = layers;
  s.kv_heads = heads;
  s.head_dim = dim;
  s.dtype = dtype;
  return s;
}

// A cache of n random entries at positions 0..n-1 in every layer.
KvCache random_cache(const KvCacheSpec& s, int64_t n, uint64_t seed) {
  torch::manual_seed(seed);
  KvCache cache(s);
  for (int64_t layer = 0; layer < s.layers; ++layer) {
    cache.append(layer, torch::randn({n, s.kv_heads, s.head_dim}).to(s.dtype),
                 torch::randn({n, s.kv_heads, s.value_dim > 0 ? s.value_dim : s.head_dim}).to(s.dtype),
                 torch::arange(n, torch::kInt64));
  }
  return cache;
}

std::vector<int64_t> positions_of(const KvCache& cache, int64_t layer, int64_t head) {
  const torch::Tensor p = cache.view(layer, head).positions;
  return std::vector<int64_t>(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + p.numel());
}

// Indices of the k largest of `s`, ascending.
std::vector<int64_t> top(const torch::Tensor& s, int64_t k) {
  torch::Tensor i = std::get<0>(torch::sort(std::get<1>(torch::topk(s, k))));
  return std::vector<int64_t>(i.data_ptr<int64_t>(), i.data_ptr<int64_t>() + k);
}

const KvStep kPrefill{true, 0, 0, nullptr};

const std::vector<std::string> kPolicies = {"window", "h2o", "snapkv", "tova", "expected-attention",
                                            "adakv-h2o", "adakv-snapkv", "adakv-tova", "adakv-expected-attention"};

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// Identities over a decode

TEST(KvPolicies, BudgetOneIsBitIdenticalToFullForEveryPolicy) {
  Transformer model = sharp_model(1);
  const auto tokens = random_tokens(90, 2);
  const torch::Tensor full = session_logits(model, tokens, 50, make_kv_policy("full"));
  for (const auto& name : kPolicies) {
    const torch::Tensor got = session_logits(model, tokens, 50, make_kv_policy(name, {{"budget", 1.0}, {"interval", 1}}));
    EXPECT_TRUE(torch::equal(got, full)) << name;
  }
}

TEST(KvPolicies, CompressedDecodeStaysWithinBudgetAndChangesTheLogits) {
  Transformer model = sharp_model(3);
  const auto tokens = random_tokens(90, 4);
  const torch::Tensor full = session_logits(model, tokens, 50, nullptr);
  for (const auto& name : kPolicies) {
    auto policy = make_kv_policy(name, {{"budget", 0.5}, {"interval", 1}});
    DecodeSession session(model, 16, policy);
    session.prefill(std::vector<int64_t>(tokens.begin(), tokens.begin() + 50));
    const int64_t heads = session.cache().spec().kv_heads;
    for (int64_t layer = 0; layer < session.cache().spec().layers; ++layer) {
      int64_t total = 0;
      for (int64_t h = 0; h < heads; ++h) total += session.cache().length(layer, h);
      // 25 per head (ceil(0.5 * 50)); protected entries (4 sinks, 13 recent, a 64-query window) fit in it except
      // snapkv's window, which protects all 50 here.
      const int64_t limit = name.find("snapkv") != std::string::npos ? 50 : 25;
      EXPECT_LE(total, heads * limit) << name << " layer " << layer;
      if (name.find("adakv") == std::string::npos) {
        for (int64_t h = 0; h < heads; ++h) EXPECT_LE(session.cache().length(layer, h), limit) << name;
      }
    }
    const torch::Tensor got = session_logits(model, tokens, 50, make_kv_policy(name, {{"budget", 0.5}, {"interval", 1}}));
    EXPECT_GT((got - full).abs().max().item<double>(), 1e-4) << name << ": evicting half the cache changed nothing";
  }
}

TEST(KvPolicies, NothingChangesWhenEveryHeadFitsItsBudget) {
  KvCache cache = random_cache(spec(2, 2), 20, 5);
  auto policy = make_kv_policy("window", {{"budget", 0.5}});
  policy->after_step(cache, kPrefill);
  const KvHeadView before = cache.view(1, 1);
  const int64_t bytes = cache.bytes();
  policy->after_step(cache, kPrefill);  // 10 entries per head, budget ceil(0.5 * 20) = 10: nothing to drop
  EXPECT_EQ(cache.bytes(), bytes);
  EXPECT_TRUE(torch::equal(cache.view(1, 1).keys, before.keys));
  EXPECT_TRUE(cache.view(1, 1).keys.data_ptr() == before.keys.data_ptr());  // not even reallocated
}

TEST(KvPolicies, LeaveOneOutIdentity) {
  // Evicting entry j with softmax weight p_j moves the output by p_j / (1 - p_j) * (o - v_j): o is a weighted
  // mean, and removing one term renormalises the others.
  KvCache cache = random_cache(spec(1, 2, 8, torch::kDouble), 12, 6);
  torch::manual_seed(7);
  const torch::Tensor q = torch::randn({1, 2, 8}, torch::kDouble) * 2, k = torch::randn({1, 2, 8}, torch::kDouble),
                      v = torch::randn({1, 2, 8}, torch::kDouble);
  const torch::Tensor o = kv_cache_attention(q, k, v, cache, 0).out[0];  // [heads, d]
  const int64_t j = 5;
  const double scale = 1.0 / std::sqrt(8.0);
  std::vector<torch::Tensor> p_j, v_j;
  for (int64_t h = 0; h < 2; ++h) {
    const KvHeadView view = cache.view(0, h);
    const torch::Tensor keys = torch::cat({view.keys, k.select(1, h)});  // the query sees the cache and itself
    const torch::Tensor p = torch::softmax(scale * torch::matmul(keys, q[0][h]), 0);
    p_j.push_back(p[j]);
    v_j.push_back(view.values[j]);
  }
  std::vector<int64_t> keep;
  for (int64_t i = 0; i < 12; ++i) if (i != j) keep.push_back(i);
  cache.commit(0, {KvHeadEdit{torch::tensor(keep)}, KvHeadEdit{torch::tensor(keep)}});
  const torch::Tensor o_evicted = kv_cache_attention(q, k, v, cache, 0).out[0];
  for (int64_t h = 0; h < 2; ++h) {
    const torch::Tensor predicted = p_j[h] / (1 - p_j[h]) * (o[h] - v_j[h]);
    EXPECT_LT((o_evicted[h] - o[h] - predicted).abs().max().item<double>(), 1e-12) << "head " << h;
    EXPECT_GT(predicted.abs().max().item<double>(), 1e-6);  // the eviction did change the output
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Observations

TEST(KvObservations, RecordOnlyWhatThePolicyNeeds) {
  struct Probe : KvPolicy {
    KvObservationNeeds wanted;
    std::vector<const KvObservations*> seen;
    void after_step(KvCache&, const KvStep& step) override { seen.push_back(step.observations); }
    KvObservationNeeds needs() const override { return wanted; }
  };
  Transformer model = sharp_model(8);
  const auto tokens = random_tokens(40, 9);
  auto none = std::make_shared<Probe>();
  DecodeSession plain(model, 16, none);
  plain.prefill(tokens);
  ASSERT_EQ(none->seen.size(), 3u);
  EXPECT_EQ(none->seen[0], nullptr);
  EXPECT_EQ(make_kv_policy("full")->needs().any(), false);
  EXPECT_EQ(make_kv_policy("window")->needs().any(), false);

  auto probe = std::make_shared<Probe>();
  probe->wanted = {24, true};
  DecodeSession session(model, 16, probe);
  session.prefill(tokens);
  session.decode(5);
  const KvObservations* obs = probe->seen.back();
  ASSERT_NE(obs, nullptr);
  EXPECT_EQ(obs->window_queries(2).sizes().vec(), (std::vector<int64_t>{4, 24, 16}));
  EXPECT_TRUE(torch::equal(obs->window_positions(2), torch::arange(17, 41, torch::kInt64)));
  EXPECT_DOUBLE_EQ(obs->scale(), 0.25);
  for (int64_t h = 0; h < 4; ++h) {
    // Nothing evicted: every one of the 41 queries spread probability 1 over the entries.
    EXPECT_NEAR(obs->accumulated_attention(session.cache(), 1, h).sum().item<double>(), 41.0, 1e-4);
    EXPECT_NEAR(obs->last_attention(session.cache(), 1, h).sum().item<double>(), 1.0, 1e-5);
    EXPECT_EQ(obs->last_attention(session.cache(), 1, h).numel(), 41);
  }
}

TEST(KvObservations, AttentionMatchesAHandComputedSoftmaxAndFollowsCommits) {
  KvCache cache = random_cache(spec(1, 1, 4), 6, 10);
  KvObservations obs(1, 1, {0, true});
  torch::manual_seed(11);
  const torch::Tensor q = torch::randn({2, 1, 4});
  const torch::Tensor pos = torch::tensor({4, 5}, torch::kInt64);  // the chunk: the cache's last two entries
  obs.observe(0, q, pos, cache, 0.5);
  const KvHeadView view = cache.view(0, 0);
  const torch::Tensor p4 = torch::softmax(0.5 * torch::matmul(view.keys.narrow(0, 0, 5), q[0][0]), 0);
  const torch::Tensor p5 = torch::softmax(0.5 * torch::matmul(view.keys, q[1][0]), 0);
  const torch::Tensor expected = torch::cat({p4, torch::zeros({1})}) + p5;
  EXPECT_TRUE(torch::allclose(obs.accumulated_attention(cache, 0, 0), expected, 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(obs.last_attention(cache, 0, 0), p5, 1e-5, 1e-6));
  cache.commit(0, {KvHeadEdit{torch::tensor({0, 2, 5}, torch::kInt64)}});
  EXPECT_TRUE(torch::allclose(obs.accumulated_attention(cache, 0, 0),
                              expected.index_select(0, torch::tensor({0, 2, 5}, torch::kInt64)), 1e-5, 1e-6));
  EXPECT_NE(error_of([&] { KvObservations(1, 1, {4, false}).accumulated_attention(cache, 0, 0); }), "");
}

// ---------------------------------------------------------------------------------------------------------------
// What each policy keeps

TEST(KvPolicies, WindowKeepsTheSinksAndTheMostRecentAndReleasesMemory) {
  KvCache cache = random_cache(spec(2, 2), 20, 12);
  const int64_t bytes = cache.bytes(), capacity = cache.capacity_bytes();
  make_kv_policy("window", {{"budget", 0.5}, {"n_sink", 4}})->after_step(cache, kPrefill);
  for (int64_t layer = 0; layer < 2; ++layer) {
    for (int64_t h = 0; h < 2; ++h) {
      EXPECT_EQ(positions_of(cache, layer, h), (std::vector<int64_t>{0, 1, 2, 3, 14, 15, 16, 17, 18, 19}));
    }
  }
  EXPECT_EQ(cache.bytes(), bytes / 2);
  EXPECT_EQ(cache.capacity_bytes(), cache.bytes());
  EXPECT_LT(cache.capacity_bytes(), capacity);
  // Sinks are kept even over the budget: 4 sinks in a budget of ceil(0.1 * 20) = 2.
  make_kv_policy("window", {{"budget", 0.1}})->after_step(cache, kPrefill);
  EXPECT_EQ(positions_of(cache, 0, 0), (std::vector<int64_t>{0, 1, 2, 3}));
}

TEST(KvPolicies, WindowDecodesEveryIntervalTokens) {
  KvCache cache = random_cache(spec(1, 1), 20, 13);
  auto policy = make_kv_policy("window", {{"budget", 0.5}, {"interval", 4}, {"n_sink", 0}});
  policy->after_step(cache, KvStep{false, 18, 1, nullptr});  // next position 19: not a multiple of 4
  EXPECT_EQ(cache.length(0, 0), 20);
  policy->after_step(cache, KvStep{false, 19, 1, nullptr});  // next position 20
  EXPECT_EQ(positions_of(cache, 0, 0), (std::vector<int64_t>{10, 11, 12, 13, 14, 15, 16, 17, 18, 19}));
}

TEST(KvPolicies, H2oKeepsTheHeaviestAccumulatedAttentionAndTheRecentWindow) {
  KvCache cache = random_cache(spec(1, 2, 4), 20, 14);
  KvObservations obs(1, 2, {0, true});
  torch::manual_seed(15);
  obs.observe(0, torch::randn({8, 2, 4}) * 3, torch::arange(12, 20, torch::kInt64), cache, 0.5);
  const KvStep step{true, 12, 8, &obs};
  std::vector<torch::Tensor> acc{obs.accumulated_attention(cache, 0, 0), obs.accumulated_attention(cache, 0, 1)};
  // Budget ceil(0.4 * 20) = 8: the recent ceil(0.5 * 8) = 4 (positions 16..19), plus the 4 heaviest of 0..15.
  make_kv_policy("h2o", {{"budget", 0.4}})->after_step(cache, step);
  for (int64_t h = 0; h < 2; ++h) {
    std::vector<int64_t> expected = top(acc[h].narrow(0, 0, 16), 4);
    for (int64_t p = 16; p < 20; ++p) expected.push_back(p);
    EXPECT_EQ(positions_of(cache, 0, h), expected) << "head " << h;
  }
}

TEST(KvPolicies, SnapKvKeepsPooledNeighboursOfWhatTheWindowAttendsTo) {
  KvCache cache(spec(1, 1, 4));
  torch::Tensor keys = torch::randn({20, 1, 4}) * 0.01;
  keys[5][0][0] = 20.0;  // the only key the window query matches
  cache.append(0, keys, torch::randn({20, 1, 4}), torch::arange(20, torch::kInt64));
  KvObservations obs(1, 1, {1, false});
  obs.observe(0, torch::tensor({1.0f, 0.0f, 0.0f, 0.0f}).view({1, 1, 4}), torch::tensor({19}, torch::kInt64), cache, 1.0);
  // Budget ceil(0.2 * 20) = 4: the window's own entry 19 and entry 5 with its kernel-3 neighbours 4 and 6.
  make_kv_policy("snapkv", {{"budget", 0.2}, {"window", 1}, {"kernel", 3}})->after_step(cache, KvStep{true, 19, 1, &obs});
  EXPECT_EQ(positions_of(cache, 0, 0), (std::vector<int64_t>{4, 5, 6, 19}));
}

TEST(KvPolicies, TovaDropsTheArgminOfTheLatestQuery) {
  KvCache cache = random_cache(spec(1, 2, 4), 16, 16);
  KvObservations obs(1, 2, {0, true});
  torch::manual_seed(17);
  obs.observe(0, torch::randn({1, 2, 4}) * 3, torch::tensor({15}, torch::kInt64), cache, 0.5);
  std::vector<int64_t> argmin;
  for (int64_t h = 0; h < 2; ++h) argmin.push_back(obs.last_attention(cache, 0, h).argmin().item<int64_t>());
  make_kv_policy("tova", {{"budget", 15.0 / 16.0}})->after_step(cache, KvStep{false, 15, 1, &obs});  // 15 of 16
  for (int64_t h = 0; h < 2; ++h) {
    std::vector<int64_t> expected;
    for (int64_t i = 0; i < 16; ++i) if (i != argmin[h]) expected.push_back(i);
    EXPECT_EQ(positions_of(cache, 0, h), expected) << "head " << h;
  }
}

TEST(KvPolicies, ExpectedAttentionRanksByTheGaussianClosedForm) {
  KvCache cache = random_cache(spec(1, 2, 4), 24, 18);
  KvObservations obs(1, 2, {8, false});
  torch::manual_seed(19);
  const torch::Tensor q = torch::randn({8, 2, 4}) * 2 + 1;
  obs.observe(0, q, torch::arange(16, 24, torch::kInt64), cache, 0.5);
  std::vector<std::vector<int64_t>> expected;
  for (int64_t h = 0; h < 2; ++h) {
    // Per entry log E[exp(0.5 q.k)] = 0.5 mu.k + 0.125 k^T Sigma k (ML covariance), in fp64.
    const torch::Tensor qh = q.select(1, h).to(torch::kDouble), k = cache.view(0, h).keys.to(torch::kDouble);
    const torch::Tensor mu = qh.mean(0), c = qh - mu, sigma = torch::matmul(c.t(), c) / 8.0;
    const torch::Tensor log_e = 0.5 * torch::matmul(k, mu) + 0.125 * (torch::matmul(k, sigma) * k).sum(1);
    std::vector<int64_t> e{0, 1};  // two sinks
    for (int64_t i : top(log_e.narrow(0, 2, 22), 4)) e.push_back(i + 2);
    expected.push_back(e);
  }
  make_kv_policy("expected-attention", {{"budget", 0.25}, {"window", 8}, {"n_sink", 2}})
      ->after_step(cache, KvStep{true, 16, 8, &obs});
  for (int64_t h = 0; h < 2; ++h) EXPECT_EQ(positions_of(cache, 0, h), expected[h]) << "head " << h;
}

TEST(KvPolicies, AdaKvGivesConcentratedHeadsFewerEntriesButNeverBelowTheFloor) {
  // Head 0's attention is on one entry, head 1's spread evenly.
  struct Fixed : KvScorer {
    torch::Tensor score(const KvCache&, const KvObservations*, int64_t, int64_t head, int64_t) const override {
      if (head == 0) {
        torch::Tensor s = torch::full({20}, 0.001f);
        s[7] = 0.9f;
        return s;
      }
      return torch::full({20}, 0.05f) + torch::arange(20, torch::kFloat) * 1e-4;
    }
  };
  KvCache cache = random_cache(spec(1, 2, 4), 20, 20);
  const int64_t bytes = cache.bytes();
  // Budget 2 x ceil(0.5 * 20) = 20 for the layer; floor(0.2 * 10) = 2 per head.
  AdaKvPolicy(std::make_shared<Fixed>(), KvBudget{0.5, 1}, 0.2).after_step(cache, kPrefill);
  const std::vector<int64_t> head0 = positions_of(cache, 0, 0);
  EXPECT_EQ(head0.size(), 2u);  // the floor: its peak and one of its ties
  EXPECT_NE(std::find(head0.begin(), head0.end(), 7), head0.end());
  EXPECT_EQ(positions_of(cache, 0, 1), (std::vector<int64_t>{2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19}));
  EXPECT_EQ(cache.bytes(), bytes / 2);
  // Uniform allocation for the same scores: 10 each.
  KvCache uniform = random_cache(spec(1, 2, 4), 20, 20);
  ScoredKvPolicy(std::make_shared<Fixed>(), KvBudget{0.5, 1}).after_step(uniform, kPrefill);
  EXPECT_EQ(uniform.length(0, 0), 10);
  EXPECT_EQ(uniform.length(0, 1), 10);
}

// ---------------------------------------------------------------------------------------------------------------
// Options

TEST(KvPolicies, MakeKvPolicyChecksNamesAndOptions) {
  EXPECT_NE(error_of([] { make_kv_policy("lru"); }).find("unknown policy 'lru'; valid: full, window, h2o"), std::string::npos);
  EXPECT_NE(error_of([] { make_kv_policy("adakv-lru"); }).find("unknown policy 'adakv-lru'"), std::string::npos);
  EXPECT_NE(error_of([] { make_kv_policy("adakv-window"); }).find("window scores do not compare"), std::string::npos);
  EXPECT_NE(error_of([] { make_kv_policy("full", {{"budget", 0.5}}); }).find("full has no option 'budget'"), std::string::npos);
  EXPECT_NE(error_of([] { make_kv_policy("tova", {{"window", 8}}); }).find("tova has no option 'window' (value 8); its options: budget, interval"),
            std::string::npos);
  EXPECT_NE(error_of([] { make_kv_policy("snapkv", {{"n_sink", 8}}); }).find("its options: window, kernel, budget, interval"),
            std::string::npos);
  EXPECT_NE(error_of([] { make_kv_policy("window", {{"alpha_safeguard", 0.2}}); }).find("no option 'alpha_safeguard'"),
            std::string::npos);
  struct Bad {
    std::string policy, key;
    double value;
    std::string message;
  };
  for (const Bad& b : std::vector<Bad>{{"window", "budget", 0.0, "budget = 0 outside (0, 1]"},
                                       {"h2o", "budget", 1.5, "budget = 1.5 outside (0, 1]"},
                                       {"tova", "budget", std::nan(""), "budget = nan outside"},
                                       {"window", "interval", 0, "interval = 0 outside [1"},
                                       {"h2o", "interval", 2.5, "interval = 2.5 is not an integer"},
                                       {"window", "n_sink", -1, "n_sink = -1 outside [0"},
                                       {"h2o", "recent_fraction", 1.5, "recent_fraction = 1.5 outside [0, 1]"},
                                       {"snapkv", "window", 0, "window = 0 outside [1"},
                                       {"snapkv", "kernel", 4, "kernel = 4 must be odd"},
                                       {"expected-attention", "window", 0, "window = 0 outside [1"},
                                       {"adakv-snapkv", "alpha_safeguard", 1.5, "alpha_safeguard = 1.5 outside [0, 1]"}}) {
    const std::string e = error_of([&] { make_kv_policy(b.policy, {{b.key, b.value}}); });
    EXPECT_NE(e.find(b.policy + ": " + b.message), std::string::npos) << b.policy << " " << b.key << ": " << e;
  }
  for (const auto& name : kPolicies) EXPECT_NE(make_kv_policy(name), nullptr) << name;  // every default is valid
  EXPECT_NE(error_of([] { ScoredKvPolicy(nullptr, KvBudget{}); }).find("scorer is null"), std::string::npos);
  EXPECT_NE(error_of([] { AdaKvPolicy(std::make_shared<TovaScorer>(), KvBudget{0.5, 0}, 0.2); }).find("interval 0"),
            std::string::npos);
}

TEST(KvPolicies, MaxTokensCapsEveryHeadAndBudgetsReadAsFractionOrTokens) {
  KvCache cache = random_cache(spec(1, 2), 40, 11);
  make_kv_policy("window", {{"budget", 0.5}, {"max_tokens", 7}})->after_step(cache, kPrefill);
  EXPECT_EQ(cache.length(0, 0), 7);  // min(ceil(0.5 * 40), 7)
  KvCache by_tokens = random_cache(spec(1, 2), 40, 11);
  make_kv_policy_with_budget("window", 12)->after_step(by_tokens, kPrefill);
  EXPECT_EQ(by_tokens.length(0, 1), 12);
  KvCache by_fraction = random_cache(spec(1, 2), 40, 11);
  make_kv_policy_with_budget("window", 0.25)->after_step(by_fraction, kPrefill);
  EXPECT_EQ(by_fraction.length(0, 1), 10);
  EXPECT_NE(make_kv_policy_with_budget("full", 1), nullptr);
  for (double bad : {0.0, 1.5, -3.0, 2.5, std::nan("")}) {
    EXPECT_NE(error_of([&] { make_kv_policy_with_budget("window", bad); }).find("must be a fraction in (0, 1]"),
              std::string::npos) << bad;
  }
  EXPECT_NE(error_of([] { make_kv_policy_with_budget("full", 0.5); }).find("needs another policy"), std::string::npos);
  // The budget is the budget argument's, never an option that it would silently override.
  EXPECT_NE(error_of([] { make_kv_policy_with_budget("window", 0.5, {{"budget", 0.1}}); }).find("set by the budget"),
            std::string::npos);
  EXPECT_NE(error_of([] { make_kv_policy_with_budget("window", 40, {{"max_tokens", 5}}); }).find("set by the budget"),
            std::string::npos);
  EXPECT_NE(error_of([] { make_kv_policy("minimax", {{"samples", 1e8}}); }).find(", 65536]"), std::string::npos);
  EXPECT_NE(error_of([] { make_kv_policy("window", {{"max_tokens", -1}}); }).find("max_tokens = -1 outside [0"),
            std::string::npos);
}
