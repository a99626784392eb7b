// The h2o policy's scorer: heavy hitters by accumulated attention.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "infer/kv/policies/scorer.h"

namespace dcp {

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

}  // namespace dcp
