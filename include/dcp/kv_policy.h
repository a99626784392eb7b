// The seam between a decoding session and KV-cache compression: what a policy is told after every step and what
// it may do (commit to the cache). Each policy is one class of src/infer/kv/policies/, built by make_kv_policy
// (dcp/kv_policies.h).
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "dcp/kv_cache.h"
#include "dcp/kv_observations.h"

namespace dcp {

/// What just ran when a KvPolicy is called.
struct KvStep {
  bool prefill = true;         ///< a prefill chunk (else one decoded token)
  int64_t first_position = 0;  ///< absolute position of the step's first token
  int64_t tokens = 0;          ///< tokens the step appended to every head of every layer
  /// What the queries did, recorded as the policy's needs() asked; null when it asked for nothing.
  const KvObservations* observations = nullptr;
};

/// When a policy compresses and how much: keep a budget ratio in (0, 1] of the tokens seen, at most max_tokens
/// entries per head (0 = no cap: a fixed total budget, as kvpress's DecodingPress target_size), compress after
/// every prefill chunk and in decoding when the next position is a multiple of interval (>= 1).
struct KvBudget {
  double ratio = 1.0;
  int64_t interval = 1;
  int64_t max_tokens = 0;
  /// Entries one head of `layer` may keep: ceil(ratio * cache.next_position(layer)), capped at max_tokens.
  int64_t per_head(const KvCache& cache, int64_t layer) const;
  bool due(const KvStep& step) const;
};

/// The seam for KV-cache compression policies (dcp/kv_policies.h; spec sections 4 and 8): called after every
/// prefill chunk and every decoded token, with the whole sequence's cache, and may change it only through
/// KvCache::commit. The next chunk's hidden states are then computed from the compressed cache (true chunked
/// prefill, spec 4.4).
class KvPolicy {
 public:
  virtual ~KvPolicy() = default;
  virtual void after_step(KvCache& cache, const KvStep& step) = 0;
  /// True for a policy whose after_step compresses each layer from that layer's own entries, observations and
  /// per-layer state alone (every policy of make_kv_policy but full). A DecodeSession then calls after_layer(l)
  /// inside the forward, as soon as layer l's chunk has attended, been appended and been observed, instead of
  /// after_step once after the whole forward: the same edits in the same order (a later layer of the forward never
  /// reads layer l's cache, and l's compression reads nothing of a later layer), but at most one layer at a time
  /// holds a whole uncompressed chunk, so a compressing session's peak bytes stay near its budget during a long
  /// prefill (docs/serve.md "Memory"). False (the default): after_step only.
  virtual bool compresses_by_layer() const { return false; }
  /// after_step's work for `layer` alone (called only when compresses_by_layer(), layers in order 0, 1, ... within
  /// one step). The default does nothing.
  virtual void after_layer(KvCache& /*cache*/, int64_t /*layer*/, const KvStep& /*step*/) {}
  /// What the session must record for after_step (KvStep::observations); the default, nothing, costs nothing.
  virtual KvObservationNeeds needs() const { return {}; }
  /// Forgets what the policy kept about the sequence (DecodeSession::reset calls it for a new sequence).
  virtual void reset() {}
  /// The (layer, head) pairs the policy keeps exact because it judged their context incompressible (minimax's
  /// abstention, dcp/kv_policies.h), in layer-major order; empty for a policy that never abstains.
  virtual std::vector<std::pair<int64_t, int64_t>> abstained_heads() const { return {}; }
  /// The entries per (layer, KV head) a compression keeps whatever its budget (the protected entries beyond it,
  /// docs/glossary.md "protected entry"):
  /// after a compression over s tokens a head holds at most min(s, max(its budget's share, protected_entries())).
  /// The serve scheduler reserves memory by it (serve::kv_peak_entries). 0 (the default): the budget alone.
  virtual int64_t protected_entries() const { return 0; }
  /// How much and when the policy compresses, as make_kv_policy built it from its options (the serve scheduler
  /// reserves memory by it); nullopt for a policy that never compresses (full). With minimax's error target
  /// (max_rel_error > 0) the ratio is 1 and max_tokens 0 (its constructor refuses others): the target sizes each
  /// block.
  virtual std::optional<KvBudget> budget() const { return std::nullopt; }
};

/// The policy "full": keeps every entry.
class FullKvPolicy : public KvPolicy {
 public:
  void after_step(KvCache&, const KvStep&) override {}
};

}  // namespace dcp
