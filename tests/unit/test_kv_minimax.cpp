// The minimax KV policy and its block summaries: the identities of the issue (budget 1 bit-identical, a
// summary with every entry exact, merging uncompressed summaries = attention over the union), weights that
// restore mass (duplicated entries collapse exactly), summaries against eviction, abstention on a lookup head
// and not on a compressible one, the budget across heads, and the options.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "dcp/attention_kernels.h"
#include "dcp/config.h"
#include "dcp/infer.h"
#include "dcp/kv_cache.h"
#include "dcp/kv_observations.h"
#include "dcp/kv_policies.h"
#include "infer/kv/policies/minimax.h"
#include "infer/kv/summary.h"
#include "unit/error_of.h"
#include "unit/kv_test_model.h"

using namespace dcp;
using dcp::test::error_of;
using dcp::test::random_tokens;
using dcp::test::session_logits;
using dcp::test::sharp_model;

namespace {

// softmax(scale q.K^T + bias) V of one head, fp64: [Q, value_dim].
torch::Tensor attend(const KvHeadView& view, const torch::Tensor& q, double scale) {
  const torch::Tensor p = torch::softmax(
      scale * torch::matmul(q.to(torch::kDouble), view.keys.to(torch::kDouble).t()) + view.bias.to(torch::kDouble), 1);
  return torch::matmul(p, view.values.to(torch::kDouble));
}

double rel_err(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a - b).norm() / b.norm()).item<double>();
}

KvCacheSpec spec(int64_t heads, int64_t dim, torch::ScalarType dtype = torch::kDouble) {
  KvCacheSpec s;
  s.layers = 1;
  s.kv_heads = heads;
  s.head_dim = dim;
  s.dtype = dtype;
  return s;
}

// A cache whose heads hold the given keys [n, heads, d] and values at positions 0..n-1, and observations of
// `q` [W, heads, d] as the last W positions' queries.
struct Synthetic {
  KvCache cache;
  KvObservations obs;
  Synthetic(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& q, double scale)
      : cache(spec(k.size(1), k.size(2))), obs(1, k.size(1), KvObservationNeeds{q.size(0), false}) {
    const int64_t n = k.size(0);
    cache.append(0, k.to(torch::kDouble), v.to(torch::kDouble), torch::arange(n, torch::kInt64));
    obs.observe(0, q, torch::arange(n - q.size(0), n, torch::kInt64), cache, scale);
  }
  KvStep step() const { return KvStep{true, 0, cache.next_position(), &obs}; }
};

// Keys in c tight clusters of norm rho with values shared by the cluster (plus noise): compressible to about
// c weighted entries. [n, 1, d] each.
std::pair<torch::Tensor, torch::Tensor> clustered(int64_t n, int64_t d, int64_t c, double rho, double noise, uint64_t seed) {
  torch::manual_seed(seed);
  const torch::Tensor centres = torch::nn::functional::normalize(torch::randn({c, d}, torch::kDouble),
                                                                 torch::nn::functional::NormalizeFuncOptions().dim(1));
  const torch::Tensor values = torch::randn({c, d}, torch::kDouble);
  const torch::Tensor which = torch::randint(0, c, {n}, torch::kInt64);
  const torch::Tensor k = centres.index_select(0, which) * rho + noise * torch::randn({n, d}, torch::kDouble);
  const torch::Tensor v = values.index_select(0, which) + noise * torch::randn({n, d}, torch::kDouble);
  return {k.unsqueeze(1), v.unsqueeze(1)};
}

}  // namespace

TEST(KvSummary, EveryEntryKeptIsExact) {
  torch::manual_seed(1);
  KvCache cache(spec(1, 8));
  cache.append(0, torch::randn({40, 1, 8}, torch::kDouble), torch::randn({40, 1, 8}, torch::kDouble),
               torch::arange(40, torch::kInt64));
  const KvHeadView view = cache.view(0, 0);
  const torch::Tensor q = torch::randn({100, 8}, torch::kDouble) * 2;
  const torch::Tensor block = torch::arange(10, 40, torch::kInt64);
  KvBlockSummary s(view, q, 0.35, block, {}, torch::kDouble);
  s.extend(30);
  // 100 queries x 9 rows exceed 30 entries: the Gram is full rank and the path takes every entry, error 0.
  ASSERT_EQ(s.order().size(), 30u);
  EXPECT_NEAR(s.error().back(), 0.0, 1e-12 * s.error()[0]);
  const KvBlockSummary::Fit fit = s.fit(30, false);
  ASSERT_EQ(fit.atoms.numel(), 30);
  EXPECT_LT(fit.log_weight.abs().max().item<double>(), 1e-5);  // every weight 1
  // The error curve falls with every entry taken.
  for (size_t k = 1; k < s.error().size(); ++k) EXPECT_LE(s.error()[k], s.error()[k - 1] + 1e-15);
}

TEST(KvSummary, DuplicatedEntriesCollapseToOneWeightedEntryExactly) {
  // Each of 12 distinct (key, value) pairs stored 4 times: 12 entries with weight 4 (bias log 4) are the same
  // attention for every query, not only the reference ones.
  torch::manual_seed(2);
  const torch::Tensor k = torch::randn({12, 1, 8}, torch::kDouble).repeat_interleave(4, 0);
  const torch::Tensor v = torch::randn({12, 1, 8}, torch::kDouble).repeat_interleave(4, 0);
  KvCache cache(spec(1, 8));
  cache.append(0, k, v, torch::arange(48, torch::kInt64));
  const KvHeadView view = cache.view(0, 0);
  KvBlockSummary s(view, torch::randn({64, 8}, torch::kDouble), 0.35, torch::arange(48, torch::kInt64), {},
                   torch::kDouble);
  s.extend(12);
  const KvBlockSummary::Fit fit = s.fit(12, false);
  ASSERT_EQ(fit.atoms.numel(), 12);
  EXPECT_LT((fit.log_weight - std::log(4.0)).abs().max().item<double>(), 1e-5);
  KvHeadEdit edit;
  edit.keep = fit.atoms;
  edit.new_bias = fit.log_weight;
  KvCache compact = cache;  // shares storage; commit reallocates only the copy's head
  compact.commit(0, {edit});
  const torch::Tensor fresh = torch::randn({50, 8}, torch::kDouble) * 3;
  EXPECT_LT(rel_err(attend(compact.view(0, 0), fresh, 0.35), attend(cache.view(0, 0), fresh, 0.35)), 1e-5);
}

TEST(KvSummary, MergingTwoUncompressedSummariesIsAttentionOverTheirUnion) {
  // Two summaries (entries with log-weight biases) of disjoint blocks: attention over their union, as the
  // merge-reduce tree holds it, is the exact (out, lse) merge of attention over each (responses add).
  torch::manual_seed(3);
  const int64_t d = 8;
  const torch::Tensor q = torch::randn({5, d}, torch::kDouble);
  const torch::Tensor k = torch::randn({16, 1, d}, torch::kDouble), v = torch::randn({16, 1, d}, torch::kDouble);
  const torch::Tensor bias = torch::randn({16}).to(torch::kDouble);  // fp32 values: the cache stores fp32 biases
  KvCache u(spec(1, d));
  u.append(0, k, v, torch::arange(16, torch::kInt64));
  KvHeadEdit with_bias;
  with_bias.keep = torch::arange(16, torch::kInt64);
  with_bias.new_bias = bias;
  u.commit(0, {with_bias});
  auto over = [&](int64_t from, int64_t count) {
    const torch::Tensor logits = 0.35 * torch::matmul(q, k.select(1, 0).narrow(0, from, count).t()) +
                                 bias.narrow(0, from, count).unsqueeze(0);
    return AttentionResult{torch::matmul(torch::softmax(logits, 1), v.select(1, 0).narrow(0, from, count)).unsqueeze(1),
                           torch::logsumexp(logits, 1).unsqueeze(1)};
  };
  const AttentionResult merged = merge_attention(over(0, 7), over(7, 9));
  EXPECT_LT(rel_err(merged.out.select(1, 0), attend(u.view(0, 0), q, 0.35)), 1e-12);
}

