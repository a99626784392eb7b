// The operator tier of the KV-compression evaluation (../shared/specs/kv-cache-compression.md section 7.1, tier A):
// no model. Synthetic caches of one layer and H heads with controlled compressibility are compressed by each
// policy (make_kv_policy) and the compressed attention o~(q) = softmax(scale q.K~^T + bias~) V~ is compared with
// the full attention o(q) = softmax(scale q.K^T) V for four query families: fresh in-distribution draws, a shifted
// law, needle probes and adversarial queries found by projected gradient ascent. docs/kv_cache.md "Operator tier"
// says what the generators are and where the measured numbers are.
//
//   build/bench/bench_kv_operator --n 1024 --head-dim 64 --heads 4 --seeds 3 --queries 128 \
//       --out bench/results/cpu2_202612_kv_operator          (8 min on 2 shared cores; the committed results)
//   build/bench/bench_kv_operator --n 64 --heads 2 --seeds 1 ... --check   (the CTest smoke test, bench/CMakeLists.txt)
//
// Per (generator, values, policy, budget) it reports the relative output error ||o~ - o|| / ||o|| (mean, p95, max
// per family, pooled over heads and seeds, and the worst over all families), the mass error |log(D~/D)| (D the
// softmax denominator, i.e. exp of the logsumexp; mean over the non-adversarial queries) and bytes after / before
// compression. Every random draw comes from a seed fixed by (generator, seed, what is drawn), so every policy and
// budget sees the same caches and queries (paired comparisons).
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "dcp/infer.h"
#include "dcp/kv_policies.h"
#include "infer/kv/policies/minimax.h"

