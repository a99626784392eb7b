// The window policy's scorer (StreamingLLM): sinks, then recency.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "infer/kv/policies/scorer.h"

namespace dcp {

/// StreamingLLM (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks"): the first
/// n_sink positions are protected, the rest ranked by recency (score = position), so the cache keeps the sinks
/// and the most recent entries. Positions stay as they were (no re-rotation), as kvpress keeps them.
class WindowScorer : public KvScorer {
 public:
  explicit WindowScorer(int64_t n_sink) : n_sink_(n_sink) {}
  torch::Tensor score(const KvCache& cache, const KvObservations*, int64_t layer, int64_t head,
                      int64_t budget) const override;
  int64_t protected_entries() const override { return n_sink_; }

 private:
  int64_t n_sink_;
};

}  // namespace dcp