TEST(KvSummary, ObservedQueriesSeeOnlyTheEntriesBeforeThem) {
  // The causal mask of the reference queries, by hand: an observed query at position p attends only to entries at
  // positions <= p (as it did when it ran); a sampled or probe query (kKvFutureQuery) sees every entry.
  torch::manual_seed(40);
  const int64_t n = 12, d = 4;
  KvHeadView view{torch::randn({n, d}, torch::kDouble) * 2, torch::randn({n, d}, torch::kDouble),
                  torch::zeros({n}), torch::arange(n, torch::kInt64) * 2};  // positions 0, 2, ..., 22
  const torch::Tensor q = torch::randn({3, d}, torch::kDouble);
  const torch::Tensor pos = torch::tensor({int64_t{5}, int64_t{14}, kKvFutureQuery}, torch::kInt64);
  const torch::Tensor p = kv_head_probs(view, q, 0.5, pos);
  for (int64_t r = 0; r < 3; ++r) {
    const int64_t visible = r == 0 ? 3 : r == 1 ? 8 : n;  // positions <= 5: 0, 2, 4; <= 14: 0 .. 14
    const torch::Tensor expected = torch::softmax(0.5 * torch::mv(view.keys.narrow(0, 0, visible), q[r]), 0);
    EXPECT_LT((p[r].narrow(0, 0, visible) - expected).abs().max().item<double>(), 1e-14) << r;
    if (visible < n) EXPECT_EQ(p[r].narrow(0, visible, n - visible).abs().max().item<double>(), 0.0) << r;
  }
  // A query that sees nothing gets zeros, not NaN.
  EXPECT_EQ(kv_head_probs(view, q.narrow(0, 0, 1), 0.5, torch::tensor({-1}, torch::kInt64)).abs().sum().item<double>(), 0.0);
  // The summary's Gram uses those masked probabilities: its first error (evicting the block) and its first greedy
  // pick against the explicit columns a_i = [p_qi (v_i - o_q); gamma p_qi] stacked over the queries.
  const torch::Tensor block = torch::arange(4, n, torch::kInt64);
  KvBlockSummary s(view, q, 0.5, block, pos, torch::kDouble);
  s.extend(1);
  const torch::Tensor o = torch::matmul(p, view.values);                                 // [3, d]
  const torch::Tensor pb = p.index_select(1, block), vb = view.values.index_select(0, block);
  const torch::Tensor diff = vb.unsqueeze(0) - o.unsqueeze(1);                            // [3, n_b, d]
  const double gamma2 = (pb * diff.pow(2).sum(2)).sum().item<double>() / pb.sum().item<double>();
  const torch::Tensor a = torch::cat({(pb.unsqueeze(2) * diff).permute({0, 2, 1}).reshape({3 * d, -1}),
                                      std::sqrt(gamma2) * pb},
                                     0);  // [3 (d + 1), n_b] (rows grouped differently; the Gram is the same)
  const torch::Tensor gram = torch::matmul(a.t(), a) / 3.0;
  EXPECT_NEAR(s.error()[0], gram.sum().item<double>(), 1e-12);
  const torch::Tensor gain = gram.sum(1).pow(2) / gram.diagonal();
  EXPECT_EQ(s.order()[0], gain.argmax().item<int64_t>());
  // Without the mask the same queries give another problem: the test can fail.
  KvBlockSummary unmasked(view, q, 0.5, block, {}, torch::kDouble);
  EXPECT_GT(std::abs(unmasked.error()[0] - s.error()[0]), 1e-6);
}

TEST(KvSummary, Fp32GramMatchesItsFp64Twin) {
  // The fast path forms the Gram in fp32 (three [n, Q] x [Q, n] matmuls); the fp64 twin is the reference. The
  // error curves agree to fp32 rounding of the Gram relative to its scale (tolerance 1e-4 of the first error:
  // n = 200 sums of Q = 150 products in fp32, each ~1e-7 relative) and the paths take the same entries.
  torch::manual_seed(41);
  KvHeadView view{torch::randn({300, 16}, torch::kDouble) * 1.5, torch::randn({300, 16}, torch::kDouble),
                  torch::zeros({300}), torch::arange(300, torch::kInt64)};
  const torch::Tensor q = torch::randn({150, 16}, torch::kDouble);
  const torch::Tensor pos = torch::cat({torch::arange(236, 300, torch::kInt64), torch::full({86}, kKvFutureQuery)});
  const torch::Tensor block = torch::arange(50, 250, torch::kInt64);
  KvBlockSummary fast(view, q, 0.25, block, pos), exact(view, q, 0.25, block, pos, torch::kDouble);
  fast.extend(40);
  exact.extend(40);
  ASSERT_EQ(fast.order().size(), 40u);
  const double scale = exact.error()[0];
  for (size_t k = 0; k <= 40; ++k) EXPECT_NEAR(fast.error()[k], exact.error()[k], 1e-4 * scale) << k;
  size_t same = 0;
  for (size_t k = 0; k < 40; ++k) same += fast.order()[k] == exact.order()[k];
  EXPECT_GE(same, 36u);  // near-ties late in the path may swap
  EXPECT_NEAR(fast.output_energy(), exact.output_energy(), 1e-5 * exact.output_energy());
  EXPECT_NEAR(fast.relative_error(10), std::sqrt(exact.error()[10] / exact.output_energy()), 1e-3);
}

TEST(KvSummary, BlockedPathMatchesItsPlainTwin) {
  // KvSummaryMethod::kBlocked (left-looking for n / 8 = 50 steps, then the Schur complement updated by rank-32
  // products, taken entries dropped from it on the way) against kPlain (one left-looking column per step), on the
  // same Gram: n = 400 entries, a path of 200 steps: four rank-32 updates after the switch and 22 columns pending.
  torch::manual_seed(47);
  const int64_t n_view = 480;
  KvHeadView view{torch::randn({n_view, 16}, torch::kDouble) * 1.5, torch::randn({n_view, 16}, torch::kDouble),
                  torch::zeros({n_view}), torch::arange(n_view, torch::kInt64)};
  const torch::Tensor q = torch::randn({192, 16}, torch::kDouble);
  const torch::Tensor pos =
      torch::cat({torch::arange(n_view - 64, n_view, torch::kInt64), torch::full({128}, kKvFutureQuery)});
  const torch::Tensor block = torch::arange(40, 440, torch::kInt64);
  for (const torch::ScalarType dtype : {torch::kDouble, torch::kFloat}) {
    // The same fp64 Gram either way (fp32 or fp64 products): the methods differ in rounding of O(1e-16)
    // relative per operation, so the paths take the same entries and the error curves agree to 1e-10 of the
    // first error over 200 steps.
    KvBlockSummary blocked(view, q, 0.25, block, pos, dtype, KvSummaryMethod::kBlocked);
    KvBlockSummary plain(view, q, 0.25, block, pos, dtype, KvSummaryMethod::kPlain);
    KvBlockSummary automatic(view, q, 0.25, block, pos, dtype);  // 400 x 200 columns < 4 MiB: left-looking
    blocked.extend(200);
    plain.extend(200);
    automatic.extend(200);
    ASSERT_EQ(blocked.order().size(), 200u);
    EXPECT_EQ(blocked.order(), plain.order());
    EXPECT_EQ(automatic.order(), plain.order());
    EXPECT_EQ(automatic.error(), plain.error());
    const double scale = plain.error()[0];
    for (size_t k = 0; k <= 200; ++k) EXPECT_NEAR(blocked.error()[k], plain.error()[k], 1e-10 * scale) << k;
    // The weight fits start from each path's own factor (the leading k x k block of what it recorded: from the
    // left-looking columns, the folded blocks and the pending columns for kBlocked, from the columns alone for
    // kPlain): the same weights at the switch, inside a block, after folds and at the end.
    for (const int64_t k : {50, 83, 150, 200}) {
      const KvBlockSummary::Fit fb = blocked.fit(k, false), fp = plain.fit(k, false);
      EXPECT_NEAR(fb.error, fp.error, 1e-10 * scale) << k;
      ASSERT_TRUE(torch::equal(fb.atoms, fp.atoms)) << k;
      EXPECT_LT((fb.log_weight - fp.log_weight).abs().max().item<double>(), 1e-6) << k;
    }
    // A path continued in pieces (the allocation grows it one entry at a time) is the path grown at once.
    KvBlockSummary pieces(view, q, 0.25, block, pos, dtype, KvSummaryMethod::kBlocked);
    for (int64_t k = 1; k <= 200; k += 7) pieces.extend(k);
    pieces.extend(200);
    EXPECT_EQ(pieces.order(), blocked.order());
    EXPECT_EQ(pieces.error(), blocked.error());
  }
}

