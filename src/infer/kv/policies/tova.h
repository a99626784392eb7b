// The tova policy's scorer: the latest query's attention, averaged over the heads of the layer.
#pragma once

#include <torch/types.h>

#include <cstdint>

#include "infer/kv/policies/scorer.h"

namespace dcp {

/// TOVA (Oren et al. 2024, "Transformers are Multi-State RNNs"), as kvpress's TOVAPress defines it: score =
/// the attention of the latest query averaged over every query head of the layer (each KV head's record is
/// already its group's mean; the KV heads' are averaged, aligned by position), so every head ranks its entries
/// alike; the newest entry (the latest query's own) is protected. Compressing once a head is over budget drops
/// the entries the current query attends to least.
class TovaScorer : public KvScorer {
 public:
  KvObservationNeeds needs() const override { return {0, true}; }
  torch::Tensor score(const KvCache& cache, const KvObservations* observations, int64_t layer, int64_t head,
                      int64_t budget) const override;
  int64_t protected_entries() const override { return 1; }  // the newest entry
};

}  // namespace dcp