namespace {

using namespace dcp;

// Generator knobs (one per generator; the others are fixed so that a change of the knob is the only change).
struct Knobs {
  int64_t clusters = 16;        // clustered: c
  double sigma = 0.3;           // clustered: noise norm relative to the unit centre
  double rho = 8;               // key and query norm of clustered, lowrank, sinks (logits ~ rho^2 / sqrt(d) * cos)
  double alpha = 1.0;           // lowrank: singular values k^-alpha
  double lookup_rho = 10;       // lookup: key and query norm (large: each query matches its key alone)
  double sink_gap = 10;         // sinks: a sink's logit for a query along the mean query direction
  int64_t sinks = 4;            // sinks: how many (positions 0 ..)
  double recency_alpha = 1.5;   // recency: attention ~ (n - i)^-alpha for the key at position i
};

torch::Tensor unit_rows(const torch::Tensor& x) { return x / x.norm(2, -1, true).clamp_min(1e-30); }

// One head's synthetic law: keys [n, d] fp64 (positions 0..n-1), and the query law (draw(m) gives [m, d] fp64 from
// the global torch RNG).
struct HeadLaw {
  torch::Tensor keys;
  std::function<torch::Tensor(int64_t)> draw;
};

// clustered(c, sigma, rho): c unit centres; keys and queries = rho * unit(centre + sigma noise): a query attends
// to its cluster's ~n/c keys almost uniformly (effective dimension ~ c).
HeadLaw clustered(int64_t n, int64_t d, const Knobs& k) {
  const torch::Tensor centres = unit_rows(torch::randn({k.clusters, d}, torch::kDouble));
  const double sigma = k.sigma, rho = k.rho;
  auto sample = [centres, sigma, rho, d](int64_t m) {
    const torch::Tensor a = torch::randint(centres.size(0), {m}, torch::kInt64);
    return rho * unit_rows(centres.index_select(0, a) + sigma / std::sqrt(double(d)) * torch::randn({m, d}, torch::kDouble));
  };
  return {sample(n), sample};
}

// lowrank(alpha): K = U diag(s) W^T with s_j = j^-alpha, U Gaussian, W a random orthogonal basis; queries from
// the same law. Scaled so that the mean key norm is rho.
HeadLaw lowrank(int64_t n, int64_t d, const Knobs& k) {
  const torch::Tensor w = std::get<0>(torch::linalg_qr(torch::randn({d, d}, torch::kDouble)));
  const torch::Tensor s = torch::arange(1, d + 1, torch::kDouble).pow(-k.alpha);
  const torch::Tensor basis = s.unsqueeze(1) * w.t();  // [d, d]: row j = s_j w_j
  const double norm = std::sqrt(s.pow(2).sum().item<double>());
  const double rho = k.rho;
  auto sample = [basis, norm, rho, d](int64_t m) {
    return torch::matmul(torch::randn({m, d}, torch::kDouble), basis) * (rho / norm);
  };
  return {sample(n), sample};
}

// lookup(rho): random keys of norm rho (near-orthogonal in high dimension), queries = copies of random keys: each
// query's attention sits on its own key, so no m < n entries reproduce every query (spec section 2: flat spectrum).
HeadLaw lookup(int64_t n, int64_t d, const Knobs& k) {
  const torch::Tensor keys = k.lookup_rho * unit_rows(torch::randn({n, d}, torch::kDouble));
  auto sample = [keys](int64_t m) { return keys.index_select(0, torch::randint(keys.size(0), {m}, torch::kInt64)); };
  return {keys, sample};
}

// sinks(s, gap): queries rho * unit(mu + 0.5 noise) around a mean direction mu; keys random of norm rho except
// the first s (positions 0..s-1, where models put their sinks), which are (gap * sqrt(d) / rho) mu: a query along mu
// gives them logit gap, so they carry most of the mass.
HeadLaw sinks(int64_t n, int64_t d, const Knobs& k) {
  const torch::Tensor mu = unit_rows(torch::randn({1, d}, torch::kDouble));
  torch::Tensor keys = k.rho * unit_rows(torch::randn({n, d}, torch::kDouble));
  const int64_t s = std::min(k.sinks, n);
  keys.narrow(0, 0, s).copy_((k.sink_gap * std::sqrt(double(d)) / k.rho) * mu.expand({s, d}));
  const double rho = k.rho;
  auto sample = [mu, rho, d](int64_t m) {
    return rho * unit_rows(mu + 0.5 / std::sqrt(double(d)) * torch::randn({m, d}, torch::kDouble));
  };
  return {keys, sample};
}

// recency(alpha) for positions first..n-1 of a sequence of n: a fixed direction u carries position, the rest is
// content. Queries have u-coordinate sqrt(d) (so scale * that = 1) and content of norm 4; key i has u-coordinate
// alpha * log(n / (n - i)) and content of norm 4. Then scale q.k_i = alpha log(n / (n - i)) + a small content term:
// attention ~ (n - i)^-alpha for queries at the end of the sequence (a per-key position component, not a rotary
// rotation: every test query sits after position n - 1, where this is the law of a decaying attention).
HeadLaw recency(int64_t n, int64_t first, int64_t d, const Knobs& k) {
  const torch::Tensor u = unit_rows(torch::randn({1, d}, torch::kDouble));
  auto content = [u, d](int64_t m) {  // norm 4, orthogonal to u
    const torch::Tensor g = torch::randn({m, d}, torch::kDouble);
    return 4.0 * unit_rows(g - torch::matmul(g, u.t()) * u);
  };
  const torch::Tensor i = torch::arange(first, n, torch::kDouble);
  const torch::Tensor coord = k.recency_alpha * torch::log(double(n) / (double(n) - i));  // [n - first]
  const torch::Tensor keys = content(n - first) + coord.unsqueeze(1) * u;
  auto sample = [u, content, d](int64_t m) { return content(m) + std::sqrt(double(d)) * u; };
  return {keys, sample};
}

// mixture: four blocks of positions [clustered | lowrank | lookup | recency] (recency last: its keys are the
// newest); each query comes from one of the four laws, chosen uniformly.
HeadLaw mixture(int64_t n, int64_t d, const Knobs& k) {
  const int64_t q4 = n / 4;
  std::vector<HeadLaw> parts{clustered(q4, d, k), lowrank(q4, d, k), lookup(q4, d, k), recency(n, 3 * q4, d, k)};
  std::vector<torch::Tensor> keys;
  for (const auto& p : parts) keys.push_back(p.keys);
  auto sample = [parts, d](int64_t m) {
    std::vector<torch::Tensor> all;
    for (const auto& p : parts) all.push_back(p.draw(m));
    const torch::Tensor stacked = torch::stack(all);  // [4, m, d]
    const torch::Tensor which = torch::randint(4, {m}, torch::kInt64);
    return stacked.index({which, torch::arange(m, torch::kInt64)});
  };
  return {torch::cat(keys), sample};
}

const std::vector<std::string> kGenerators{"clustered", "lowrank", "lookup", "sinks", "recency", "mixture"};

HeadLaw make_law(const std::string& name, int64_t n, int64_t d, const Knobs& k) {
  if (name == "clustered") return clustered(n, d, k);
  if (name == "lowrank") return lowrank(n, d, k);
  if (name == "lookup") return lookup(n, d, k);
  if (name == "sinks") return sinks(n, d, k);
  if (name == "recency") return recency(n, 0, d, k);
  if (name == "mixture") return mixture(n, d, k);
  throw std::invalid_argument("unknown generator " + name);
}

// Values [n, dv] fp64: "gaussian" N(0, I), or "correlated" v = A k / mean||k|| * sqrt(dv) + 0.5 noise with A
// Gaussian [dv, d] / sqrt(d) (values that follow the keys expose scorers that look at keys and attention only).
torch::Tensor make_values(const std::string& kind, const torch::Tensor& keys, int64_t dv) {
  const int64_t n = keys.size(0), d = keys.size(1);
  if (kind == "gaussian") return torch::randn({n, dv}, torch::kDouble);
  const torch::Tensor a = torch::randn({dv, d}, torch::kDouble) / std::sqrt(double(d));
  const double mean_norm = keys.norm(2, 1).mean().item<double>();
  return torch::matmul(keys, a.t()) * (std::sqrt(double(dv)) / mean_norm) + 0.5 * torch::randn({n, dv}, torch::kDouble);
}

// Softmax attention of q [H, m, d] over keys [H, L, d] with bias [H, L]: out [H, m, dv] and lse [H, m].
std::pair<torch::Tensor, torch::Tensor> attend(const torch::Tensor& q, const torch::Tensor& keys,
                                               const torch::Tensor& values, const torch::Tensor& bias, double scale) {
  const torch::Tensor logits = scale * torch::matmul(q, keys.transpose(1, 2)) + bias.unsqueeze(1);
  return {torch::matmul(torch::softmax(logits, -1), values), torch::logsumexp(logits, -1)};
}

uint64_t seed_of(size_t generator, int64_t seed, int64_t what) {
  return 1000003ULL * (generator + 1) + 7919ULL * static_cast<uint64_t>(seed) + static_cast<uint64_t>(what);
}

// One (generator, values, seed) instance for H heads, shared by every policy and budget.
struct Instance {
  torch::Tensor keys, values;  // [H, n, d], [H, n, dv] fp64
  torch::Tensor observed;      // [W, H, d] fp64: the queries at positions n-W..n-1 the policy sees
  torch::Tensor radius;        // [H] fp64: the largest observed query norm (bound of needles and adversaries)
  std::map<std::string, torch::Tensor> tests;  // family -> [H, m, d] fp64
  std::map<std::string, std::pair<torch::Tensor, torch::Tensor>> full;  // family -> full attention (out, lse)
  // What the in-distribution attention looks like (to read the tables by): mean over queries and heads of the
  // perplexity exp(entropy) of the attention (entries a query effectively reads), and of the mass on the top 5%.
  double perplexity = 0, top5_mass = 0;
  torch::Tensor adv_init;      // [H, R, d] fp64: adversarial restarts, inside the ball
};

const std::vector<std::string> kFamilies{"in-dist", "shifted", "needle", "adversarial"};

Instance make_instance(size_t g, const std::string& values_kind, int64_t seed, int64_t n, int64_t d, int64_t heads,
                       int64_t window, int64_t m, int64_t restarts, const Knobs& knobs, double scale) {
  Instance in;
  std::vector<torch::Tensor> keys, values, observed, radius, indist, shifted, needle, init;
  for (int64_t h = 0; h < heads; ++h) {
    torch::manual_seed(seed_of(g, seed, 100 * h));
    const HeadLaw law = make_law(kGenerators[g], n, d, knobs);
    keys.push_back(law.keys);
    const torch::Tensor obs = law.draw(window);
    observed.push_back(obs);
    const double rho = obs.norm(2, 1).max().item<double>();
    radius.push_back(torch::full({1}, rho, torch::kDouble));
    indist.push_back(law.draw(m));
    // Shifted: each coordinate scaled by exp(0.5 xi) (covariance change) plus an offset of half the mean query
    // norm along a random direction (mean change); fixed per head.
    const torch::Tensor fresh = law.draw(m);
    const torch::Tensor xi = torch::randn({d}, torch::kDouble);
    const torch::Tensor dir = unit_rows(torch::randn({1, d}, torch::kDouble));
    shifted.push_back(fresh * torch::exp(0.5 * xi) + 0.5 * fresh.norm(2, 1).mean() * dir);
    // Needles: rho * unit(k_i) for uniform i (evicted ones included: the cache holds a fraction of them).
    const torch::Tensor idx = torch::randint(n, {m}, torch::kInt64);
    needle.push_back(rho * unit_rows(law.keys.index_select(0, idx)));
    // Adversarial restarts: half fresh in-distribution draws, half uniform directions, all scaled into the ball.
    const int64_t half = restarts / 2;
    torch::Tensor start = torch::cat({law.draw(half), torch::randn({restarts - half, d}, torch::kDouble)});
    start = unit_rows(start) * rho * 0.9;
    init.push_back(start);
    torch::manual_seed(seed_of(g, seed, 100 * h + 50));  // values: same keys for both kinds
    values.push_back(make_values(values_kind, law.keys, d));
  }
  // Rounded to the fp32 the cache stores, so that the reference is the full cache as stored and budget 1 gives
  // error 0 exactly: the errors are those of compression, not of the storage dtype.
  in.keys = torch::stack(keys).to(torch::kFloat).to(torch::kDouble);
  in.values = torch::stack(values).to(torch::kFloat).to(torch::kDouble);
  in.observed = torch::stack(observed, 1);
  in.radius = torch::cat(radius);
  in.tests["in-dist"] = torch::stack(indist);
  in.tests["shifted"] = torch::stack(shifted);
  in.tests["needle"] = torch::stack(needle);
  in.adv_init = torch::stack(init);
  // The full attention of the fixed test queries is the same for every policy and budget: computed once.
  const torch::Tensor zero_bias = torch::zeros({heads, n}, torch::kDouble);
  for (const auto& item : in.tests) in.full[item.first] = attend(item.second, in.keys, in.values, zero_bias, scale);
  const torch::Tensor p = torch::softmax(scale * torch::matmul(in.tests["in-dist"], in.keys.transpose(1, 2)), -1);
  in.perplexity = torch::exp(-(p * torch::log(p.clamp_min(1e-300))).sum(-1)).mean().item<double>();
  const int64_t top = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(0.05 * double(n))));
  in.top5_mass = std::get<0>(p.topk(top, -1)).sum(-1).mean().item<double>();
  return in;
}

