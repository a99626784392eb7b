// The snapkv policy's scorer: the observation window's pooled attention.
#pragma once

#include <torch/types.h>

#include <cstdint>

#include "infer/kv/policies/scorer.h"

namespace dcp {

/// SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation"), as kvpress's
/// SnapKVPress defines it: the last `window` queries attend over the cache as it is now (softmax with biases,
/// causal by position); score = their mean attention on the entries before the window, average-pooled over
/// `kernel` neighbouring entries (odd, stride 1, zero padding) so that clusters survive together, averaged over
/// the query heads of the KV head's group (GQA, SnapKV issue 22). The window's own entries rank above every
/// other entry but inside the budget: when the budget is smaller than the window, its newest entries are the ones
/// kept (kvpress pads them with the maximum score, so they take budget like any other entry).
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
