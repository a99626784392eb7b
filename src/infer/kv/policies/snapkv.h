// The snapkv policy's scorer: the observation window's pooled attention.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "infer/kv/policies/scorer.h"

namespace dcp {

/// SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation"): the last `window`
/// queries attend over the cache as it is now (softmax with biases, causal by position); score = their mean
/// attention, max-pooled over `kernel` neighbouring entries (odd, stride 1) so that clusters survive together;
/// the entries at the window's own positions are protected.
class SnapKvScorer : public KvScorer {
 public:
  SnapKvScorer(int64_t window, int64_t kernel) : window_(window), kernel_(kernel) {}
  KvObservationNeeds needs() const override { return {window_, false}; }
  torch::Tensor score(const KvCache& cache, const KvObservations* observations, int64_t layer, int64_t head,
                      int64_t budget) const override;

 private:
  int64_t window_, kernel_;
};

}  // namespace dcp