// A compressed cache as padded tensors: keys [H, L, d], values [H, L, dv], bias [H, L] (-inf on padding), fp64.
struct Compressed {
  torch::Tensor keys, values, bias;
  std::vector<int64_t> lengths;
  double bytes_ratio = 1;
};

// Builds the fp32 cache at positions 0..n-1, shows the policy the observed queries (KvObservations::observe, as a
// DecodeSession would after a prefill), runs one compression step and reads back what each head keeps.
Compressed compress(const Instance& in, const std::shared_ptr<KvPolicy>& policy, double scale) {
  const int64_t heads = in.keys.size(0), n = in.keys.size(1), d = in.keys.size(2), w = in.observed.size(0);
  KvCache cache(KvCacheSpec{1, heads, d, in.values.size(2), torch::kFloat});
  cache.append(0, in.keys.transpose(0, 1).to(torch::kFloat), in.values.transpose(0, 1).to(torch::kFloat),
               torch::arange(n, torch::kInt64));
  const double before = static_cast<double>(cache.bytes());
  std::unique_ptr<KvObservations> obs;
  if (policy->needs().any()) {
    obs = std::make_unique<KvObservations>(1, heads, policy->needs());
    obs->observe(0, in.observed.to(torch::kFloat), torch::arange(n - w, n, torch::kInt64), cache, scale);
  }
  policy->after_step(cache, KvStep{true, 0, n, obs.get()});
  Compressed c;
  c.bytes_ratio = static_cast<double>(cache.bytes()) / before;
  int64_t longest = 1;
  for (int64_t h = 0; h < heads; ++h) {
    c.lengths.push_back(cache.length(0, h));
    longest = std::max(longest, c.lengths.back());
  }
  c.keys = torch::zeros({heads, longest, d}, torch::kDouble);
  c.values = torch::zeros({heads, longest, in.values.size(2)}, torch::kDouble);
  c.bias = torch::full({heads, longest}, -std::numeric_limits<double>::infinity(), torch::kDouble);
  for (int64_t h = 0; h < heads; ++h) {
    const KvHeadView v = cache.view(0, h);
    const int64_t len = v.length();
    if (len == 0) continue;
    c.keys[h].narrow(0, 0, len).copy_(v.keys.to(torch::kDouble));
    c.values[h].narrow(0, 0, len).copy_(v.values.to(torch::kDouble));
    c.bias[h].narrow(0, 0, len).copy_(v.bias.to(torch::kDouble));
  }
  return c;
}

