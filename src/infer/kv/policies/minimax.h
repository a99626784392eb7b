// The minimax policy: weighted summaries under a merge-reduce tree, budgets by predicted error, abstention.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "infer/kv/policies/scorer.h"

namespace dcp {

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
class MinimaxKvPolicy : public KvPolicy {
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
  struct Work;  // one head's block in a layer's compression (minimax.cpp)
  // after_step's phases, each a section of ../shared/specs/kv-cache-compression.md (named at its definition).
  void restart_if_new(const KvCache& cache);
  std::vector<Work> collect_blocks(const KvCache& cache, int64_t layer);
  void assess_head(Work& w, const torch::Tensor& observed, double scale, int64_t layer, int64_t position) const;
  void allocate_budget(std::vector<Work>& work) const;
  void commit_layer(KvCache& cache, int64_t layer, std::vector<Work>& work);

  MinimaxOptions options_;
  int64_t layers_ = 0, heads_ = 0;
  std::vector<HeadState> state_;  // layer-major
  std::vector<KvHeadRisk> risks_;
  std::vector<int64_t> seen_;     // next_position per layer at the last compression (a smaller one = new sequence)
};

}  // namespace dcp
