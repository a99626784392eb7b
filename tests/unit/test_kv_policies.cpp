// KV-cache compression policies: what each keeps on small hand-checkable caches, the recorded observations,
// budget 1 equal to the full cache bit for bit over a decode, the leave-one-out identity, released memory, and
// every option of make_kv_policy checked.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
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

const std::vector<std::string> kPolicies = {"window", "h2o", "snapkv", "tova", "expected-attention", "keydiff",
                                            "adakv-h2o", "adakv-snapkv", "adakv-tova", "adakv-expected-attention",
                                            "adakv-keydiff"};

// R(t) of the rotary at position t for head_dim d (theta 10000), by its definition: dimension i and i + d/2 rotate
// by t * theta^(-2i/d). [d, d] fp64, so that R(t) x is the rotated x.
torch::Tensor rotation(int64_t d, int64_t t, double theta = 10000.0) {
  torch::Tensor r = torch::zeros({d, d}, torch::kDouble);
  for (int64_t i = 0; i < d / 2; ++i) {
    const double a = static_cast<double>(t) * std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(d));
    r[i][i] = std::cos(a);
    r[i][i + d / 2] = -std::sin(a);
    r[i + d / 2][i] = std::sin(a);
    r[i + d / 2][i + d / 2] = std::cos(a);
  }
  return r;
}

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
      // 25 per head (ceil(0.5 * 50)); protected entries (4 sinks, 13 recent, the newest) fit in it, and snapkv's
      // 64-query window ranks first but inside the budget.
      const int64_t limit = 25;
      EXPECT_LE(total, heads * limit) << name << " layer " << layer;
      if (name.find("adakv") == std::string::npos) {
        for (int64_t h = 0; h < heads; ++h) EXPECT_LE(session.cache().length(layer, h), limit) << name;
      }
    }
    const torch::Tensor got = session_logits(model, tokens, 50, make_kv_policy(name, {{"budget", 0.5}, {"interval", 1}}));
    EXPECT_GT((got - full).abs().max().item<double>(), 1e-4) << name << ": evicting half the cache changed nothing";
  }
}

// What each policy keeps whatever its budget (the serve reservation's floor), from its definition: sinks for window
// and expected-attention, the newest entry for tova, nothing beyond the budget for h2o's recent share, snapkv's
// window and keydiff, minimax's sinks and max(64, recent_tokens).
TEST(KvPolicies, ProtectedEntriesAreWhatEachDefinitionKeepsWhateverTheBudget) {
  const std::vector<std::tuple<std::string, KvPolicyOptions, int64_t>> cases{
      {"full", {}, 0},
      {"window", {}, 4},
      {"window", {{"n_sink", 9}}, 9},
      {"h2o", {}, 0},
      {"snapkv", {{"window", 200}}, 0},
      {"tova", {}, 1},
      {"expected-attention", {{"n_sink", 7}}, 7},
      {"keydiff", {}, 0},
      {"adakv-snapkv", {}, 0},
      {"adakv-tova", {}, 1},
      {"adakv-expected-attention", {}, 4},
      {"minimax", {}, 4 + 64},
      {"minimax", {{"recent_tokens", 100}, {"n_sink", 2}}, 2 + 100}};
  for (const auto& [name, options, expected] : cases) {
    EXPECT_EQ(make_kv_policy(name, options)->protected_entries(), expected) << name << " " << options.size();
  }
}