// Per-query errors of one family: relative output error and mass error, [H, m] each.
struct FamilyErrors {
  torch::Tensor rel, mass;
};

FamilyErrors errors(const std::string& family, const Instance& in, const Compressed& c, double scale) {
  const torch::Tensor& q = in.tests.at(family);
  const auto& full = in.full.at(family);
  const auto comp = attend(q, c.keys, c.values, c.bias, scale);
  return {(comp.first - full.first).norm(2, -1) / full.first.norm(2, -1).clamp_min(1e-300),
          (comp.second - full.second).abs()};
}

// Adversarial queries: projected gradient ascent on ||o~(q) - o(q)|| over ||q|| <= radius (per head), Adam (step
// 0.05 radius) from every restart, `steps` steps; returns per compressed cache, per (head, restart) the largest
// relative error at any iterate (each iterate is a feasible query) and the mass error there. All caches of an
// instance run as one batch (a [caches x heads, restarts, d] problem): Adam is elementwise and the objective a sum
// of independent terms, so every (cache, head, restart) follows the trajectory it would follow alone, at a fraction
// of the per-step overhead.
std::vector<FamilyErrors> adversarial(const Instance& in, const std::vector<Compressed>& cs, double scale,
                                      int64_t steps) {
  const int64_t count = static_cast<int64_t>(cs.size()), heads = in.keys.size(0);
  int64_t longest = 1;
  for (const auto& c : cs) longest = std::max(longest, c.keys.size(1));
  std::vector<torch::Tensor> keys, values, bias;
  for (const auto& c : cs) {  // pad every cache to the longest: zero keys and values with bias -inf weigh nothing
    const int64_t pad = longest - c.keys.size(1);
    keys.push_back(torch::constant_pad_nd(c.keys, {0, 0, 0, pad}));
    values.push_back(torch::constant_pad_nd(c.values, {0, 0, 0, pad}));
    bias.push_back(torch::constant_pad_nd(c.bias, {0, pad}, -std::numeric_limits<double>::infinity()));
  }
  // fp32: the ascent is matmul-bound and only locates bad queries; the keys and values are the cache's fp32
  // values, so budget 1 is still exact (the same products on the same numbers).
  const auto f32 = torch::kFloat;
  const torch::Tensor ck = torch::cat(keys).to(f32), cv = torch::cat(values).to(f32), cb = torch::cat(bias).to(f32);
  const torch::Tensor fk = in.keys.repeat({count, 1, 1}).to(f32), fv = in.values.repeat({count, 1, 1}).to(f32);
  const torch::Tensor fb = torch::zeros({count * heads, in.keys.size(1)}, f32);
  const torch::Tensor radius = in.radius.repeat({count}).view({-1, 1, 1}).to(f32);
  // The ascent runs on u = q / radius (||u|| <= 1), so one Adam step size fits every head's radius.
  torch::Tensor u = (in.adv_init.repeat({count, 1, 1}).to(f32) / radius).clone().requires_grad_(true);
  torch::optim::Adam adam({u}, torch::optim::AdamOptions(0.05));
  torch::Tensor best_rel = torch::zeros({count * heads, in.adv_init.size(1)}, f32);
  torch::Tensor best_mass = best_rel.clone();
  for (int64_t step = 0; step <= steps; ++step) {
    const torch::Tensor query = u * radius;
    const auto full = attend(query, fk, fv, fb, scale);
    const auto comp = attend(query, ck, cv, cb, scale);
    const torch::Tensor diff = (comp.first - full.first).norm(2, -1);  // [C*H, R]
    {
      torch::NoGradGuard ng;
      const torch::Tensor rel = diff / full.first.norm(2, -1).clamp_min(1e-30);
      const torch::Tensor better = rel > best_rel;
      best_rel = torch::where(better, rel, best_rel);
      best_mass = torch::where(better, (comp.second - full.second).abs(), best_mass);
    }
    if (step == steps) break;
    adam.zero_grad();
    (-diff.sum()).backward();
    adam.step();
    torch::NoGradGuard ng;
    u.div_(u.norm(2, -1, true).clamp_min(1.0));  // project back into the unit ball
  }
  std::vector<FamilyErrors> out;
  for (int64_t i = 0; i < count; ++i) {
    out.push_back({best_rel.narrow(0, i * heads, heads).to(torch::kDouble),
                   best_mass.narrow(0, i * heads, heads).to(torch::kDouble)});
  }
  return out;
}