TEST(KvSummary, BlockResponseIsTheExpressionsOfTheFirstOrderModel) {
  // KvBlockResponse, shared by the summary's Gram and minimax's screening, against its definition written out here
  // (the expressions both computed inline before): the same bits in either dtype, gamma^2 the mass-weighted mean
  // distance, and 1 for a block without mass.
  torch::manual_seed(43);
  for (const auto dtype : {torch::kFloat, torch::kDouble}) {
    KvHeadView view{torch::randn({50, 8}), torch::randn({50, 6}), torch::zeros({50}), torch::arange(50, torch::kInt64)};
    const torch::Tensor p = kv_head_probs(view, torch::randn({30, 8}), 0.4, {}, dtype);
    const torch::Tensor block = torch::tensor({int64_t{3}, int64_t{7}, int64_t{8}, int64_t{20}, int64_t{41}});
    const KvBlockResponse r(view, p, block);
    const torch::Tensor v = view.values.to(dtype);
    const torch::Tensor o = torch::matmul(p, v);
    const torch::Tensor pb = p.index_select(1, block), vb = v.index_select(0, block);
    const torch::Tensor u = torch::matmul(o, vb.t());
    const torch::Tensor o2 = (o * o).sum(1);
    const torch::Tensor dist2 = ((vb * vb).sum(1).unsqueeze(0) - 2 * u + o2.unsqueeze(1)).clamp_min(0);
    EXPECT_TRUE(torch::equal(r.probs, pb));
    EXPECT_TRUE(torch::equal(r.values, vb));
    EXPECT_TRUE(torch::equal(r.u, u));
    EXPECT_TRUE(torch::equal(r.o2, o2));
    EXPECT_TRUE(torch::equal(r.dist2, dist2));
    EXPECT_EQ(r.gamma2, (pb * dist2).sum().item<double>() / pb.sum().item<double>());
    // Each distance is ||v_i - o_q||^2 (to rounding: the expansion cancels).
    const torch::Tensor direct = (vb.unsqueeze(0) - o.unsqueeze(1)).pow(2).sum(2);
    EXPECT_LT((r.dist2 - direct).abs().max().item<double>(), dtype == torch::kFloat ? 1e-4 : 1e-12);
    const KvBlockResponse massless(view, torch::zeros_like(p), block);
    EXPECT_EQ(massless.gamma2, 1.0);
  }
}

