// KV-cache compression policies (baselines) for a DecodeSession: a scorer ranks the entries of each (layer, KV
// head), a policy turns scores into kept entries under a budget and commits them. Modelled on NVIDIA kvpress's
// "presses" (a ScorerPress gives per-head scores, wrappers such as AdaKVPress allocate the budget), but with real
// per-head eviction: KvCache::commit reallocates every head to what it keeps. docs/kv_cache.md "Policies" says
// what each one keeps, from which paper, its options and what it records.
//
// Budget: a ratio of the tokens seen. After a compression of layer l every head holds at most
// ceil(budget * next_position(l)) entries (adakv: the layer's heads together hold at most kv_heads times that),
// unless the scorer protects more (sinks, a recent or observation window): protected entries are never evicted.
// Compression runs after every prefill chunk and, while decoding, after every `interval`-th token (when the next
// position is a multiple of interval).
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dcp/kv_policy.h"

namespace dcp {

/// Ranks the entries of one (layer, head). Higher = keep; +infinity = protected (never evicted).
class KvScorer {
 public:
  virtual ~KvScorer() = default;
  /// What the scorer reads from KvObservations (the session records it).
  virtual KvObservationNeeds needs() const { return {}; }
  /// [n] fp32 scores aligned to cache.view(layer, head) (n >= 1). `budget` is the entries this head may keep
  /// (H2O sizes its recent window by it). `observations` is null when needs() is empty; a scorer that needs
  /// them throws std::invalid_argument when they are null or hold no queries of `layer` yet.
  virtual torch::Tensor score(const KvCache& cache, const KvObservations* observations, int64_t layer, int64_t head,
                              int64_t budget) const = 0;
};

/// StreamingLLM (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks"): the first
/// n_sink positions are protected, the rest ranked by recency (score = position), so the cache keeps the sinks
/// and the most recent entries. Positions stay as they were (no re-rotation), as kvpress keeps them.
class WindowScorer : public KvScorer {
 public:
  explicit WindowScorer(int64_t n_sink) : n_sink_(n_sink) {}
  torch::Tensor score(const KvCache& cache, const KvObservations*, int64_t layer, int64_t head,
                      int64_t budget) const override;

 private:
  int64_t n_sink_;
};

/// H2O (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle"): score = attention received, summed over every query
/// since the entry was appended; the newest ceil(recent_fraction * budget) entries are protected (the paper's
/// recent window, half the budget by default).
class H2oScorer : public KvScorer {
 public:
  explicit H2oScorer(double recent_fraction) : recent_fraction_(recent_fraction) {}
  KvObservationNeeds needs() const override { return {0, true}; }
  torch::Tensor score(const KvCache& cache, const KvObservations* observations, int64_t layer, int64_t head,
                      int64_t budget) const override;

 private:
  double recent_fraction_;
};

/// SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation"): the last `window`
/// queries attend over the cache as it is now (softmax with biases, causal by position); score = their mean
/// attention, max-pooled over `kernel` neighbouring entries (odd, stride 1) so that clusters survive together;
/// the entries at the window's own positions are protected.
class SnapKvScorer : public KvScorer {
 public:
  SnapKvScorer(int64_t window, int64_t kernel) : window_(window), kernel_(kernel) {}
  KvObservationNeeds needs() const override { return {window_, false}; }
  torch::Tensor score(const KvCache& cache, const KvObservations* observations, int64_t layer, int64_t head,
                      int64_t budget) const override;

 private:
  int64_t window_, kernel_;
};

/// TOVA (Oren et al. 2024, "Transformers are Multi-State RNNs"): score = attention from the latest query of the
/// head alone (per head, not averaged over heads as in the paper); with interval 1 the argmin is dropped each
/// time the head is over budget.
class TovaScorer : public KvScorer {
 public:
  KvObservationNeeds needs() const override { return {0, true}; }
  torch::Tensor score(const KvCache& cache, const KvObservations* observations, int64_t layer, int64_t head,
                      int64_t budget) const override;
};

/// Expected Attention (Devoto et al. 2025, kvpress ExpectedAttentionPress): future queries are modelled as a
/// Gaussian N(mu, Sigma) fitted to the last `window` queries of the head (after rotary: the keys are stored after
/// rotary, and a recent window sits at positions close to the next ones; kvpress instead fits pre-rotary queries
/// and averages the rotation over the next positions). E[exp(s q.k)] = exp(s mu.k + s^2/2 k^T Sigma k) for scale
/// s; score = the softmax over the head's entries of that log-expectation plus the entry's bias (the expected
/// attention share, comparable across heads for adakv). Positions below n_sink are protected.
class ExpectedAttentionScorer : public KvScorer {
 public:
  ExpectedAttentionScorer(int64_t window, int64_t n_sink) : window_(window), n_sink_(n_sink) {}
  KvObservationNeeds needs() const override { return {window_, false}; }
  torch::Tensor score(const KvCache& cache, const KvObservations* observations, int64_t layer, int64_t head,
                      int64_t budget) const override;