double nearest_rank(const torch::Tensor& x, double p) {
  const torch::Tensor s = std::get<0>(x.flatten().sort());
  const int64_t k = std::max<int64_t>(0, static_cast<int64_t>(std::ceil(p * double(s.numel()))) - 1);
  return s[k].item<double>();
}

struct Stats {
  double mean = 0, p95 = 0, max = 0, mass = 0;
};

Stats stats(const torch::Tensor& rel, const torch::Tensor& mass) {
  return {rel.mean().item<double>(), nearest_rank(rel, 0.95), rel.max().item<double>(), mass.mean().item<double>()};
}

// Results of one (generator, values, policy, budget), per seed: per family the errors [H, m].
struct Cell {
  std::vector<std::map<std::string, FamilyErrors>> seeds;
  std::vector<double> bytes;
};

// ---- minimax calibration: the policy's own estimates against what was measured (MinimaxKvPolicy::risks(),
// KvPolicy::abstained_heads(); spec section 7.1 "calibration" and "abstain precision/recall") ----

// One (generator, values, seed, budget, head) of the minimax policy: its own estimate and what was measured.
struct MinimaxRecord {
  std::string generator, values;
  int64_t seed, head;
  double budget, tail, error;  // its estimates: KvHeadRisk::tail (spectral tail) and ::error (predicted RMS error)
  double worst;                // the measured worst relative error of the head over every query family
  bool abstained;               // in abstained_heads()
  int64_t kept;
};

// Reads the minimax policy's per-head estimates after its compression of the instance (layer 0: risks()[head])
// and pairs them with the head's measured worst relative error over every query family. No-op for other policies.
void record_minimax(const std::shared_ptr<KvPolicy>& policy, const std::map<std::string, FamilyErrors>& fam,
                    const std::string& generator, const std::string& values, int64_t seed, double budget,
                    std::vector<MinimaxRecord>& out) {
  const auto mm = std::dynamic_pointer_cast<MinimaxKvPolicy>(policy);
  if (!mm) return;
  const std::vector<KvHeadRisk>& risks = mm->risks();
  const auto abstained = policy->abstained_heads();
  const int64_t heads = fam.begin()->second.rel.size(0);
  for (int64_t h = 0; h < heads && h < static_cast<int64_t>(risks.size()); ++h) {
    double worst = 0;
    for (const auto& item : fam) worst = std::max(worst, item.second.rel[h].max().item<double>());
    const bool abst = std::find(abstained.begin(), abstained.end(), std::pair<int64_t, int64_t>(0, h)) !=
                      abstained.end();
    const KvHeadRisk& r = risks[static_cast<size_t>(h)];
    if (r.kept == 0) continue;  // the head was within its budget (budget 1): nothing was compressed or estimated
    out.push_back({generator, values, seed, h, budget, r.tail, r.error, worst, abst, r.kept});
  }
}

// Spearman rank correlation (average ranks for ties) of x and y.
double spearman(const std::vector<double>& x, const std::vector<double>& y) {
  auto ranks = [](const std::vector<double>& v) {
    std::vector<size_t> idx(v.size());
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
    std::sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return v[a] < v[b]; });
    std::vector<double> r(v.size());
    for (size_t i = 0; i < idx.size();) {
      size_t j = i;
      while (j + 1 < idx.size() && v[idx[j + 1]] == v[idx[i]]) ++j;
      for (size_t k = i; k <= j; ++k) r[idx[k]] = 0.5 * double(i + j);
      i = j + 1;
    }
    return r;
  };
  const std::vector<double> rx = ranks(x), ry = ranks(y);
  const double n = double(x.size());
  double mx = 0, my = 0;
  for (size_t i = 0; i < x.size(); ++i) mx += rx[i] / n, my += ry[i] / n;
  double sxy = 0, sxx = 0, syy = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    sxy += (rx[i] - mx) * (ry[i] - my);
    sxx += (rx[i] - mx) * (rx[i] - mx);
    syy += (ry[i] - my) * (ry[i] - my);
  }
  return sxx > 0 && syy > 0 ? sxy / std::sqrt(sxx * syy) : std::nan("");
}

