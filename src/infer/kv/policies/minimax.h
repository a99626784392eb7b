// The minimax policy: weighted summaries under a merge-reduce tree, budgets by predicted error, per-block
// abstention, error targets.
#pragma once

#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "infer/kv/policies/scorer.h"

namespace dcp {

/// What minimax estimated for one (layer, head) at its latest compression that gave the head a block.
struct KvHeadRisk {
  double tail = 0;       ///< the block's spectral tail at its budget share (kv_spectral_tail) x the attention share
                         ///< the observed queries give the block, in [0, 1]: what abstain_tail is compared with
  double heldout = 0;    ///< kv_heldout_rel_error of a summary fitted without half of the observed queries, on
                         ///< that half: what abstain_heldout is compared with (0 when off or < 2 observed)
  double error = 0;      ///< predicted RMS first-order output error of the block's summary (KvBlockSummary)
  double rel_error = 0;  ///< the same relative to the head's RMS output (KvBlockSummary::relative_error)
  bool abstained = false;  ///< the block was judged incompressible (an abstention): it got priority from the pool
  bool exact = false;    ///< the block was kept whole (every entry, weight 1)
  int64_t kept = 0;      ///< entries the head held after that compression
  int64_t abstentions = 0;  ///< blocks of the head judged incompressible so far in the sequence
};

/// The newest entries an error target keeps exact per head when recent_tokens is 0: 16, chosen on the calibration
/// split against 32 and 64 (the default before 2026-12-06) for the smallest cache at the chosen points of targets
/// 0.005, 0.01 and 0.02 (bench/results/cpu2_202612_kv_error_targets_recent_calibration.md).
constexpr int64_t kMinimaxTargetRecentTokens = 16;

/// Options of the minimax policy (make_kv_policy("minimax", ...) documents the names and defaults).
struct MinimaxOptions {
  KvBudget budget{1.0, 64, 0};
  // Q = group x window + samples + probes reference queries, 48 each (64 before 2026-12-06; without GQA Q = 144):
  // chosen on the calibration split for speed (bench/results/cpu2_202612_kv_minimax_queries_calibration.md); the
  // Gram of a block of n entries costs Q n^2.
  int64_t window = 48;           ///< observed queries (the last ones of each query head) in the reference set
  int64_t samples = 48;          ///< queries drawn from Gaussians fitted to the observed ones (split over a group)
  int64_t probes = 48;           ///< needle probes: block entries sampled for the compressibility estimate
  int64_t n_sink = 4;            ///< the first positions stay exact
  double recent_fraction = 0.25; ///< share of the head's budget kept as the exact newest entries
  int64_t recent_tokens = 0;     ///< newest entries kept exact at least (with max_rel_error: 0 = kMinimaxTargetRecentTokens)
  double alpha_safeguard = 0.2;  ///< per-head floor of the budget allocation (Ada-KV's)
  double abstain_tail = 0.5;     ///< a block is incompressible when its spectral tail exceeds this (>= 1: never)
  double abstain_heldout = 0;    ///< ... or its held-out relative error exceeds this (0: not computed)
  /// An incompressible block is kept whole even when that exceeds the layer's budget (the earlier behaviour,
  /// per block); false (default): it is served first from the layer's pool, and the policy stays at its budget.
  bool exceed_budget = false;
  /// The no-bias ablation: the same entries as the summary keeps, with their biases left as they were (weight
  /// 1): what selection alone achieves without the weights.
  bool unit_weights = false;
  /// Error target (> 0): every block keeps the fewest entries whose predicted relative output error
  /// (KvBlockSummary::relative_error) is at most this; the budget ratio and the pool are then not used (budget
  /// must be 1). 0: budget mode. `dcp kv-calibrate` maps a bits-per-byte target (kv.max_rel_bpb) to this.
  double max_rel_error = 0;
  bool refit_values = false;     ///< refit the kept values by least squares (synthetic values)
  /// Binary-counter merges (spec 4.4): a new block joins the newest summary of its level and the union is
  /// summarised again. false: a summary is final unless it holds more than its share of the budget (a budget
  /// that stopped growing, max_tokens), so each entry is summarised once at a growing ratio budget. The greedy
  /// path costs about n m^2 for a block of n entries keeping m, and a merged block spans up to half the history.
  bool merge = true;
  /// Screening (ours, a speed device for large shares): a block's summary keeps at most this fraction of the
  /// entries it summarises. Where a head's share of its block is larger (merged blocks at budgets >= 0.25), the
  /// block's entries with the largest G_ii (the first-order error of evicting that entry alone) are kept exact
  /// beforehand, k = ceil((share - f n) / (1 - f)) of them, and the rest is summarised with share - k entries, so
  /// that the greedy path and the fit cost (n - k) (share - k)^2 instead of n share^2. The screened entries leave
  /// the layer's pool first, as the sinks and recent window do, and count towards the head's floor; where the layer
  /// has an incompressible block to serve from the pool, a head screens at most its floor. 1: off. Budget mode only
  /// (not applied with an error target). 0.125: chosen on the calibration split (docs/kv_cache.md, "Speed").
  double max_keep_fraction = 0.125;
  uint64_t seed = 0;             ///< sampled queries and probes
};

/// `minimax`: our reconstruction of "The risk of KV cache compression" (Haverbeck et al. 2026, arXiv
/// 2607.01520; ../shared/specs/kv-cache-compression.md section 4, "MMKV"; docs/kv_cache.md "minimax" says what is
/// reconstruction and where each choice came from). Per (layer, KV head): sinks and the newest
/// max(recent_tokens, ceil(recent_fraction x budget)) entries stay exact; older entries are summarised block by
/// block, causally, with a merge-reduce tree (a new block joins the newest summaries of the same level like a
/// binary counter, and absorbs older summaries that hold more than their share of the budget, as under
/// max_tokens), each summary a subset of the real entries with log-weight biases fitted on reference queries
/// (the group's observed queries, causally masked at their own positions; draws from their Gaussians and needle
/// probes, which come after every entry) by greedy selection and NNLS (KvBlockSummary). The heads of a layer share
/// one pool, kv_heads x the per-head budget minus what they hold outside their blocks (Ada-KV's layer budget):
/// each head's floor first, then blocks judged incompressible (kv_spectral_tail > abstain_tail: lookup-like, or
/// kv_heldout_rel_error > abstain_heldout when set) as much of their block as the pool holds, then the rest by
/// marginal predicted error (a heap over the greedy error curves, extended only as far as the allocation goes).
/// An abstention is per block: the block is kept (exactly, when it fits), and a later merge assesses it again.
/// With exceed_budget an incompressible block is kept whole outside the pool (over budget, reported by the
/// measured bytes); with max_rel_error the blocks are sized by the error target instead of the budget.
class MinimaxKvPolicy : public KvPolicy {
 public:
  /// Throws std::invalid_argument for a budget outside (0, 1], interval < 1, max_tokens < 0, window < 1,
  /// samples, probes, n_sink or recent_tokens < 0, recent_fraction or alpha_safeguard outside [0, 1],
  /// abstain_tail, abstain_heldout or max_rel_error < 0, max_keep_fraction outside (0, 1], and max_rel_error > 0
  /// with a budget below 1 or max_tokens (make_kv_policy also refuses max_keep_fraction given with an error target).
  explicit MinimaxKvPolicy(const MinimaxOptions& options);
  void after_step(KvCache& cache, const KvStep& step) override;
  bool compresses_by_layer() const override { return true; }
  void after_layer(KvCache& cache, int64_t layer, const KvStep& step) override;
  KvObservationNeeds needs() const override { return {options_.window, false}; }
  void reset() override;
  /// The heads with at least one block judged incompressible in this sequence.
  std::vector<std::pair<int64_t, int64_t>> abstained_heads() const override;
  /// n_sink + max(64, recent_tokens): the sinks and the recent window sit outside the layer's pool, so a short
  /// context holds more than its budget's share; 64 bounds that when recent_tokens is below 64 (checked against
  /// the bytes sessions hold by KvReservation.NoSessionHoldsMoreThanItsReservation). With exceed_budget an
  /// incompressible block may hold more still (docs/serve.md counts such sessions).
  std::optional<KvBudget> budget() const override { return options_.budget; }
  int64_t protected_entries() const override {
    return options_.n_sink + std::max<int64_t>(64, options_.recent_tokens);
  }
  /// One per (layer, head), layer-major, as of the latest compression that gave the head a block (empty before
  /// the first).
  const std::vector<KvHeadRisk>& risks() const { return risks_; }
  const MinimaxOptions& options() const { return options_; }

 private:
  struct Segment {
    int64_t start, end;  // positions [start, end)
    int level;
  };
  struct HeadState {
    std::vector<Segment> segments;  // ordered, covering [n_sink, tree_end)
    int64_t tree_end = 0;
    int64_t abstentions = 0;
  };
  struct Work;  // one head's block in a layer's compression (minimax.cpp)
  // after_step's phases, each a section of ../shared/specs/kv-cache-compression.md (named at its definition).
  void restart_if_new(const KvCache& cache);
  std::vector<Work> collect_blocks(const KvCache& cache, int64_t layer, int64_t& pool);
  void screen_block(Work& w, int64_t cap) const;
  void assess_head(Work& w, const KvObservations& obs, int64_t layer, int64_t position) const;
  void allocate_budget(std::vector<Work>& work, int64_t pool, int threads) const;
  void commit_layer(KvCache& cache, int64_t layer, std::vector<Work>& work);

  MinimaxOptions options_;
  int64_t layers_ = 0, heads_ = 0;
  std::vector<HeadState> state_;  // layer-major
  std::vector<KvHeadRisk> risks_;
  std::vector<int64_t> seen_;     // next_position per layer at the last compression (a smaller one = new sequence)
};

}  // namespace dcp