TEST(KvSummary, ProbabilitiesGivenOnceAreTheSameSummary) {
  // minimax computes the reference queries' attention once (its estimate) and hands it to the summary: the same
  // Gram, path, errors and weights bit for bit as the summary that computes it itself.
  torch::manual_seed(42);
  KvHeadView view{torch::randn({120, 16}) * 1.5, torch::randn({120, 16}), torch::zeros({120}),
                  torch::arange(120, torch::kInt64)};
  const torch::Tensor q = torch::randn({70, 16});
  const torch::Tensor pos = torch::cat({torch::arange(100, 120, torch::kInt64), torch::full({50}, kKvFutureQuery)});
  const torch::Tensor block = torch::arange(10, 90, torch::kInt64);
  KvBlockSummary own(view, q, 0.25, block, pos);
  KvBlockSummary given(view, kv_head_probs(view, q, 0.25, pos, torch::kFloat), block);
  own.extend(20);
  given.extend(20);
  EXPECT_EQ(own.order(), given.order());
  EXPECT_EQ(own.error(), given.error());
  EXPECT_TRUE(torch::equal(own.fit(20, false).log_weight, given.fit(20, false).log_weight));
  EXPECT_NE(error_of([&] { KvBlockSummary(view, torch::rand({70, 119}), block); }).find("probs must be [Q >= 1, 120]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { KvBlockSummary(view, torch::rand({70, 120}, torch::kDouble), block); })
                .find("in the summary dtype"),
            std::string::npos);
}

namespace {

// w^T G w - 2 c^T w, the NNLS objective.
double nnls_objective(const std::vector<double>& g, const std::vector<double>& c, const std::vector<double>& w) {
  const size_t m = c.size();
  double f = 0;
  for (size_t a = 0; a < m; ++a) {
    double gw = 0;
    for (size_t b = 0; b < m; ++b) gw += g[a * m + b] * w[b];
    f += w[a] * gw - 2 * c[a] * w[a];
  }
  return f;
}

// The KKT conditions of the NNLS at w, which certify its optimum (the problem is convex): w >= 0, (c - G w)_i = 0 on
// the support and <= 0 off it, both within tol x max |c|. Returns how many weights are 0.
int64_t expect_kkt(const std::vector<double>& g, const std::vector<double>& c, const std::vector<double>& w, double tol,
                   int trial) {
  const auto m = static_cast<int64_t>(c.size());
  double max_c = 0;
  for (double x : c) max_c = std::max(max_c, std::abs(x));
  int64_t zeros = 0;
  for (int64_t i = 0; i < m; ++i) {
    double d = c[static_cast<size_t>(i)];
    for (int64_t j = 0; j < m; ++j) d -= g[static_cast<size_t>(i * m + j)] * w[static_cast<size_t>(j)];
    EXPECT_GE(w[static_cast<size_t>(i)], 0.0) << trial << " " << i;
    if (w[static_cast<size_t>(i)] > 0) {
      EXPECT_LT(std::abs(d), tol * max_c) << trial << " " << i;
    } else {
      EXPECT_LE(d, tol * max_c) << trial << " " << i;
      ++zeros;
    }
  }
  return zeros;
}

}  // namespace

TEST(KvSummary, ActiveSetNnlsIsExactAndMatchesItsCoordinateDescentTwin) {
  // By hand: G = [[1, .9], [.9, 1]], c = [1, -1]; least squares gives (10, -10), the non-negative optimum (1, 0)
  // (the second weight's descent direction c_2 - G_21 w_1 = -1.9 < 0 keeps it at 0).
  const std::vector<double> w2 = kv_nnls({1, 0.9, 0.9, 1}, {1, -1});
  ASSERT_EQ(w2.size(), 2u);
  EXPECT_NEAR(w2[0], 1.0, 1e-11);  // the ridge 1e-12 x max diag(G) shifts it by 1e-12
  EXPECT_EQ(w2[1], 0.0);
  EXPECT_TRUE(kv_nnls({}, {}).empty());
  EXPECT_NE(error_of([] { kv_nnls({1, 2, 3}, {1, 2}); }).find("m x m = 4 elements"), std::string::npos);
  // Summary-shaped problems (c = G 1: a block summarised by a subset of its entries) of full and deficient rank:
  // the active-set weights satisfy the KKT conditions and reach the objective of coordinate descent run to
  // convergence (20000 sweeps, moves < 1e-15) within 1e-9 of its size: the problems are strictly convex on the
  // support, so both find the one optimum, and the difference is the ridge and rounding of the solves.
  int64_t zeros = 0;
  for (int trial = 0; trial < 12; ++trial) {
    torch::manual_seed(100 + trial);
    const int64_t m = 8 + 4 * trial, rows = trial % 3 == 0 ? m / 2 : 3 * m;  // rank m/2 or full
    const torch::Tensor a = torch::randn({rows, m}, torch::kDouble) * torch::rand({1, m}, torch::kDouble);
    const torch::Tensor extra = torch::randn({rows, 2 * m}, torch::kDouble);  // the block's evicted entries
    const torch::Tensor gt = torch::matmul(a.t(), a).contiguous();
    const torch::Tensor ct = torch::matmul(a.t(), a.sum(1) + extra.sum(1)).contiguous();
    const std::vector<double> g(gt.data_ptr<double>(), gt.data_ptr<double>() + m * m);
    const std::vector<double> c(ct.data_ptr<double>(), ct.data_ptr<double>() + m);
    const std::vector<double> w = kv_nnls(g, c);
    const std::vector<double> ref = kv_nnls_reference(g, c, 20000, 1e-15);
    const double f = nnls_objective(g, c, w), f_ref = nnls_objective(g, c, ref);
    EXPECT_LE(f, f_ref + 1e-9 * std::abs(f_ref)) << trial;
    EXPECT_GE(f, f_ref - 1e-9 * std::abs(f_ref)) << trial;
    zeros += expect_kkt(g, c, w, 1e-8, trial);
  }
  EXPECT_GT(zeros, 0);  // the constraint binds: the test can tell NNLS from least squares
  // Large problems, where the factor of the passive set is updated (an index added or removed in O(k^2)) rather
  // than factorised afresh: the KKT conditions, which certify the optimum of this convex problem, at m = 300 and
  // 600, full and deficient rank, with a third to a half of the weights at 0.
  for (int trial = 0; trial < 4; ++trial) {
    torch::manual_seed(200 + trial);
    const int64_t m = trial < 2 ? 300 : 600, rows = trial % 2 == 0 ? 2 * m : m / 3;
    const torch::Tensor a = torch::randn({rows, m}, torch::kDouble) * torch::rand({1, m}, torch::kDouble);
    const torch::Tensor gt = torch::matmul(a.t(), a).contiguous();
    const torch::Tensor ct = torch::matmul(a.t(), a.sum(1) + torch::randn({rows, 2 * m}, torch::kDouble).sum(1)).contiguous();
    const std::vector<double> g(gt.data_ptr<double>(), gt.data_ptr<double>() + m * m);
    const std::vector<double> c(ct.data_ptr<double>(), ct.data_ptr<double>() + m);
    const std::vector<double> w = kv_nnls(g, c);
    EXPECT_GT(expect_kkt(g, c, w, 1e-7, trial), m / 10) << trial;
    if (rows < m) continue;
    // Started from G's own Cholesky factor (as the greedy path hands it over): the same optimum.
    const torch::Tensor l = torch::linalg_cholesky(gt).contiguous();
    std::vector<double> packed;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j <= i; ++j) packed.push_back(l[i][j].item<double>());
    }
    const std::vector<double> from_factor = kv_nnls(g, c, packed);
    const double f = nnls_objective(g, c, w), f_factor = nnls_objective(g, c, from_factor);
    EXPECT_NEAR(f_factor, f, 1e-9 * std::abs(f)) << trial;
  }
  EXPECT_NE(error_of([] { kv_nnls({1, 0, 0, 1}, {1, 1}, {1, 0}); }).find("m (m + 1) / 2 = 3 values"), std::string::npos);
  // Not a Gram matrix (indefinite), or not finite: refused, not solved with a broken factor.
  EXPECT_NE(error_of([] { kv_nnls({1, 2, 2, 1}, {1, 1}); }).find("not positive semi-definite"), std::string::npos);
  EXPECT_NE(error_of([] { kv_nnls({1, 0, 0, std::nan("")}, {1, 1}); }).find("G[3] = nan is not finite"),
            std::string::npos);
  EXPECT_NE(error_of([] { kv_nnls({1, 0, 0, 1}, {1, INFINITY}); }).find("c[1] = inf is not finite"), std::string::npos);
}

TEST(KvSummary, SpectralTailIsFlatForLookupAndSmallForClusters) {
  torch::manual_seed(4);
  // Near-orthogonal keys probed one by one: each probe's attention sits on its own entry.
  const torch::Tensor probs_lookup = torch::eye(32, torch::kDouble) * 0.9 + 0.1 / 32;
  const torch::Tensor unit = torch::nn::functional::normalize(torch::randn({32, 8}), torch::nn::functional::NormalizeFuncOptions().dim(1));
  EXPECT_GT(kv_spectral_tail(probs_lookup, unit, 8), 0.7);  // flat: 1 - 8/32 less the shared 0.1/32 part
  // Four clusters with shared values: responses in four directions.
  const torch::Tensor which = torch::arange(32, torch::kInt64) % 4;
  const torch::Tensor probs_clustered = torch::one_hot(which, 4).to(torch::kDouble).t().index_select(0, which) / 8.0;
  const torch::Tensor values = torch::randn({4, 8}).index_select(0, which);
  EXPECT_LT(kv_spectral_tail(probs_clustered, values, 4), 1e-9);
  EXPECT_EQ(kv_spectral_tail(torch::zeros({3, 2}, torch::kDouble), torch::zeros({2, 1}), 1), 0.0);
  EXPECT_NE(error_of([] { kv_spectral_tail(torch::zeros({3, 2}), torch::zeros({3, 1}), 1); }).find("kv_spectral_tail"),
            std::string::npos);
}

