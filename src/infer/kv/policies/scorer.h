// The scorer interface of the eviction policies (their budget, KvBudget, is in dcp/kv_policy.h).
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

}  // namespace dcp
