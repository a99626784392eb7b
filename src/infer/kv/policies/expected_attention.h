// The expected-attention policy's scorer: attention expected from a Gaussian of future queries.
#pragma once

#include <torch/types.h>

#include <cstdint>

#include "infer/kv/policies/scorer.h"

namespace dcp {

/// Expected Attention (Devoto et al. 2025), as kvpress's ExpectedAttentionPress defines it. Future queries are
/// a Gaussian N(mu, Sigma) per query head, fitted to every query seen so far at a position >= n_sink (the
/// prompt's, then the decoded ones'), **before rotary** (KvObservations' query statistics); the rotation is
/// averaged over the next `n_future` positions (Rbar, kv_mean_rotation), so mu' = Rbar mu, Sigma' = Rbar Sigma
/// Rbar^T. E[exp(s q.k)] = exp(s mu'.k + s^2/2 k^T Sigma' k) for scale s (the Gaussian moment generating
/// function); score = softmax over the head's entries past the sinks of that log-expectation (plus the entry's
/// bias), averaged over the query heads of the KV head's group, times ||v|| (kvpress use_vnorm, epsilon 0).
/// Positions below n_sink are protected.
class ExpectedAttentionScorer : public KvScorer {
 public:
  ExpectedAttentionScorer(int64_t n_future, int64_t n_sink, bool value_norm)
      : n_future_(n_future), n_sink_(n_sink), value_norm_(value_norm) {}
  KvObservationNeeds needs() const override {
    KvObservationNeeds n;
    n.query_stats = true;
    n.query_stats_skip = n_sink_;
    return n;
  }
  torch::Tensor score(const KvCache& cache, const KvObservations* observations, int64_t layer, int64_t head,
                      int64_t budget) const override;
  int64_t protected_entries() const override { return n_sink_; }

 private:
  int64_t n_future_, n_sink_;
  bool value_norm_;
};

}  // namespace dcp