TEST(KvSummary, HeldOutErrorIsZeroForTheBlockAndExactForEviction) {
  torch::manual_seed(12);
  KvHeadView view{torch::randn({30, 8}, torch::kDouble) * 2, torch::randn({30, 8}, torch::kDouble),
                  torch::zeros({30}), torch::arange(30, torch::kInt64)};
  const torch::Tensor q = torch::randn({10, 8}, torch::kDouble);
  const torch::Tensor block = torch::arange(5, 25, torch::kInt64);
  const torch::Tensor none = torch::zeros({0}, torch::kInt64);
  const double scale = 0.5;
  // Every block entry at weight 1 is the block itself.
  EXPECT_EQ(kv_heldout_rel_error(view, q, scale, block, torch::arange(20, torch::kInt64), torch::zeros({20})), 0.0);
  // Eviction: the first-order error is exact up to the mass kept, (o~ - o) D~ / D, here computed directly.
  const torch::Tensor logits = scale * torch::matmul(q, view.keys.t());
  const torch::Tensor e = logits.exp(), keep = torch::ones({30}, torch::kDouble).index_fill_(0, block, 0.0);
  const torch::Tensor d = e.sum(1, true), d_kept = (e * keep).sum(1, true);
  const torch::Tensor o = torch::matmul(e, view.values) / d, o_kept = torch::matmul(e * keep, view.values) / d_kept;
  const double expected = std::sqrt(((o_kept - o) * d_kept / d).pow(2).sum().item<double>() / o.pow(2).sum().item<double>());
  EXPECT_NEAR(kv_heldout_rel_error(view, q, scale, block, none, torch::zeros({0})), expected, 1e-12 * expected);
  // Two copies of one entry summarised by one at weight 2 are exact.
  KvHeadView dup = view;
  dup.keys = torch::cat({view.keys, view.keys.narrow(0, 7, 1)});
  dup.values = torch::cat({view.values, view.values.narrow(0, 7, 1)});
  dup.bias = torch::zeros({31});
  dup.positions = torch::arange(31, torch::kInt64);
  EXPECT_LT(kv_heldout_rel_error(dup, q, scale, torch::tensor({7, 30}, torch::kInt64), torch::tensor({0}, torch::kInt64),
                                 torch::full({1}, std::log(2.0))),
            1e-7);  // log 2 rounded to fp32
  EXPECT_NE(error_of([&] { kv_heldout_rel_error(view, q, scale, block, torch::tensor({20}, torch::kInt64),
                                                torch::zeros({1})); })
                .find("atoms in [0, 20)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { kv_heldout_rel_error(view, q, scale, torch::tensor({30}, torch::kInt64), none,
                                                torch::zeros({0})); })
                .find("block indices must lie in [0, 30)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { kv_heldout_rel_error(view, q, scale, block, none, torch::zeros({2})); })
                .find("log_weight one per atom"),
            std::string::npos);
  EXPECT_NE(error_of([&] { kv_heldout_rel_error(view, torch::randn({3, 4}), scale, block, none, torch::zeros({0})); })
                .find("queries must be [Q >= 1, 8]"),
            std::string::npos);
}

TEST(KvMinimax, BudgetOneIsBitIdenticalToFull) {
  Transformer model = sharp_model(1);
  const auto tokens = random_tokens(90, 2);
  const torch::Tensor full = session_logits(model, tokens, 50, make_kv_policy("full"));
  const torch::Tensor got = session_logits(model, tokens, 50, make_kv_policy("minimax", {{"budget", 1.0}, {"interval", 1}}));
  EXPECT_TRUE(torch::equal(got, full));
}

TEST(KvMinimax, DecodeStaysWithinTheLayerBudget) {
  // With abstention on (the default) as much as off: an incompressible block takes from the layer's pool.
  Transformer model = sharp_model(3);
  const auto tokens = random_tokens(160, 4);
  auto policy = std::make_shared<MinimaxKvPolicy>([] {
    MinimaxOptions o;
    o.budget = KvBudget{0.3, 8, 0};
    o.abstain_tail = 0.05;  // abstain often: the pool must still hold
    return o;
  }());
  DecodeSession session(model, 16, policy);
  session.prefill(std::vector<int64_t>(tokens.begin(), tokens.begin() + 100));
  for (size_t i = 100; i < tokens.size(); ++i) {
    session.decode(tokens[i]);
    const KvCache& c = session.cache();
    if ((c.next_position() % 8) != 0) continue;  // compressed only every interval tokens
    const auto per_head = static_cast<int64_t>(std::ceil(0.3 * static_cast<double>(c.next_position())));
    for (int64_t layer = 0; layer < c.spec().layers; ++layer) {
      int64_t total = 0;
      for (int64_t h = 0; h < c.spec().kv_heads; ++h) total += c.length(layer, h);
      EXPECT_LE(total, c.spec().kv_heads * per_head) << "layer " << layer << " at " << c.next_position();
    }
  }
  EXPECT_FALSE(policy->abstained_heads().empty());  // it did abstain, inside the budget
  ASSERT_EQ(policy->risks().size(), 12u);
  // Sinks stay: every head still holds positions 0..3.
  for (int64_t h = 0; h < 4; ++h) {
    const torch::Tensor p = session.cache().view(0, h).positions;
    EXPECT_EQ(p.narrow(0, 0, 4).sum().item<int64_t>(), 6) << h;
  }
}

TEST(KvMinimax, HeadsRunInParallelAsEachWouldAloneOnOneThread) {
  // after_layer assesses, grows and fits the heads of a layer one per intra-op thread, each head's library calls on
  // its own thread alone: on the same cache and observations, the result on 2 threads must be the bits of 1 thread
  // (fp32 and fp64 caches; a fixed budget with abstentions, and an error target). The model's own forward is not
  // the same bits on 1 and 2 threads (ATen splits its reductions by thread), so this is checked on the policy.
  const int64_t n = 600, d = 16, heads = 4, w = 48;
  std::vector<torch::Tensor> ks, vs;
  for (int64_t h = 0; h < heads; ++h) {
    auto [k, v] = clustered(n, d, 3 + 4 * h, 4.0, 0.05 + 0.1 * static_cast<double>(h), 70 + static_cast<uint64_t>(h));
    ks.push_back(k);
    vs.push_back(v);
  }
  torch::manual_seed(77);
  const torch::Tensor k = torch::cat(ks, 1), v = torch::cat(vs, 1), q = torch::randn({w, heads, d}, torch::kDouble) * 3;
  for (auto dtype : {torch::kFloat, torch::kDouble}) {
    for (const KvPolicyOptions& options : {KvPolicyOptions{{"budget", 0.1}, {"abstain_tail", 0.3}},
                                           KvPolicyOptions{{"max_rel_error", 0.05}}}) {
      std::vector<std::unique_ptr<KvCache>> caches;
      std::vector<std::shared_ptr<KvPolicy>> policies;
      const int restore = at::get_num_threads();
      for (int threads : {1, 2}) {
        at::set_num_threads(threads);
        caches.push_back(std::make_unique<KvCache>(spec(heads, d, dtype)));
        KvObservations obs(1, heads, KvObservationNeeds{w, false});
        caches.back()->append(0, k.to(dtype), v.to(dtype), torch::arange(n, torch::kInt64));
        obs.observe(0, q.to(dtype), torch::arange(n - w, n, torch::kInt64), *caches.back(), 0.25);
        policies.push_back(make_kv_policy("minimax", options));
        policies.back()->after_step(*caches.back(), KvStep{true, 0, n, &obs});
      }
      at::set_num_threads(restore);
      const std::string what = std::string(c10::toString(dtype)) + (options.count("budget") ? " budget" : " target");
      int64_t kept = 0;
      for (int64_t h = 0; h < heads; ++h) {
        const KvHeadView x = caches[0]->view(0, h), y = caches[1]->view(0, h);
        kept += x.length();
        EXPECT_TRUE(torch::equal(x.positions, y.positions)) << what << " head " << h;
        EXPECT_TRUE(torch::equal(x.bias, y.bias)) << what << " head " << h;
        EXPECT_TRUE(torch::equal(x.values, y.values)) << what << " head " << h;
      }
      EXPECT_LT(kept, heads * n) << what;  // it compressed: the heads' work ran
      const auto& ra = std::dynamic_pointer_cast<MinimaxKvPolicy>(policies[0])->risks();
      const auto& rb = std::dynamic_pointer_cast<MinimaxKvPolicy>(policies[1])->risks();
      ASSERT_EQ(ra.size(), rb.size());
      for (size_t i = 0; i < ra.size(); ++i) {
        EXPECT_EQ(ra[i].error, rb[i].error) << what << " " << i;
        EXPECT_EQ(ra[i].tail, rb[i].tail) << what << " " << i;
        EXPECT_EQ(ra[i].abstained, rb[i].abstained) << what << " " << i;
      }
    }
  }
}

