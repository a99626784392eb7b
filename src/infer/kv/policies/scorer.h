// The scorer interface of the eviction policies, and their budget: when a policy compresses and how much.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
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
  /// The entries of a head this scorer protects whatever the budget (sinks, the newest entry); 0 when what it
  /// protects is sized inside the budget (H2O's recent share, SnapKV's window) or it protects nothing.
  virtual int64_t protected_entries() const { return 0; }
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

}  // namespace dcp