 private:
  int64_t window_, n_sink_;
};

/// When a policy compresses and how much: keep a budget ratio in (0, 1] of the tokens seen, at most max_tokens
/// entries per head (0 = no cap: a fixed total budget, as kvpress's DecodingPress target_size), compress after
/// every prefill chunk and in decoding when the next position is a multiple of interval (>= 1).
struct KvBudget {
  double ratio = 1.0;
  int64_t interval = 1;
  int64_t max_tokens = 0;
  /// Entries one head of `layer` may keep: ceil(ratio * cache.next_position(layer)), capped at max_tokens.
  int64_t per_head(const KvCache& cache, int64_t layer) const;
  bool due(const KvStep& step) const;
};

/// Every head keeps its top per_head entries by the scorer's scores (and every protected one), in their order.
class ScoredKvPolicy : public KvCompressor {
 public:
  /// Throws std::invalid_argument for a null scorer, ratio outside (0, 1] or interval < 1.
  ScoredKvPolicy(std::shared_ptr<const KvScorer> scorer, KvBudget budget);
  void after_step(KvCache& cache, const KvStep& step) override;
  KvObservationNeeds needs() const override { return scorer_->needs(); }

 private:
  std::shared_ptr<const KvScorer> scorer_;
  KvBudget budget_;
};

/// Ada-KV (Feng et al. 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation"), as kvpress's
/// AdaKVPress: the heads of a layer share kv_heads x per_head entries; each head first gets its top
/// floor(alpha_safeguard x per_head) entries, then the rest goes to the highest scores across all heads of the
/// layer, so heads whose attention is concentrated keep fewer entries and flat heads more. Scores must be
/// comparable across heads (attention probabilities: h2o, snapkv, tova, expected-attention).
class AdaKvPolicy : public KvCompressor {
 public:
  /// Throws std::invalid_argument for a null scorer, ratio outside (0, 1], interval < 1 or alpha_safeguard
  /// outside [0, 1].
  AdaKvPolicy(std::shared_ptr<const KvScorer> scorer, KvBudget budget, double alpha_safeguard);
  void after_step(KvCache& cache, const KvStep& step) override;
  KvObservationNeeds needs() const override { return scorer_->needs(); }

 private:
  std::shared_ptr<const KvScorer> scorer_;
  KvBudget budget_;
  double alpha_;
};

/// What minimax estimated for one (layer, head) at its latest compression.
struct KvHeadRisk {
  double tail = 0;       ///< the block's spectral tail at its budget share (kv_spectral_tail) x the attention share
                         ///< the observed queries give the block, in [0, 1]: what abstain_tail is compared with
  double heldout = 0;    ///< kv_heldout_rel_error of a summary fitted without half of the observed queries, on
                         ///< that half: what abstain_heldout is compared with (0 when off or < 2 observed)
  double error = 0;      ///< predicted RMS first-order output error of the block's summary (KvBlockSummary)
  bool abstained = false;  ///< judged incompressible: kept exact from then on
  int64_t kept = 0;      ///< entries the head held after that compression
};

/// Options of the minimax policy (make_kv_policy("minimax", ...) documents the names and defaults).
struct MinimaxOptions {
  KvBudget budget{1.0, 64, 0};
  int64_t window = 64;           ///< observed queries (the last ones of each head) in the reference set
  int64_t samples = 64;          ///< queries drawn from a Gaussian fitted to the observed ones
  int64_t probes = 64;           ///< needle probes: block entries sampled for the compressibility estimate
  int64_t n_sink = 4;            ///< the first positions stay exact
  double recent_fraction = 0.25; ///< share of the head's budget kept as the exact newest entries
  double alpha_safeguard = 0.2;  ///< per-head floor of the budget allocation (Ada-KV's)
  double abstain_tail = 0.5;     ///< abstain when the spectral tail at the budget share exceeds this (>= 1: never)
  double abstain_heldout = 0;    ///< abstain when the held-out relative error exceeds this (0: not computed)
  bool refit_values = false;     ///< refit the kept values by least squares (synthetic values)
  uint64_t seed = 0;             ///< sampled queries and probes
};

/// `minimax`: our reconstruction of "The risk of KV cache compression" (Haverbeck et al. 2026, arXiv
/// 2607.01520; ../shared/specs/kv-cache-compression.md section 4, "MMKV"; docs/kv_cache.md "minimax" says what is
/// reconstruction and where each choice came from). Per (layer, head): sinks and the newest
/// ceil(recent_fraction x budget) entries stay exact; older entries are summarised block by block, causally,
/// with a merge-reduce tree (a new block joins the newest summaries of the same level like a binary counter,
/// and absorbs older summaries that hold more than their share of the budget, as under max_tokens), each
/// summary a subset of the real entries with log-weight biases fitted on reference queries (observed, sampled
/// from their Gaussian, needle probes) by greedy selection and NNLS (KvBlockSummary). The heads of a layer share
/// their budget by marginal predicted error (a heap over the greedy error curves, with a per-head floor). A head
/// whose block the spectral estimate calls incompressible (kv_spectral_tail > abstain_tail: lookup-like), or
/// whose summary at its budget does not carry over to observed queries it was not fitted to
/// (kv_heldout_rel_error > abstain_heldout, when set), is kept exact for the rest of the sequence and reported
/// (abstained_heads()): its budget is exceeded on purpose.
class MinimaxKvPolicy : public KvCompressor {
 public:
  /// Throws std::invalid_argument for a budget outside (0, 1], interval < 1, max_tokens < 0, window < 1,
  /// samples, probes or n_sink < 0, recent_fraction or alpha_safeguard outside [0, 1], abstain_tail or
  /// abstain_heldout < 0.
  explicit MinimaxKvPolicy(const MinimaxOptions& options);
  void after_step(KvCache& cache, const KvStep& step) override;
  KvObservationNeeds needs() const override { return {options_.window, false}; }
  void reset() override;
  std::vector<std::pair<int64_t, int64_t>> abstained_heads() const override;
  /// One per (layer, head), layer-major, as of the latest compression (empty before the first).
  const std::vector<KvHeadRisk>& risks() const { return risks_; }

