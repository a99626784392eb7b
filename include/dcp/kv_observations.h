// What the queries did, recorded for KV-cache compression policies that score entries by attention (H2O, TOVA,
// SnapKV, Expected Attention; docs/kv_cache.md "Policies"). A DecodeSession records only what its policy
// asks for (KvObservationNeeds); with nothing asked, nothing is recorded and attention runs as without it.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

#include "dcp/kv_cache.h"

namespace dcp {

/// What a policy needs recorded. All off (the default) = record nothing.
struct KvObservationNeeds {
  /// Keep the last `window` queries of every query head of every layer (after rotary, unscaled); 0 = none.
  int64_t window = 0;
  /// Per cached entry the attention probability it received, summed over every query since it was appended
  /// (H2O), and the probability from the latest query alone (TOVA), each the mean over the query heads that
  /// read the KV head (GQA). Costs one extra [T, n] score matrix per query head and layer for a chunk of T
  /// tokens over n entries.
  bool attention = false;
  /// Running mean and covariance of the queries before rotary, per query head, over every query at a position
  /// >= query_stats_skip (Expected Attention's statistics: kvpress fits them to the prompt's queries after the
  /// first n_sink). Costs head_dim^2 multiply-adds per query and head.
  bool query_stats = false;
  int64_t query_stats_skip = 0;
  bool any() const { return window > 0 || attention || query_stats; }
};

/// Mean and (maximum-likelihood) covariance of the pre-rotary queries of one layer (KvObservations::query_stats).
struct KvQueryStats {
  int64_t count = 0;    ///< queries counted (the same for every head)
  torch::Tensor mean;   ///< [query_heads, head_dim] fp64 (undefined while count is 0)
  torch::Tensor cov;    ///< [query_heads, head_dim, head_dim] fp64: E[(q - mean)(q - mean)^T]
};

/// Recorded observations of one sequence, written by KvCacheAttention after each layer's chunk has attended and
/// been appended, read by policies in KvPolicy::after_step. Per-entry records are kept with the positions
/// they belong to and returned aligned to the cache's current view, so a commit (which drops entries) needs no
/// notice: a dropped entry's record is simply no longer returned. Probabilities are those of softmax(scale q.k +
/// bias) over the entries a query saw (the cache as it then was plus the causal part of its chunk), in fp32.
class KvObservations {
 public:
  /// layers, heads >= 1: the cache's layers and KV heads; query_heads: the model's query heads (0 = heads; else
  /// a multiple of heads, grouped-query attention: query head j reads KV head j / (query_heads / heads));
  /// rope_theta: the model's rotary base (> 0; query_stats undo the rotation with it). Throws
  /// std::invalid_argument otherwise or for a negative window or query_stats_skip.
  KvObservations(int64_t layers, int64_t heads, const KvObservationNeeds& needs, int64_t query_heads = 0,
                 double rope_theta = 10000.0);

  const KvObservationNeeds& needs() const { return needs_; }
  int64_t kv_heads() const { return heads_; }
  int64_t query_heads() const { return query_heads_; }
  /// Query heads per KV head (1 without GQA): KV head h is read by query heads [h x group, (h + 1) x group).
  int64_t group() const { return query_heads_ / heads_; }
  double rope_theta() const { return rope_theta_; }

  /// Records a chunk of `layer`: q [T, query_heads, head_dim] after rotary (any floating dtype), `positions` [T]
  /// int64 the chunk's positions, `cache` after the chunk was appended (its last T entries per head are the
  /// chunk), `scale` the softmax scale (> 0). Throws std::invalid_argument for a layer out of range or shapes
  /// that do not fit.
  void observe(int64_t layer, const torch::Tensor& q, const torch::Tensor& positions, const KvCache& cache,
               double scale);

  /// The last min(window, tokens seen) queries of `layer`: [query_heads, w, head_dim] fp32, oldest first
  /// (undefined before any). Throws std::invalid_argument for a layer out of range.
  const torch::Tensor& window_queries(int64_t layer) const;
  /// Their positions: [w] int64.
  const torch::Tensor& window_positions(int64_t layer) const;
  /// The softmax scale of the recorded queries (0 before any).
  double scale() const { return scale_; }

  /// [n] fp32, aligned to cache.view(layer, head): the attention each entry of KV head `head` received summed
  /// over all recorded queries (each query's the mean over the head's group; 0 for an entry nobody has attended
  /// to yet). Throws std::logic_error when attention is not recorded.
  torch::Tensor accumulated_attention(const KvCache& cache, int64_t layer, int64_t head) const;
  /// [n] fp32, aligned like accumulated_attention: the attention of the latest recorded query of `layer`.
  torch::Tensor last_attention(const KvCache& cache, int64_t layer, int64_t head) const;
  /// last_attention of KV head `head` aligned to `positions` [n] int64 (strictly increasing, e.g. another head's):
  /// 0 for a position the head does not hold (TOVA averages the heads of a layer).
  torch::Tensor last_attention_at(int64_t layer, int64_t head, const torch::Tensor& positions) const;
  /// The pre-rotary query statistics of `layer` (needs().query_stats). Throws std::logic_error when they are not
  /// recorded, std::invalid_argument for a layer out of range.
  KvQueryStats query_stats(int64_t layer) const;

  /// Forgets everything (a new sequence).
  void clear();

 private:
  struct Track {
    torch::Tensor positions, accumulated, last;  // [n] each: the entries at the last observe
  };
  const Track& track(const KvCache& cache, int64_t layer, int64_t head, const char* who) const;

  KvObservationNeeds needs_;
  int64_t layers_, heads_, query_heads_;
  double rope_theta_;
  double scale_ = 0;
  std::vector<torch::Tensor> queries_, query_positions_;  // per layer
  std::vector<Track> tracks_;                            // layer-major, per KV head
  std::vector<int64_t> stats_count_;                     // per layer
  std::vector<torch::Tensor> stats_sum_, stats_outer_;   // per layer: [query_heads, d], [query_heads, d, d] fp64
};

}  // namespace dcp
