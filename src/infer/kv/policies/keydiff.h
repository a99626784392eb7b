// The keydiff policy's scorer: key diversity, no query needed.
#pragma once

#include <torch/types.h>

#include <cstdint>

#include "infer/kv/policies/scorer.h"

namespace dcp {

/// KeyDiff (Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference
/// in Resource-Constrained Environments", arXiv 2504.15364), as kvpress's KeyDiffPress defines it: the anchor is
/// the mean of the head's unit-normalised keys; score = minus the cosine similarity of each key with it, so the
/// keys most unlike the rest are kept. Query-agnostic: it reads no observation. Nothing is protected.
class KeyDiffScorer : public KvScorer {
 public:
  torch::Tensor score(const KvCache& cache, const KvObservations* observations, int64_t layer, int64_t head,
                      int64_t budget) const override;
};

}  // namespace dcp
