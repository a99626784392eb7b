// What the queries did, recorded for KV-cache compression policies that score entries by attention (H2O, TOVA,
// SnapKV, Expected Attention; docs/kv_cache.md "Policies"). A DecodeSession records only what its policy
// asks for (KvObservationNeeds); with nothing asked, nothing is recorded and attention runs as without it.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

#include "dcp/kv_cache.h"

namespace dcp {

/// What a policy needs recorded. Both off (the default) = record nothing.
struct KvObservationNeeds {
  /// Keep the last `window` queries of every head of every layer (after rotary, unscaled); 0 = none.
  int64_t window = 0;
  /// Per cached entry the attention probability it received, summed over every query since it was appended
  /// (H2O), and the probability from the latest query alone (TOVA). Costs one extra [T, n] score matrix per
  /// head and layer for a chunk of T tokens over n entries.
  bool attention = false;
  bool any() const { return window > 0 || attention; }
};

/// Recorded observations of one sequence, written by KvCacheAttention after each layer's chunk has attended and
/// been appended, read by policies in KvPolicy::after_step. Per-entry records are kept with the positions
/// they belong to and returned aligned to the cache's current view, so a commit (which drops entries) needs no
/// notice: a dropped entry's record is simply no longer returned. Probabilities are those of softmax(scale q.k +
/// bias) over the entries a query saw (the cache as it then was plus the causal part of its chunk), in fp32.
class KvObservations {
 public:
  /// layers, heads >= 1 (the cache's); throws std::invalid_argument otherwise or for a negative window.
  KvObservations(int64_t layers, int64_t heads, const KvObservationNeeds& needs);

  const KvObservationNeeds& needs() const { return needs_; }

  /// Records a chunk of `layer`: q [T, heads, head_dim] after rotary (any floating dtype), `positions` [T] int64
  /// the chunk's positions, `cache` after the chunk was appended (its last T entries per head are the chunk),
  /// `scale` the softmax scale (> 0). Throws std::invalid_argument for a layer out of range or shapes that do not
  /// fit.
  void observe(int64_t layer, const torch::Tensor& q, const torch::Tensor& positions, const KvCache& cache,
               double scale);

  /// The last min(window, tokens seen) queries of `layer`: [heads, w, head_dim] fp32, oldest first (undefined
  /// before any). Throws std::invalid_argument for a layer out of range.
  const torch::Tensor& window_queries(int64_t layer) const;
  /// Their positions: [w] int64.
  const torch::Tensor& window_positions(int64_t layer) const;
  /// The softmax scale of the recorded queries (0 before any).
  double scale() const { return scale_; }

  /// [n] fp32, aligned to cache.view(layer, head): the attention each entry received summed over all recorded
  /// queries (0 for an entry nobody has attended to yet). Throws std::logic_error when attention is not recorded.
  torch::Tensor accumulated_attention(const KvCache& cache, int64_t layer, int64_t head) const;
  /// [n] fp32, aligned like accumulated_attention: the attention of the latest recorded query of `layer`.
  torch::Tensor last_attention(const KvCache& cache, int64_t layer, int64_t head) const;

  /// Forgets everything (a new sequence).
  void clear();

 private:
  struct Track {
    torch::Tensor positions, accumulated, last;  // [n] each: the entries at the last observe
  };
  const Track& track(const KvCache& cache, int64_t layer, int64_t head, const char* who) const;

  KvObservationNeeds needs_;
  int64_t layers_, heads_;
  double scale_ = 0;
  std::vector<torch::Tensor> queries_, query_positions_;  // per layer
  std::vector<Track> tracks_;                            // layer-major
};

}  // namespace dcp