TEST(KvMinimax, LongPathsAreTheSameBitsOnAnyThreadCount) {
  // 1100 entries at budget 0.8: each head summarises a block of ~876 into ~650, a path past 2^19 / 876 = 599 steps, where it
  // continues as the blocked right-looking Cholesky (rank-32 BLAS products, which on 2 BLAS threads round
  // differently from 1; KvSummary.BlockedPathMatchesItsPlainTwin). minimax runs every head's library calls on
  // its own thread (one head: on the calling thread with the library's threads set to 1), so the compression is
  // the same bits on 1 and 2 threads.
  const int64_t n = 1100, d = 16, heads = 1, w = 32;
  std::vector<torch::Tensor> ks, vs;
  for (int64_t h = 0; h < heads; ++h) {
    auto [k, v] = clustered(n, d, 40 + 20 * h, 3.0, 0.3, 90 + static_cast<uint64_t>(h));
    ks.push_back(k);
    vs.push_back(v);
  }
  torch::manual_seed(91);
  const torch::Tensor k = torch::cat(ks, 1), v = torch::cat(vs, 1), q = torch::randn({w, heads, d}, torch::kDouble) * 2;
  std::vector<std::unique_ptr<KvCache>> caches;
  const int restore = at::get_num_threads();
  for (int threads : {1, 2}) {
    at::set_num_threads(threads);
    caches.push_back(std::make_unique<KvCache>(spec(heads, d, torch::kFloat)));
    KvObservations obs(1, heads, KvObservationNeeds{w, false});
    caches.back()->append(0, k.to(torch::kFloat), v.to(torch::kFloat), torch::arange(n, torch::kInt64));
    obs.observe(0, q.to(torch::kFloat), torch::arange(n - w, n, torch::kInt64), *caches.back(), 0.25);
    make_kv_policy("minimax", {{"budget", 0.8}, {"abstain_tail", 2.0}})->after_step(*caches.back(), KvStep{true, 0, n, &obs});
  }
  at::set_num_threads(restore);
  for (int64_t h = 0; h < heads; ++h) {
    const KvHeadView x = caches[0]->view(0, h), y = caches[1]->view(0, h);
    EXPECT_LT(x.length(), n) << h;  // compressed
    EXPECT_GT(x.length(), 4 + 220 + 599) << h;  // sinks, recent entries and > 599 kept: past the blocked switch
    EXPECT_TRUE(torch::equal(x.positions, y.positions)) << h;
    EXPECT_TRUE(torch::equal(x.bias, y.bias)) << h;
  }
}

TEST(KvMinimax, WithoutMergesASummaryIsFinal) {
  // Two prefill chunks of 512 at budget 0.25: the first compression summarises [4, 480) (sinks 4, the newest 32
  // exact). With merge=0 the second leaves that summary as it was (it holds no more than its share) and summarises
  // only [480, 960); with merges (the default) the two level-0 blocks merge and [4, 480) is summarised again.
  const int64_t d = 16, w = 32;
  auto [k, v] = clustered(1024, d, 24, 3.0, 0.3, 120);
  torch::manual_seed(121);
  const torch::Tensor q = torch::randn({1024, 1, d}, torch::kDouble) * 2;
  for (const int merge : {0, 1}) {
    KvCache cache(spec(1, d, torch::kFloat));
    KvObservations obs(1, 1, KvObservationNeeds{w, false});
    auto policy = make_kv_policy("minimax", {{"budget", 0.25}, {"merge", static_cast<double>(merge)}});
    torch::Tensor first_positions, first_bias;
    for (int64_t chunk = 0; chunk < 2; ++chunk) {
      const int64_t from = chunk * 512;
      cache.append(0, k.narrow(0, from, 512).to(torch::kFloat), v.narrow(0, from, 512).to(torch::kFloat),
                   torch::arange(from, from + 512, torch::kInt64));
      obs.observe(0, q.narrow(0, from + 512 - w, w).to(torch::kFloat),
                  torch::arange(from + 512 - w, from + 512, torch::kInt64), cache, 0.25);
      policy->after_step(cache, KvStep{true, from, 512, &obs});
      const KvHeadView view = cache.view(0, 0);
      const torch::Tensor summarised = (view.positions >= 4) & (view.positions < 480);
      const torch::Tensor positions = view.positions.masked_select(summarised);
      const torch::Tensor bias = view.bias.masked_select(summarised);
      if (chunk == 0) {
        ASSERT_LT(positions.numel(), 476);  // the first block was summarised
        first_positions = positions;
        first_bias = bias;
        continue;
      }
      const bool same = torch::equal(positions, first_positions) && torch::equal(bias, first_bias);
      EXPECT_EQ(same, merge == 0) << "merge=" << merge;
    }
  }
}

TEST(KvMinimax, SummaryBeatsEvictionOnACompressibleHead) {
  const int64_t n = 400, d = 16;
  auto [k, v] = clustered(n, d, 6, 4.0, 0.05, 5);
  torch::manual_seed(6);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const torch::Tensor q = torch::randn({64, 1, d}, torch::kDouble) * 3;
  const torch::Tensor test_q = torch::randn({200, d}, torch::kDouble) * 3;
  auto error_with = [&](const std::string& name) {
    Synthetic s(k, v, q, scale);
    const torch::Tensor full = attend(s.cache.view(0, 0), test_q, scale);
    make_kv_policy(name, {{"budget", 0.1}})->after_step(s.cache, s.step());
    if (name == "minimax") EXPECT_LE(s.cache.length(0, 0), 40);
    return rel_err(attend(s.cache.view(0, 0), test_q, scale), full);
  };
  const double minimax = error_with("minimax");
  // Not expected-attention: it fits pre-rotary query statistics and rotates them to the keys' positions, which
  // needs a cache whose keys carry rotary (these synthetic keys do not; its cases are in test_kv_policies).
  for (const char* baseline : {"window", "snapkv"}) {
    EXPECT_LT(minimax, 0.5 * error_with(baseline)) << baseline;
  }
  EXPECT_LT(minimax, 0.05);
}

namespace {

// Head 0 clustered (compressible), head 1 lookup (random keys of norm 16 in 64 dimensions, nearly orthogonal,
// random values); 256 entries each, 64 observed queries.
Synthetic lookup_and_clustered() {
  const int64_t n = 256, d = 64;
  auto [kc, vc] = clustered(n, d, 4, 4.0, 0.05, 7);
  torch::manual_seed(8);
  const torch::Tensor kl = torch::nn::functional::normalize(torch::randn({n, 1, d}, torch::kDouble),
                                                            torch::nn::functional::NormalizeFuncOptions().dim(2)) * 16;
  const torch::Tensor vl = torch::randn({n, 1, d}, torch::kDouble);
  const torch::Tensor q = torch::randn({64, 2, d}, torch::kDouble) * 16 / std::sqrt(64.0);
  return Synthetic(torch::cat({kc, kl}, 1), torch::cat({vc, vl}, 1), q, 1.0 / 8);
}

}  // namespace

