// Ada-KV over a scorer: the heads of a layer share their budget.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "infer/kv/policies/scorer.h"

namespace dcp {

/// Ada-KV (Feng et al. 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation"), as kvpress's
/// AdaKVPress: the heads of a layer share kv_heads x per_head entries; each head first gets its top
/// floor(alpha_safeguard x per_head) entries, then the rest goes to the highest scores across all heads of the
/// layer, so heads whose attention is concentrated keep fewer entries and flat heads more. Scores must be
/// comparable across heads (attention probabilities: h2o, snapkv, tova, expected-attention).
class AdaKvPolicy : public KvPolicy {
 public:
  /// Throws std::invalid_argument for a null scorer, ratio outside (0, 1], interval < 1 or alpha_safeguard
  /// outside [0, 1].
  AdaKvPolicy(std::shared_ptr<const KvScorer> scorer, KvBudget budget, double alpha_safeguard);
  void after_step(KvCache& cache, const KvStep& step) override;
  bool compresses_by_layer() const override { return true; }
  void after_layer(KvCache& cache, int64_t layer, const KvStep& step) override;
  KvObservationNeeds needs() const override { return scorer_->needs(); }
  /// The scorer's: the per-head floor is a share of the head's budget.
  int64_t protected_entries() const override { return scorer_->protected_entries(); }
  std::optional<KvBudget> budget() const override { return budget_; }

 private:
  std::shared_ptr<const KvScorer> scorer_;
  KvBudget budget_;
  double alpha_;
};

}  // namespace dcp