// KvPolicy::budget() is what make_kv_policy_with_budget built: a fraction as the ratio, a count >= 2 as max_tokens
// at ratio 1, the interval option; none for full.
TEST(KvPolicies, BudgetIsWhatTheFactoryBuilt) {
  EXPECT_FALSE(make_kv_policy_with_budget("full", 1.0, {})->budget().has_value());
  const std::vector<std::tuple<std::string, double, KvPolicyOptions, KvBudget>> cases{
      {"window", 0.25, {}, {0.25, kKvDefaultInterval, 0}},
      {"snapkv", 0.5, {{"interval", 32}}, {0.5, 32, 0}},
      {"adakv-tova", 300, {}, {1.0, kKvDefaultInterval, 300}},
      {"minimax", 0.1, {{"interval", 7}}, {0.1, 7, 0}},
      {"minimax", 40, {}, {1.0, kKvDefaultInterval, 40}}};
  // Every compressing policy reports one (a policy without it would reserve serve memory like full).
  for (const std::string& name : kv_policy_names()) {
    if (name != "full") EXPECT_TRUE(make_kv_policy_with_budget(name, 0.5, {})->budget().has_value()) << name;
  }
  for (const auto& [name, budget, options, expected] : cases) {
    const std::optional<KvBudget> b = make_kv_policy_with_budget(name, budget, options)->budget();
    ASSERT_TRUE(b.has_value()) << name;
    EXPECT_EQ(b->ratio, expected.ratio) << name << "@" << budget;
    EXPECT_EQ(b->interval, expected.interval) << name << "@" << budget;
    EXPECT_EQ(b->max_tokens, expected.max_tokens) << name << "@" << budget;
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
  // Budget ceil(0.2 * 20) = 4: the window's own entry 19 and entry 5 with its kernel-3 neighbours 4 and 6 (the
  // average pool gives all three about a third of entry 5's attention, far above the rest).
  make_kv_policy("snapkv", {{"budget", 0.2}, {"window", 1}, {"kernel", 3}})->after_step(cache, KvStep{true, 19, 1, &obs});
  EXPECT_EQ(positions_of(cache, 0, 0), (std::vector<int64_t>{4, 5, 6, 19}));
}

TEST(KvPolicies, TovaDropsTheArgminOfTheLatestQueryAveragedOverHeadsAndKeepsTheNewest) {
  KvCache cache = random_cache(spec(1, 2, 4), 16, 16);
  KvObservations obs(1, 2, {0, true});
  torch::manual_seed(17);
  const torch::Tensor q = torch::randn({1, 2, 4}) * 3;
  obs.observe(0, q, torch::tensor({15}, torch::kInt64), cache, 0.5);
  // By hand: the latest query's softmax per head, then their mean over the layer's heads (kvpress TOVAPress).
  torch::Tensor mean = torch::zeros({16}, torch::kDouble);
  for (int64_t h = 0; h < 2; ++h) {
    mean += torch::softmax(0.5 * torch::matmul(cache.view(0, h).keys.to(torch::kDouble), q[0][h].to(torch::kDouble)), 0);
  }
  const int64_t argmin = (mean / 2).narrow(0, 0, 15).argmin().item<int64_t>();
  // 15 of 16 (a prefill step: compressed whatever the decoding schedule)
  make_kv_policy("tova", {{"budget", 15.0 / 16.0}})->after_step(cache, KvStep{true, 15, 1, &obs});
  std::vector<int64_t> expected;
  for (int64_t i = 0; i < 16; ++i) if (i != argmin) expected.push_back(i);
  for (int64_t h = 0; h < 2; ++h) EXPECT_EQ(positions_of(cache, 0, h), expected) << "head " << h;  // heads alike
  // The newest entry stays even when the latest query gives it the least attention: its key points away.
  KvCache away(spec(1, 1, 4));
  torch::Tensor keys = torch::randn({8, 1, 4}) * 0.1;
  keys[7][0][0] = -30.0f;
  away.append(0, keys, torch::randn({8, 1, 4}), torch::arange(8, torch::kInt64));
  KvObservations o2(1, 1, {0, true});
  o2.observe(0, torch::tensor({1.0f, 0.0f, 0.0f, 0.0f}).view({1, 1, 4}), torch::tensor({7}, torch::kInt64), away, 1.0);
  ASSERT_EQ(o2.last_attention(away, 0, 0).argmin().item<int64_t>(), 7);
  make_kv_policy("tova", {{"budget", 0.5}})->after_step(away, KvStep{true, 7, 1, &o2});
  EXPECT_EQ(positions_of(away, 0, 0).back(), 7);
  EXPECT_EQ(away.length(0, 0), 4);
}

TEST(KvPolicies, ExpectedAttentionUsesPreRotaryStatisticsTheMeanFutureRotationAndValueNorms) {
  // kvpress ExpectedAttentionPress, by hand: mean and covariance of the queries before rotary (positions >= n_sink),
  // the rotation averaged over the next n_future positions, softmax of s mu'.k + s^2/2 k^T Sigma' k over the
  // entries past the sinks, times ||v||.
  const int64_t d = 4, n = 24, sinks = 2, future = 3;
  KvCache cache = random_cache(spec(1, 2, d), n, 18);
  KvObservationNeeds needs;
  needs.query_stats = true;
  needs.query_stats_skip = sinks;
  KvObservations obs(1, 2, needs);
  torch::manual_seed(19);
  const torch::Tensor pre = torch::randn({n, 2, d}, torch::kDouble) * 2 + 1;  // the queries before rotary
  std::vector<torch::Tensor> rotated;
  for (int64_t t = 0; t < n; ++t) {
    rotated.push_back(torch::stack({torch::mv(rotation(d, t), pre[t][0]), torch::mv(rotation(d, t), pre[t][1])}));
  }
  const torch::Tensor post = torch::stack(rotated).to(torch::kFloat);  // what the model hands the cache
  obs.observe(0, post.narrow(0, 0, 10), torch::arange(0, 10, torch::kInt64), cache, 0.5);
  obs.observe(0, post.narrow(0, 10, n - 10), torch::arange(10, n, torch::kInt64), cache, 0.5);
  const KvQueryStats stats = obs.query_stats(0);
  ASSERT_EQ(stats.count, n - sinks);
  const torch::Tensor counted = pre.narrow(0, sinks, n - sinks);
  EXPECT_LT((stats.mean - counted.mean(0)).abs().max().item<double>(), 1e-5);
  torch::Tensor rbar = torch::zeros({d, d}, torch::kDouble);
  for (int64_t t = n; t < n + future; ++t) rbar += rotation(d, t) / static_cast<double>(future);
  std::vector<std::vector<int64_t>> expected;
  for (int64_t h = 0; h < 2; ++h) {
    const torch::Tensor qh = counted.select(1, h), mu = qh.mean(0), c = qh - mu;
    const torch::Tensor sigma = torch::matmul(c.t(), c) / static_cast<double>(n - sinks);
    EXPECT_LT((stats.cov[h] - sigma).abs().max().item<double>(), 1e-4);
    const torch::Tensor mu_r = torch::mv(rbar, mu), sigma_r = torch::matmul(torch::matmul(rbar, sigma), rbar.t());
    const torch::Tensor k = cache.view(0, h).keys.to(torch::kDouble).narrow(0, sinks, n - sinks);
    const torch::Tensor v = cache.view(0, h).values.to(torch::kDouble).narrow(0, sinks, n - sinks);
    const torch::Tensor log_e = 0.5 * torch::mv(k, mu_r) + 0.125 * (torch::matmul(k, sigma_r) * k).sum(1);
    const torch::Tensor score = torch::softmax(log_e, 0) * v.norm(2, 1);
    std::vector<int64_t> e{0, 1};  // the sinks
    for (int64_t i : top(score, 4)) e.push_back(i + sinks);
    expected.push_back(e);
  }
  make_kv_policy("expected-attention", {{"budget", 0.25}, {"n_sink", 2}, {"n_future_positions", 3}})
      ->after_step(cache, KvStep{true, 10, 14, &obs});
  for (int64_t h = 0; h < 2; ++h) EXPECT_EQ(positions_of(cache, 0, h), expected[h]) << "head " << h;
}

TEST(KvPolicies, KeyDiffKeepsTheKeysLeastLikeTheMeanKeyDirection) {
  // Twelve keys near one direction and four pointing elsewhere: the four, then the least aligned of the rest.
  KvCache cache(spec(1, 1, 4));
  torch::manual_seed(30);
  torch::Tensor keys = torch::tensor({1.0f, 0.0f, 0.0f, 0.0f}).repeat({16, 1}) + 0.05 * torch::randn({16, 4});
  for (int64_t i : {3, 7, 11, 14}) keys[i] = torch::randn({4}) * 2 - torch::tensor({3.0f, 0.0f, 0.0f, 0.0f});
  cache.append(0, keys.unsqueeze(1), torch::randn({16, 1, 4}), torch::arange(16, torch::kInt64));
  // By hand: the anchor is the mean unit key; score = -cos(k, anchor).
  const torch::Tensor unit = keys / keys.norm(2, 1, true), anchor = unit.mean(0);
  const torch::Tensor score = -torch::mv(unit, anchor) / anchor.norm();
  const std::vector<int64_t> expected = top(score, 6);
  for (int64_t i : {3, 7, 11, 14}) EXPECT_NE(std::find(expected.begin(), expected.end(), i), expected.end()) << i;
  make_kv_policy("keydiff", {{"budget", 6.0 / 16.0}})->after_step(cache, kPrefill);  // no observation needed
  EXPECT_EQ(positions_of(cache, 0, 0), expected);
  EXPECT_FALSE(make_kv_policy("keydiff")->needs().any());
}

TEST(KvPolicies, SnapKvKeepsItsWindowInsideTheBudget) {
  // An 8-query window at positions 12..19 with a budget of ceil(0.2 * 20) = 4: the window ranks first, newest
  // highest, and takes the budget like any entry (kvpress pads the window with the maximum score).
  KvCache cache = random_cache(spec(1, 2, 4), 20, 31);
  KvObservations obs(1, 2, {8, false});
  obs.observe(0, torch::randn({8, 2, 4}), torch::arange(12, 20, torch::kInt64), cache, 0.5);
  make_kv_policy("snapkv", {{"budget", 0.2}, {"window", 8}})->after_step(cache, KvStep{true, 12, 8, &obs});
  for (int64_t h = 0; h < 2; ++h) EXPECT_EQ(positions_of(cache, 0, h), (std::vector<int64_t>{16, 17, 18, 19}));
  EXPECT_EQ(cache.bytes(), cache.entry_bytes() * 2 * 4);  // at the budget, not at the window
}

TEST(KvObservations, GroupedQueryHeadsRecordTheirGroupsMean) {
  // 4 query heads over 2 KV heads: KV head h is read by query heads 2h and 2h + 1; its record is their mean.
  KvCache cache = random_cache(spec(1, 2, 4), 6, 32);
  KvObservations obs(1, 2, {3, true}, 4);
  EXPECT_EQ(obs.group(), 2);
  torch::manual_seed(33);
  const torch::Tensor q = torch::randn({2, 4, 4});
  obs.observe(0, q, torch::tensor({4, 5}, torch::kInt64), cache, 0.5);
  EXPECT_EQ(obs.window_queries(0).sizes().vec(), (std::vector<int64_t>{4, 2, 4}));
  for (int64_t h = 0; h < 2; ++h) {
    const KvHeadView view = cache.view(0, h);
    torch::Tensor acc = torch::zeros({6}), last = torch::zeros({6});
    for (int64_t j = 2 * h; j < 2 * h + 2; ++j) {
      const torch::Tensor p4 = torch::softmax(0.5 * torch::matmul(view.keys.narrow(0, 0, 5), q[0][j]), 0);
      const torch::Tensor p5 = torch::softmax(0.5 * torch::matmul(view.keys, q[1][j]), 0);
      acc += (torch::cat({p4, torch::zeros({1})}) + p5) / 2;
      last += p5 / 2;
    }
    EXPECT_TRUE(torch::allclose(obs.accumulated_attention(cache, 0, h), acc, 1e-5, 1e-6)) << h;
    EXPECT_TRUE(torch::allclose(obs.last_attention(cache, 0, h), last, 1e-5, 1e-6)) << h;
  }
  EXPECT_NE(error_of([] { KvObservations(1, 2, {1, false}, 3); }).find("query_heads 3 a multiple of heads"),
            std::string::npos);
}

TEST(KvPolicies, EveryPolicyCompressesOnTheSameScheduleWhileDecoding) {
  // Equal memory: by default every policy compresses when the next position is a multiple of 64, so all hold
  // the same entries while the continuation is scored.
  Transformer model = sharp_model(34);
  const auto tokens = random_tokens(70, 35);
  for (const auto& name : kPolicies) {
    DecodeSession session(model, 16, make_kv_policy(name, {{"budget", 0.5}}));
    session.prefill(std::vector<int64_t>(tokens.begin(), tokens.begin() + 50));
    auto layer_total = [&] {
      int64_t total = 0;
      for (int64_t h = 0; h < 4; ++h) total += session.cache().length(0, h);
      return total;
    };
    for (int64_t i = 50; i < 63; ++i) session.decode(tokens[static_cast<size_t>(i)]);
    // Next position 63: nothing compressed since the prefill (25 entries per head) and 13 appended.
    EXPECT_EQ(layer_total(), 4 * (25 + 13)) << name;
    session.decode(tokens[63]);  // next position 64: compressed to ceil(0.5 * 64) = 32 per head
    EXPECT_EQ(layer_total(), 4 * 32) << name;
  }
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
  EXPECT_NE(error_of([] { make_kv_policy("expected-attention", {{"window", 8}}); })
                .find("its options: n_future_positions, n_sink, value_norm, budget"),
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
                                       {"expected-attention", "n_future_positions", 0, "n_future_positions = 0 outside [1"},
                                       {"expected-attention", "value_norm", 2, "value_norm = 2 outside [0, 1]"},
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

TEST(KvPolicies, EveryPolicyRunsOnAGroupedQueryModel) {
  // 4 query heads over 2 K/V heads: the cache and the policies work per K/V head, scoring with the group's
  // queries; budget 1 is still bitwise full and 0.5 keeps every head within ceil(0.5 x tokens seen).
  Transformer model = sharp_model(36, Precision::kFp32, 3, 2);
  const auto tokens = random_tokens(90, 37);
  const torch::Tensor full = session_logits(model, tokens, 50, nullptr);
  std::vector<std::string> names = kPolicies;
  names.push_back("minimax");
  for (const auto& name : names) {
    SCOPED_TRACE(name);
    EXPECT_TRUE(torch::equal(session_logits(model, tokens, 50, make_kv_policy(name, {{"budget", 1.0}, {"interval", 1}})), full));
    DecodeSession session(model, 16, make_kv_policy(name, {{"budget", 0.5}, {"interval", 1}}));
    session.prefill(std::vector<int64_t>(tokens.begin(), tokens.begin() + 50));
    for (int64_t i = 50; i < 70; ++i) session.decode(tokens[static_cast<size_t>(i)]);
    ASSERT_EQ(session.cache().spec().kv_heads, 2);
    for (int64_t layer = 0; layer < 3; ++layer) {
      int64_t total = 0;
      for (int64_t h = 0; h < 2; ++h) total += session.cache().length(layer, h);
      EXPECT_LE(total, 2 * 35) << "layer " << layer;  // ceil(0.5 * 70) per head
    }
    const torch::Tensor got = session_logits(model, tokens, 50, make_kv_policy(name, {{"budget", 0.5}, {"interval", 1}}));
    EXPECT_GT((got - full).abs().max().item<double>(), 1e-4);
  }
}
