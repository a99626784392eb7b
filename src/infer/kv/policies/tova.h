// The tova policy's scorer: the latest query's attention.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "infer/kv/policies/scorer.h"

namespace dcp {

/// TOVA (Oren et al. 2024, "Transformers are Multi-State RNNs"): score = attention from the latest query of the
/// head alone (per head, not averaged over heads as in the paper); with interval 1 the argmin is dropped each
/// time the head is over budget.
class TovaScorer : public KvScorer {
 public:
  KvObservationNeeds needs() const override { return {0, true}; }
  torch::Tensor score(const KvCache& cache, const KvObservations* observations, int64_t layer, int64_t head,
                      int64_t budget) const override;
};

}  // namespace dcp
