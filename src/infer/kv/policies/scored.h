// A scorer's eviction policy: every head keeps its top entries.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "infer/kv/policies/scorer.h"

namespace dcp {

/// Every head keeps its top per_head entries by the scorer's scores (and every protected one), in their order.
class ScoredKvPolicy : public KvPolicy {
 public:
  /// Throws std::invalid_argument for a null scorer, ratio outside (0, 1] or interval < 1.
  ScoredKvPolicy(std::shared_ptr<const KvScorer> scorer, KvBudget budget);
  void after_step(KvCache& cache, const KvStep& step) override;
  bool compresses_by_layer() const override { return true; }
  void after_layer(KvCache& cache, int64_t layer, const KvStep& step) override;
  KvObservationNeeds needs() const override { return scorer_->needs(); }
  int64_t protected_entries() const override { return scorer_->protected_entries(); }
  std::optional<KvBudget> budget() const override { return budget_; }

 private:
  std::shared_ptr<const KvScorer> scorer_;
  KvBudget budget_;
};

}  // namespace dcp