// Markdown: per budget and over all, Spearman rank correlation of each estimate (tail, predicted error) with
// the measured worst relative error over (generator, values, seed, head), abstention precision / recall with
// "should abstain" = the head is from `lookup`; then per generator and budget what the estimates said.
std::string minimax_calibration(const std::vector<MinimaxRecord>& recs, const std::vector<double>& budgets,
                                const std::vector<std::string>& generators) {
  std::string md =
      "\n### minimax: its estimates against the measured worst case\n\n"
      "Per (generator, values, seed, head) at each budget: the policy's estimated spectral tail (KvHeadRisk::tail) "
      "and predicted error (KvHeadRisk::error) against the head's measured worst relative error over all four query "
      "families (Spearman rank correlation), and its abstentions against \"should abstain\" = the head is from "
      "`lookup`. The correlations are over the heads it compressed (an abstained head keeps everything: error 0, no "
      "prediction); heads at budget 1 (nothing compressed) are left out.\n\n| budget | heads | compressed | "
      "Spearman(tail, worst) | Spearman(predicted error, worst) | abstained | precision | recall |\n"
      "|---|---|---|---|---|---|---|---|\n";
  std::vector<double> all_budgets = budgets;
  all_budgets.push_back(-1);  // all budgets together
  for (double b : all_budgets) {
    std::vector<double> tail, err, worst;
    int64_t abst = 0, hit = 0, lookup = 0, total = 0;
    for (const auto& r : recs) {
      if (b >= 0 && r.budget != b) continue;
      // The estimates describe the summary the head got: an abstained head kept everything (error 0 by
      // construction, no predicted error), so the correlations run over the compressed heads only.
      if (!r.abstained) {
        tail.push_back(r.tail);
        err.push_back(r.error);
        worst.push_back(r.worst);
      }
      ++total;
      const bool should = r.generator == "lookup";
      abst += r.abstained;
      lookup += should;
      hit += r.abstained && should;
    }
    if (total == 0) continue;
    md += fmt::format("| {} | {} | {} | {:.3f} | {:.3f} | {} | {} | {} |\n",
                      b >= 0 ? fmt::format("{}", b) : std::string("all"), total, tail.size(), spearman(tail, worst),
                      spearman(err, worst), abst,
                      abst ? fmt::format("{:.3f}", double(hit) / double(abst)) : std::string("-"),
                      lookup ? fmt::format("{:.3f}", double(hit) / double(lookup)) : std::string("-"));
  }
  md += "\n| generator | budget | mean tail | mean predicted error | abstained heads | mean kept entries | mean measured worst |"
        "\n|---|---|---|---|---|---|---|\n";
  for (const auto& g : generators) {
    for (double b : budgets) {
      double tail = 0, err = 0, kept = 0, worst = 0;
      int64_t count = 0, abst = 0;
      for (const auto& r : recs) {
        if (r.generator != g || r.budget != b) continue;
        tail += r.tail, err += r.error, kept += double(r.kept), worst += r.worst;
        abst += r.abstained;
        ++count;
      }
      if (count == 0) continue;
      const double c = double(count);
      md += fmt::format("| {} | {} | {:.3f} | {:.3f} | {} / {} | {:.0f} | {:.3f} |\n", g, b, tail / c, err / c, abst,
                        count, kept / c, worst / c);
    }
  }
  return md;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t comma = s.find(',', start);
    const std::string item = s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!item.empty()) out.push_back(item);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("KV-cache policies on synthetic caches (operator tier, no model): output and mass errors");
  int64_t n = 1024, head_dim = 64, heads = 4, seeds = 5, queries = 256, window = 64, restarts = 8, steps = 50;
  int64_t threads = 1;
  std::vector<double> budgets{0.05, 0.1, 0.25, 0.5};
  std::string policies_arg = "window,h2o,snapkv,tova,expected-attention,adakv-snapkv,minimax";
  std::string generators_arg = "clustered,lowrank,lookup,sinks,recency,mixture";
  std::string values_arg = "gaussian,correlated";
  std::string out;
  bool check = false;
  Knobs knobs;
  app.add_option("--n", n, "cache entries per head (positions 0..n-1)")->check(CLI::Range(8, 1 << 20));
  app.add_option("--head-dim", head_dim, "key and value dimension")->check(CLI::Range(2, 1024));
  app.add_option("--heads", heads, "KV heads (independent draws of the generator)")->check(CLI::Range(1, 256));
  app.add_option("--seeds", seeds, "seeds per generator")->check(CLI::Range(1, 1000));
  app.add_option("--budgets", budgets, "budget ratios in (0, 1]")->check(CLI::Range(1e-6, 1.0))->delimiter(',');
  app.add_option("--policies", policies_arg, "comma list of make_kv_policy names (an unknown one is skipped with a note)");
  app.add_option("--generators", generators_arg, "comma list of clustered,lowrank,lookup,sinks,recency,mixture");
  app.add_option("--values", values_arg, "comma list of gaussian,correlated");
  app.add_option("--queries", queries, "queries per head in each of in-dist, shifted, needle")->check(CLI::Range(1, 1 << 20));
  app.add_option("--observed", window, "observed queries the policy sees (the last W positions)")->check(CLI::Range(1, 1 << 20));
  app.add_option("--restarts", restarts, "adversarial restarts per head")->check(CLI::Range(1, 1024));
  app.add_option("--steps", steps, "adversarial ascent steps")->check(CLI::Range(0, 100000));
  app.add_option("--threads", threads, "torch threads")->check(CLI::Range(1, 256));
  app.add_option("--out", out, "write PREFIX.md and PREFIX.csv");
  app.add_flag("--check", check,
               "exit 1 unless every policy at budget 1 has error 0 and window at budget <= 0.1 on lookup has worst "
               "relative error > 0.1 (the smoke test)");
  app.add_option("--clusters", knobs.clusters, "clustered: centres")->check(CLI::Range(1, 1 << 20));
  app.add_option("--sigma", knobs.sigma, "clustered: noise norm")->check(CLI::Range(0.0, 100.0));
  app.add_option("--rho", knobs.rho, "clustered/lowrank/sinks: key and query norm")->check(CLI::Range(1e-3, 1e3));
  app.add_option("--alpha", knobs.alpha, "lowrank: singular value decay j^-alpha")->check(CLI::Range(0.0, 10.0));
  app.add_option("--lookup-rho", knobs.lookup_rho, "lookup: key and query norm")->check(CLI::Range(1e-3, 1e3));
  app.add_option("--sink-gap", knobs.sink_gap, "sinks: sink logit along the mean query")->check(CLI::Range(0.0, 1e3));
  app.add_option("--recency-alpha", knobs.recency_alpha, "recency: attention ~ distance^-alpha")->check(CLI::Range(0.0, 10.0));
  CLI11_PARSE(app, argc, argv);
  if (window > n) {
    fmt::print(stderr, "--observed {} must be at most --n {}\n", window, n);
    return 2;
  }
  torch::set_num_threads(static_cast<int>(threads));
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));

  std::vector<size_t> gens;
  for (const auto& g : split(generators_arg)) {
    const auto it = std::find(kGenerators.begin(), kGenerators.end(), g);
    if (it == kGenerators.end()) {
      fmt::print(stderr, "unknown generator {} (valid: clustered,lowrank,lookup,sinks,recency,mixture)\n", g);
      return 2;
    }
    gens.push_back(static_cast<size_t>(it - kGenerators.begin()));
  }
  const std::vector<std::string> value_kinds = split(values_arg);
  for (const auto& v : value_kinds) {
    if (v != "gaussian" && v != "correlated") {
      fmt::print(stderr, "unknown values {} (valid: gaussian,correlated)\n", v);
      return 2;
    }
  }
  // A policy make_kv_policy does not know (minimax before it lands) is skipped, said once, not an error.
  std::vector<std::string> policies;
  for (const auto& p : split(policies_arg)) {
    try {
      make_kv_policy(p, {{"budget", budgets.front()}});
      policies.push_back(p);
    } catch (const std::invalid_argument& e) {
      fmt::print(stderr, "note: skipping policy {}: {}\n", p, e.what());
    }
  }
  if (policies.empty() || gens.empty() || value_kinds.empty()) {
    fmt::print(stderr, "nothing to run\n");
    return 2;
  }

  // cells[(generator, values, policy, budget)]
  std::map<std::tuple<size_t, std::string, std::string, double>, Cell> cells;
  std::map<std::pair<size_t, std::string>, std::pair<double, double>> profile;  // mean perplexity, top-5% mass
  std::vector<MinimaxRecord> minimax_records;
  torch::NoGradGuard outer_no_grad;  // only the adversarial ascent records gradients (it re-enables them)
  for (size_t g : gens) {
    for (const auto& vk : value_kinds) {
      for (int64_t seed = 0; seed < seeds; ++seed) {
        const Instance in = make_instance(g, vk, seed, n, head_dim, heads, window, queries, restarts, knobs, scale);
        auto& prof = profile[{g, vk}];
        prof.first += in.perplexity / double(seeds);
        prof.second += in.top5_mass / double(seeds);
        std::vector<Compressed> compressed;
        std::vector<std::shared_ptr<KvPolicy>> made;  // kept: minimax's estimates are read after scoring
        for (const auto& p : policies) {
          for (double b : budgets) {
            made.push_back(make_kv_policy(p, {{"budget", b}}));
            compressed.push_back(compress(in, made.back(), scale));
          }
        }
        std::vector<FamilyErrors> adv;
        {
          torch::AutoGradMode grad(true);
          adv = adversarial(in, compressed, scale, steps);
        }
        size_t i = 0;
        for (const auto& p : policies) {
          for (double b : budgets) {
            const Compressed& c = compressed[i];
            std::map<std::string, FamilyErrors> fam;
            for (const auto& item : in.tests) fam[item.first] = errors(item.first, in, c, scale);
            fam["adversarial"] = adv[i];
            record_minimax(made[i], fam, kGenerators[g], vk, seed, b, minimax_records);
            ++i;
            Cell& cell = cells[{g, vk, p, b}];
            cell.seeds.push_back(std::move(fam));
            cell.bytes.push_back(c.bytes_ratio);
          }
        }
      }
      fmt::print(stderr, "done {} / {}\n", kGenerators[g], vk);
    }
  }

  // Tables: one per generator; per family mean / p95 / max pooled over heads and seeds.
  std::string md, csv = "generator,values,policy,budget,seed,family,rel_mean,rel_p95,rel_max,mass_mean,bytes_ratio\n";
  bool ok = true;
  for (size_t g : gens) {
    md += fmt::format("\n### {}\n\n", kGenerators[g]);
    for (const auto& vk : value_kinds) {  // the keys and queries do not depend on the values: one line suffices
      md += fmt::format("Full attention of the in-distribution queries: reads {:.1f} entries (mean perplexity) of {}; "
                        "the top 5% hold {:.1f}% of the mass.\n\n",
                        profile[{g, vk}].first, n, 100 * profile[{g, vk}].second);
      break;
    }
    md += "| values | policy | budget | bytes | in-dist mean / p95 / max | shifted mean / p95 / max | needle mean / p95 / max "
          "| adversarial mean / max | worst | mass err mean |\n|---|---|---|---|---|---|---|---|---|---|\n";
    for (const auto& vk : value_kinds) {
      for (const auto& p : policies) {
        for (double b : budgets) {
          const Cell& cell = cells.at({g, vk, p, b});
          std::map<std::string, Stats> pooled;
          std::vector<torch::Tensor> mass_all;
          double worst = 0;
          for (const auto& fname : kFamilies) {
            std::vector<torch::Tensor> rel, mass;
            for (size_t s = 0; s < cell.seeds.size(); ++s) {
              const FamilyErrors& e = cell.seeds[s].at(fname);
              rel.push_back(e.rel.flatten());
              mass.push_back(e.mass.flatten());
              if (fname != "adversarial") mass_all.push_back(e.mass.flatten());
              const Stats st = stats(e.rel, e.mass);
              csv += fmt::format("{},{},{},{},{},{},{:.6g},{:.6g},{:.6g},{:.6g},{:.6g}\n", kGenerators[g], vk, p, b, s,
                                 fname, st.mean, st.p95, st.max, st.mass, cell.bytes[s]);
            }
            pooled[fname] = stats(torch::cat(rel), torch::cat(mass));
            worst = std::max(worst, pooled[fname].max);
          }
          double bytes = 0;
          for (double x : cell.bytes) bytes += x / static_cast<double>(cell.bytes.size());
          const double mass_mean = torch::cat(mass_all).mean().item<double>();
          auto f3 = [](const Stats& s) { return fmt::format("{:.3f} / {:.3f} / {:.3f}", s.mean, s.p95, s.max); };
          md += fmt::format("| {} | {} | {} | {:.3f} | {} | {} | {} | {:.3f} / {:.3f} | {:.3f} | {:.4f} |\n", vk, p, b,
                            bytes, f3(pooled["in-dist"]), f3(pooled["shifted"]), f3(pooled["needle"]),
                            pooled["adversarial"].mean, pooled["adversarial"].max, worst, mass_mean);
          if (check && b == 1.0 && worst != 0) {
            fmt::print(stderr, "CHECK FAILED: {} at budget 1 on {} has worst error {}\n", p, kGenerators[g], worst);
            ok = false;
          }
          if (check && p == "window" && b <= 0.1 && kGenerators[g] == "lookup" && !(worst > 0.1)) {
            fmt::print(stderr, "CHECK FAILED: window at budget {} on lookup has worst error {} <= 0.1\n", b, worst);
            ok = false;
          }
        }
      }
    }
  }
  if (!minimax_records.empty()) {
    std::vector<std::string> names;
    for (size_t g : gens) names.push_back(kGenerators[g]);
    md += minimax_calibration(minimax_records, budgets, names);
  }
  fmt::print("{}", md);
  if (!out.empty()) {
    std::string command;
    for (int i = 0; i < argc; ++i) command += (i ? " " : "") + std::string(argv[i]);
    std::string cpu = "unknown CPU";
    std::ifstream cpuinfo("/proc/cpuinfo");
    for (std::string line; std::getline(cpuinfo, line);) {
      if (line.rfind("model name", 0) == 0) {
        cpu = line.substr(line.find(':') + 2);
        break;
      }
    }
    std::ofstream(out + ".md") << fmt::format(
        "# KV-cache policies on synthetic caches (operator tier)\n\n```\n{}\n```\n\nMachine: {}, {} hardware "
        "threads, torch threads {}.\n\nColumns: relative output error ||o~ - o|| / ||o|| per query family (mean / p95 "
        "/ max pooled over {} heads x {} seeds), worst = max over all families, mass err = mean |log(D~/D)| over the "
        "non-adversarial queries, bytes = cache bytes after / before.\n{}",
        command, cpu, std::thread::hardware_concurrency(), threads, heads, seeds, md);
    std::ofstream(out + ".csv") << csv;
  }
  if (check) fmt::print(stderr, ok ? "check passed\n" : "check FAILED\n");
  return ok ? 0 : 1;
}