TEST(KvMinimax, AnIncompressibleBlockTakesMoreOfTheLayersPoolAndTheLayerStaysAtItsBudget) {
  Synthetic s = lookup_and_clustered();
  auto policy = make_kv_policy("minimax", {{"budget", 0.25}});
  policy->after_step(s.cache, s.step());
  const auto abstained = policy->abstained_heads();
  ASSERT_EQ(abstained.size(), 1u);
  EXPECT_EQ(abstained[0], std::make_pair(int64_t{0}, int64_t{1}));
  // Per head ceil(0.25 * 256) = 64, 128 for the layer. Exact parts: 4 sinks + 16 recent per head, so the blocks
  // share 128 - 40 = 88: the clustered head at most its floor floor(0.2 * 44) = 8, the lookup head the other 80
  // (less any entry whose fitted weight is 0).
  EXPECT_LE(s.cache.length(0, 0) + s.cache.length(0, 1), 128);
  EXPECT_LE(s.cache.length(0, 0), 20 + 8);
  EXPECT_GT(s.cache.length(0, 1), 64);  // more than its fair share
  EXPECT_GE(s.cache.length(0, 1), 20 + 70);
  const auto& risks = std::dynamic_pointer_cast<MinimaxKvPolicy>(policy)->risks();
  EXPECT_TRUE(risks[1].abstained);
  EXPECT_FALSE(risks[1].exact);  // its block did not fit whole
  EXPECT_GT(risks[1].tail, 0.5);
  EXPECT_LT(risks[0].tail, 0.5);
  EXPECT_EQ(risks[0].heldout, 0);  // off by default
  // exceed_budget keeps the incompressible block whole, outside the pool (the clustered head keeps its share).
  Synthetic over = lookup_and_clustered();
  auto exceed = make_kv_policy("minimax", {{"budget", 0.25}, {"exceed_budget", 1}});
  exceed->after_step(over.cache, over.step());
  EXPECT_EQ(over.cache.length(0, 1), 256);
  EXPECT_LE(over.cache.length(0, 0), 64);
  EXPECT_TRUE(std::dynamic_pointer_cast<MinimaxKvPolicy>(exceed)->risks()[1].exact);
  // The held-out risk agrees: a clustered head's summary carries over to queries it was not fitted to, a
  // lookup head's does not; with the spectral estimate off it alone abstains on the lookup head.
  Synthetic again = lookup_and_clustered();
  auto heldout_only = make_kv_policy("minimax", {{"budget", 0.25}, {"abstain_tail", 2}, {"abstain_heldout", 0.05}});
  heldout_only->after_step(again.cache, again.step());
  EXPECT_EQ(heldout_only->abstained_heads(), abstained);
  const auto& held = std::dynamic_pointer_cast<MinimaxKvPolicy>(heldout_only)->risks();
  EXPECT_LT(held[0].heldout, 0.05);
  EXPECT_GT(held[1].heldout, 0.2);
  // reset() forgets the abstentions.
  policy->reset();
  EXPECT_TRUE(policy->abstained_heads().empty());
}

TEST(KvMinimax, AnIncompressibleBlockIsKeptExactWhenThePoolHoldsIt) {
  // At budget 0.75 (192 per head, 48 recent) the pool 2 x 192 - 2 x (4 + 48) = 280 holds the lookup head's
  // block of 204 whole: exact (every entry, no bias); the clustered head's block is still summarised. (Its
  // spectral tail at this share, ~0.3 of a flat spectrum, is below the default 0.5: abstain_tail 0.1 here.)
  Synthetic s = lookup_and_clustered();
  auto policy = make_kv_policy("minimax", {{"budget", 0.75}, {"abstain_tail", 0.1}});
  policy->after_step(s.cache, s.step());
  const auto& risks = std::dynamic_pointer_cast<MinimaxKvPolicy>(policy)->risks();
  ASSERT_TRUE(risks[1].abstained);
  EXPECT_TRUE(risks[1].exact);
  EXPECT_EQ(s.cache.length(0, 1), 256);
  EXPECT_EQ(s.cache.view(0, 1).bias.abs().max().item<double>(), 0.0);
  EXPECT_LT(s.cache.length(0, 0), 192);
  EXPECT_LE(s.cache.length(0, 0) + s.cache.length(0, 1), 2 * 192);
}

TEST(KvMinimax, NoBiasAblationKeepsTheSameEntriesWithWeightOne) {
  const int64_t n = 400, d = 16;
  auto [k, v] = clustered(n, d, 6, 4.0, 0.05, 42);
  torch::manual_seed(43);
  const torch::Tensor q = torch::randn({64, 1, d}, torch::kDouble) * 3;
  Synthetic weighted(k, v, q, 0.25), unit(k, v, q, 0.25);
  make_kv_policy("minimax", {{"budget", 0.1}})->after_step(weighted.cache, weighted.step());
  make_kv_policy("minimax", {{"budget", 0.1}, {"unit_weights", 1}})->after_step(unit.cache, unit.step());
  EXPECT_TRUE(torch::equal(weighted.cache.view(0, 0).positions, unit.cache.view(0, 0).positions));
  EXPECT_GT(weighted.cache.view(0, 0).bias.abs().max().item<double>(), 0.5);  // weights ~ cluster sizes
  EXPECT_EQ(unit.cache.view(0, 0).bias.abs().max().item<double>(), 0.0);
  // The weights are what make the summary good: without them the same entries err far more.
  const torch::Tensor test_q = torch::randn({200, d}, torch::kDouble) * 3;
  Synthetic full(k, v, q, 0.25);
  const torch::Tensor o = attend(full.cache.view(0, 0), test_q, 0.25);
  EXPECT_LT(3 * rel_err(attend(weighted.cache.view(0, 0), test_q, 0.25), o),
            rel_err(attend(unit.cache.view(0, 0), test_q, 0.25), o));
}

TEST(KvMinimax, AnErrorTargetSizesEachBlockByItsPredictedError) {
  const int64_t n = 400, d = 16;
  auto [k, v] = clustered(n, d, 6, 4.0, 0.2, 44);
  torch::manual_seed(45);
  const torch::Tensor q = torch::randn({64, 1, d}, torch::kDouble) * 3;
  std::vector<int64_t> kept;
  for (double target : {0.005, 0.02, 0.08}) {
    Synthetic s(k, v, q, 0.25);
    auto policy = make_kv_policy("minimax", {{"max_rel_error", target}});
    policy->after_step(s.cache, s.step());
    const KvHeadRisk& r = std::dynamic_pointer_cast<MinimaxKvPolicy>(policy)->risks()[0];
    EXPECT_LE(r.rel_error, target + 1e-9) << target;  // the fewest atoms that meet it
    kept.push_back(s.cache.length(0, 0));
  }
  EXPECT_GT(kept[0], kept[1]);
  EXPECT_GT(kept[1], kept[2]);
  EXPECT_LT(kept[2], n / 4);  // a loose target keeps a small cache of this compressible head
  // The conflict is named first, with both values.
  EXPECT_EQ(error_of([] { make_kv_policy("minimax", {{"max_rel_error", 0.01}, {"budget", 0.5}}); })
                .rfind("MinimaxKvPolicy: an error target (max_rel_error 0.01) sizes the cache itself and needs budget 1 "
                       "and max_tokens 0; got budget 0.5 and max_tokens 0",
                       0),
            0u);
  // Screening off (1) or no error target (0) is no conflict.
  EXPECT_EQ(error_of([] { make_kv_policy("minimax", {{"max_rel_error", 0.01}, {"max_keep_fraction", 1}}); }), "");
  EXPECT_EQ(error_of([] { make_kv_policy("minimax", {{"max_rel_error", 0}, {"max_keep_fraction", 0.5}}); }), "");
  EXPECT_NE(error_of([] { make_kv_policy("minimax", {{"max_rel_error", 0.01}, {"max_keep_fraction", 0.5}}); })
                .find("max_keep_fraction = 0.5 (screening, a budget-mode option) cannot be used with the error target"),
            std::string::npos);
}