 private:
  struct Segment {
    int64_t start, end;  // positions [start, end)
    int level;
  };
  struct HeadState {
    std::vector<Segment> segments;  // ordered, covering [n_sink, tree_end)
    int64_t tree_end = 0;
    bool abstained = false;
  };
  MinimaxOptions options_;
  int64_t layers_ = 0, heads_ = 0;
  std::vector<HeadState> state_;  // layer-major
  std::vector<KvHeadRisk> risks_;
  std::vector<int64_t> seen_;     // next_position per layer at the last compression (a smaller one = new sequence)
};

/// Options of make_kv_policy: name -> number (integers where the option counts something).
using KvPolicyOptions = std::map<std::string, double>;

/// The policy `name` with `options` (unset ones take their defaults):
///   full                                   keeps everything (FullKvCache); no options
///   window              budget, interval (1), n_sink (4)
///   h2o                 budget, interval (64), recent_fraction (0.5, in [0, 1])
///   snapkv              budget, interval (64), window (64), kernel (7, odd)
///   tova                budget, interval (1)
///   expected-attention  budget, interval (64), window (64), n_sink (4)
///   adakv-<scorer>      the scorer's options plus alpha_safeguard (0.2, in [0, 1]); <scorer> one of h2o,
///                       snapkv, tova, expected-attention (not window: its scores do not compare across heads)
///   minimax             budget, interval (64), window (64), samples (64), probes (64), n_sink (4),
///                       recent_fraction (0.25), alpha_safeguard (0.2), abstain_tail (0.5, >= 0),
///                       abstain_heldout (0 = off, >= 0),
///                       refit_values (0 or 1), seed (0) (MinimaxKvPolicy)
/// Every policy but full also takes max_tokens (0 = no cap; KvBudget). budget (default 1 = keep all) in (0, 1];
/// interval, window, kernel >= 1; n_sink, max_tokens >= 0. Throws
/// std::invalid_argument naming the policy and the option: an unknown name (listing the valid ones), an option
/// the policy does not take (listing the ones it takes), a value out of range or not an integer.
std::shared_ptr<KvCompressor> make_kv_policy(const std::string& name, const KvPolicyOptions& options = {});

/// The policy of kv.policy / --kv.policy with kv.budget / --kv.budget: a budget in (0, 1] is the fraction of the
/// tokens seen (option budget), a whole number >= 2 a fixed number of entries per head (option max_tokens,
/// fraction 1). `options` are the policy's other options. Throws std::invalid_argument naming the budget when it
/// is neither (0, a fraction above 1, NaN), for policy full with a budget other than 1, and make_kv_policy's
/// errors.
std::shared_ptr<KvCompressor> make_kv_policy_with_budget(const std::string& name, double budget,
                                                         KvPolicyOptions options = {});
/// Adds one "KEY=VALUE" option as written on a command line (`dcp generate --kv.option`, kv-eval's policy
/// specs) to `options`. Throws std::invalid_argument naming the item: no '=' or an empty KEY, a VALUE that is not
/// a finite decimal number (util/number_text.h: no hex, inf or nan), a KEY already in `options`.
void add_kv_policy_option(const std::string& item, KvPolicyOptions& options);

/// A policy name with its options in one string: "NAME" or "NAME:KEY=VALUE[:KEY=VALUE...]", e.g.
/// "minimax:abstain_tail=0.3" (`dcp kv-eval --policies`). Only parsed here: make_kv_policy checks the name and
/// the options. Throws std::invalid_argument naming the spec for an empty name and add_kv_policy_option's errors.
struct KvPolicySpec {
  std::string name;
  KvPolicyOptions options;
};
KvPolicySpec parse_kv_policy_spec(const std::string& spec);

/// Every name make_kv_policy accepts, in the order of its list above (full first, then the baselines, then the
/// adakv-<scorer> variants): what `dcp kv-eval --policies all` runs and what its unknown-name error lists. A new
/// policy is added here and in make_kv_policy together (tests/unit/test_kv_eval.cpp builds every name).
const std::vector<std::string>& kv_policy_names();

}  // namespace dcp
