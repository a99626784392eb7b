// The expected-attention policy's scorer: attention expected from a Gaussian of future queries.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "infer/kv/policies/scorer.h"

namespace dcp {

/// Expected Attention (Devoto et al. 2025, kvpress ExpectedAttentionPress): future queries are modelled as a
/// Gaussian N(mu, Sigma) fitted to the last `window` queries of the head (after rotary: the keys are stored after
/// rotary, and a recent window sits at positions close to the next ones; kvpress instead fits pre-rotary queries
/// and averages the rotation over the next positions). E[exp(s q.k)] = exp(s mu.k + s^2/2 k^T Sigma k) for scale
/// s; score = the softmax over the head's entries of that log-expectation plus the entry's bias (the expected
/// attention share, comparable across heads for adakv). Positions below n_sink are protected.
class ExpectedAttentionScorer : public KvScorer {
 public:
  ExpectedAttentionScorer(int64_t window, int64_t n_sink) : window_(window), n_sink_(n_sink) {}
  KvObservationNeeds needs() const override { return {window_, false}; }
  torch::Tensor score(const KvCache& cache, const KvObservations* observations, int64_t layer, int64_t head,
                      int64_t budget) const override;

 private:
  int64_t window_, n_sink_;
};

}  // namespace dcp