TEST(KvMinimax, TheDefaultReferenceSetIs48Observed48Sampled48Probes) {
  // The defaults docs/kv_cache.md states (chosen on the calibration split,
  // bench/results/cpu2_202612_kv_minimax_queries_calibration.md); the observation window is what the policy asks
  // the forward to record.
  const MinimaxOptions o;
  EXPECT_EQ(o.window, 48);
  EXPECT_EQ(o.samples, 48);
  EXPECT_EQ(o.probes, 48);
  EXPECT_EQ(o.max_keep_fraction, 0.125);
  EXPECT_EQ(make_kv_policy("minimax", {{"budget", 0.25}})->needs().window, 48);
  EXPECT_EQ(make_kv_policy("minimax", {{"budget", 0.25}, {"window", 64}})->needs().window, 64);
}

TEST(KvMinimax, MaxTokensIsAFixedBudgetThatMergesSummaries) {
  Transformer model = sharp_model(9);
  const auto tokens = random_tokens(300, 10);
  auto policy = make_kv_policy("minimax", {{"budget", 1.0}, {"max_tokens", 40}, {"interval", 16}, {"abstain_tail", 2}});
  DecodeSession session(model, 32, policy);
  session.prefill(tokens);  // 300 tokens in chunks of 32, compressed after each
  for (int64_t layer = 0; layer < 3; ++layer) {
    int64_t total = 0;
    for (int64_t h = 0; h < 4; ++h) total += session.cache().length(layer, h);
    EXPECT_LE(total, 4 * 40) << layer;
    EXPECT_GT(total, 4 * 10) << layer;
  }
}

TEST(KvMinimax, ScreeningKeepsTheEntriesOfLargestErrorExactAndSummarisesTheRest) {
  // 400 entries, budget 0.5: sinks 4 and the newest 50 exact, the block [4, 350) of 346 entries with a share of
  // 146 (42%). max_keep_fraction 0.25 keeps k = ceil((146 - 0.25 x 346) / 0.75) = 80 entries of the block exact
  // beforehand, those of largest G_ii = sum_q p_qi^2 (||v_i - o_q||^2 + gamma^2) (computed here in fp64 from the
  // observed queries, the only reference queries with samples and probes 0), and summarises the other 266 with 66.
  const int64_t n = 400, d = 16, w = 64;
  auto [k, v] = clustered(n, d, 12, 3.0, 0.3, 46);
  torch::manual_seed(47);
  const double scale = 0.25;
  const torch::Tensor q = torch::randn({w, 1, d}, torch::kDouble) * 3;
  const torch::Tensor test_q = torch::randn({200, d}, torch::kDouble) * 3;
  Synthetic full(k, v, q, scale);
  const KvHeadView f = full.cache.view(0, 0);
  const torch::Tensor p = kv_head_probs(f, q.squeeze(1), scale, torch::arange(n - w, n, torch::kInt64));
  const torch::Tensor o = torch::matmul(p, f.values);
  const torch::Tensor block = torch::arange(4, 350, torch::kInt64);
  const torch::Tensor pb = p.index_select(1, block), vb = f.values.index_select(0, block);
  const torch::Tensor dist2 = ((vb * vb).sum(1).unsqueeze(0) - 2 * torch::matmul(o, vb.t()) +
                               (o * o).sum(1, true)).clamp_min(0);
  const double gamma2 = ((pb * dist2).sum() / pb.sum()).item<double>();
  const torch::Tensor diag = (pb * pb * (dist2 + gamma2)).sum(0);
  const auto [sorted, order] = diag.sort(0, /*descending=*/true);
  const torch::Tensor top = std::get<0>(block.index_select(0, order.narrow(0, 0, 80)).sort());
  const double last = sorted[79].item<double>(), next = sorted[80].item<double>();
  ASSERT_GT(last, next * (1 + 1e-4));  // no near-tie at the cut: fp32 screening picks the same 80
  const torch::Tensor o_full = attend(f, test_q, scale);
  double errors[2];
  for (const double fraction : {1.0, 0.25}) {
    Synthetic s(k, v, q, scale);
    make_kv_policy("minimax", {{"budget", 0.5}, {"samples", 0}, {"probes", 0}, {"max_keep_fraction", fraction}})
        ->after_step(s.cache, s.step());
    const KvHeadView view = s.cache.view(0, 0);
    EXPECT_LE(view.length(), 200) << fraction;  // the layer's budget
    EXPECT_GT(view.length(), 150) << fraction;  // and its pool used
    errors[fraction < 1 ? 1 : 0] = rel_err(attend(view, test_q, scale), o_full);
    if (fraction == 1.0) continue;
    // Every screened entry is kept with its bias as it was (0: weight 1).
    const torch::Tensor kept = torch::isin(top, view.positions);
    EXPECT_TRUE(kept.all().item<bool>()) << top.masked_select(~kept);
    const torch::Tensor at = torch::searchsorted(view.positions, top);
    EXPECT_EQ(view.bias.index_select(0, at).abs().max().item<double>(), 0.0);
    // The rest was summarised: entries of the block with weights other than 1.
    EXPECT_GT(view.bias.ne(0).sum().item<int64_t>(), 10);
  }
  // Screening trades some accuracy for speed; on this head it stays close to the unscreened summary.
  std::printf("relative error on 200 test queries: unscreened %.4f, screened %.4f\n", errors[0], errors[1]);
  EXPECT_LT(errors[1], 2 * errors[0] + 1e-3);
}

TEST(KvMinimax, OptionsAreChecked) {
  struct Bad {
    std::string key;
    double value;
    std::string message;
  };
  for (const Bad& b : std::vector<Bad>{{"window", 0, "window = 0 outside [1"},
                                       {"samples", -1, "samples = -1 outside [0"},
                                       {"recent_fraction", 1.5, "recent_fraction = 1.5 outside [0, 1]"},
                                       {"abstain_tail", -0.1, "abstain_tail = -0.1 outside [0"},
                                       {"abstain_heldout", -1, "abstain_heldout = -1 outside [0"},
                                       {"refit_values", 2, "refit_values = 2 must be 0 or 1"},
                                       {"exceed_budget", 2, "exceed_budget = 2 must be 0 or 1"},
                                       {"unit_weights", 3, "unit_weights = 3 must be 0 or 1"},
                                       {"merge", 2, "merge = 2 must be 0 or 1"},
                                       {"max_rel_error", -0.1, "max_rel_error = -0.1 outside [0"},
                                       {"max_keep_fraction", 0, "max_keep_fraction = 0 outside (0, 1]"},
                                       {"max_keep_fraction", 1.5, "max_keep_fraction = 1.5 outside (0, 1]"},
                                       {"recent_tokens", -1, "recent_tokens = -1 outside [0"},
                                       {"max_tokens", -1, "max_tokens = -1 outside [0"},
                                       {"budget", 0, "budget = 0 outside (0, 1]"}}) {
    const std::string e = error_of([&] { make_kv_policy("minimax", {{b.key, b.value}}); });
    EXPECT_NE(e.find("minimax: " + b.message), std::string::npos) << b.key << ": " << e;
  }
  EXPECT_NE(error_of([] { make_kv_policy("minimax", {{"kernel", 3}}); }).find("minimax has no option 'kernel'"),
            std::string::npos);
  Synthetic s(torch::randn({20, 1, 4}), torch::randn({20, 1, 4}), torch::randn({4, 1, 4}), 0.5);
  EXPECT_NE(error_of([&] { make_kv_policy("minimax", {{"budget", 0.2}})->after_step(s.cache, KvStep{true, 0, 20, nullptr}); })
                .find("no observed queries"),
            std::string::npos);
}
