// The key/value cache of one sequence for softmax attention: per layer and per KV head its own entries (keys after
// rotary, values, a log-weight bias, the entry's absolute position), so that a compression policy can keep a
// different number of entries in every head and the memory it drops is really released.
//
// Modelled on llama.cpp's KV cache (llama_kv_cache: append a batch's k and v per layer, attend over what is
// cached, remove ranges in place); positions are stored per entry and never renumbered, as StreamingLLM (Xiao et
// al. 2023, "Efficient Streaming Language Models with Attention Sinks") keeps them for a cache with holes; the
// per-entry bias is the "weighted representative" form of ../shared/specs/kv-cache-compression.md sections 2 and 8
// (an entry with bias log w counts like w copies of itself). docs/kv_cache.md describes layout and invariants.
//
// Invariants, for every (layer, head), that append and commit (the only two writes) keep:
// - positions are strictly increasing and below next_position(layer) (entries keep their original order);
// - bias is finite fp32 (0 for a token appended as it was computed);
// - keys [n, head_dim], values [n, value_dim] have the cache's dtype and device; positions int64, bias fp32.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dcp {

/// Shape and storage type of a cache. Every field >= 1 (value_dim 0 = head_dim).
struct KvCacheSpec {
  int64_t layers = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t value_dim = 0;                       ///< 0 = head_dim
  torch::ScalarType dtype = torch::kFloat;     ///< keys and values: kFloat, kDouble or kBFloat16
  torch::Device device = torch::kCPU;
};

/// Read-only view of one (layer, head): the first `length` entries of its storage, no copy. The tensors alias
/// storage that is never written again below `length` (append writes past it, commit and clear allocate anew),
/// so a view stays valid and unchanged after later writes; holding one keeps that storage alive. Do not write
/// into them.
struct KvHeadView {
  torch::Tensor keys;       ///< [n, head_dim], cache dtype, after rotary at `positions`
  torch::Tensor values;     ///< [n, value_dim], cache dtype
  torch::Tensor bias;       ///< [n] fp32 log-weights added to the attention logits (0 = an ordinary token)
  torch::Tensor positions;  ///< [n] int64 absolute positions, strictly increasing
  int64_t length() const { return keys.size(0); }
};

/// Raw read-only pointers to one (layer, head)'s entries, for kernels that must not pay a tensor per head
/// (kv_decode_attention in dcp/infer.h): `length` rows, row-major and contiguous, keys [length, head_dim] and
/// values [length, value_dim] in the cache dtype, bias [length] fp32, positions [length] int64; null pointers
/// when length is 0. They point into the cache's storage and are valid until its next append, commit, reserve,
/// load or clear. Do not write through them.
struct KvHeadData {
  const void* keys = nullptr;
  const void* values = nullptr;
  const float* bias = nullptr;
  const int64_t* positions = nullptr;
  int64_t length = 0;
};

/// What a compression step does to one head (the result of a policy). `keep` undefined: the head is left as
/// it is (new_bias / new_values must then be absent).
struct KvHeadEdit {
  torch::Tensor keep;                       ///< [m] int64 indices into the head's current view, strictly increasing
  std::optional<torch::Tensor> new_bias;    ///< [m] fp32-convertible, finite: replaces the kept entries' biases
  std::optional<torch::Tensor> new_values;  ///< [m, value_dim] floating, finite: replaces the kept values (refit)
};

/// One sequence's cache (see the file comment). Not thread-safe; inference only (append copies without autograd
/// history). Storage on spec.device (kv_cache_attention in dcp/infer.h runs the tiled operator for the chunk on
/// the CPU and its reference twin elsewhere).
class KvCache {
 public:
  /// Throws std::invalid_argument for a field < 1 or an unsupported dtype.
  explicit KvCache(const KvCacheSpec& spec);

  const KvCacheSpec& spec() const { return spec_; }

  /// Appends a chunk of t tokens to every head of `layer`: k [t, kv_heads, head_dim], v [t, kv_heads, value_dim]
  /// in the cache dtype (k after rotary), positions [t] int64 (the same for every head), strictly increasing and
  /// >= next_position(layer). Bias 0. Storage per head grows by doubling (capacity_bytes()). Throws
  /// std::invalid_argument naming the bad value (layer range, shape, dtype, device, positions) and then changes
  /// nothing.
  void append(int64_t layer, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& positions);

  /// One token for each of several caches of one spec on the CPU (a batched decode step): caches[i] gets k[i] and
  /// v[i] at positions[i] in `layer`: the same bytes as caches[i]->append(layer, k[i:i+1], v[i:i+1], positions[i:i+1]),
  /// without a tensor per cache. k [N, kv_heads, head_dim], v [N, kv_heads, value_dim] in the caches' dtype, N =
  /// caches.size() = positions.size(). Throws std::invalid_argument naming the bad value (a null cache, a cache given
  /// twice, another spec, shapes, dtype, a device other than the CPU, a position below the cache's next position) and
  /// then changes nothing.
  static void append_tokens(const std::vector<KvCache*>& caches, int64_t layer, const torch::Tensor& k,
                            const torch::Tensor& v, const std::vector<int64_t>& positions);

  /// Read-only view of (layer, head) (KvHeadView). Throws std::invalid_argument for layer or head out of range.
  KvHeadView view(int64_t layer, int64_t head) const;
  /// The same entries as raw pointers (KvHeadData), without making a tensor. Throws std::invalid_argument for
  /// layer or head out of range and for a cache not on the CPU.
  KvHeadData data(int64_t layer, int64_t head) const;

  /// The one mutator for compression: edits[h] applies to head h of `layer` (edits.size() == kv_heads). For an
  /// edit with `keep`, the head becomes exactly the entries keep[0..m) in that order with their keys and
  /// positions, biases new_bias (else their old ones) and values new_values (else their old ones, cast to the
  /// cache dtype); its storage is reallocated to m entries, so dropped entries' memory is released (unless a
  /// caller still holds a view). next_position is unchanged. Every edit is checked before any head changes;
  /// throws std::invalid_argument naming layer, head and the bad value (wrong edit count, keep not 1-D int64,
  /// unsorted, duplicate or out-of-range index, a bias or value of the wrong shape or not finite).
  void commit(int64_t layer, const std::vector<KvHeadEdit>& edits);

  /// Grows every head's capacity so that `extra` more entries fit (e.g. a prompt's length before its prefill):
  /// appending them copies nothing. Never shrinks. Throws std::invalid_argument for extra < 0.
  void reserve(int64_t extra);

  /// Entries of (layer, head). Throws std::invalid_argument for an index out of range.
  int64_t length(int64_t layer, int64_t head) const;
  /// 1 + the last position appended to `layer` (0 before any), whatever commit removed since.
  int64_t next_position(int64_t layer) const;
  /// The sequence's next position: the largest next_position(layer) (all layers agree between forwards).
  int64_t next_position() const;

  /// Bytes of one entry: keys + values (cache dtype) + bias (4) + position (8).
  int64_t entry_bytes() const;
  /// Bytes of the entries held: sum over (layer, head) of length * entry_bytes().
  int64_t bytes() const;
  /// Bytes of storage allocated (capacity of every head, >= bytes(); equal right after a commit of every head).
  int64_t capacity_bytes() const;

  /// Writes the whole state (spec, next positions, every head's entries) to `path` in dcp's binary KV format
  /// (docs/kv_cache.md "File format": little-endian, FNV-1a 64 checksum), atomically (write_file_atomically:
  /// readers see the old file or the whole new one). Throws std::runtime_error naming the file and the reason.
  void save(const std::string& path) const;
  /// Replaces this cache's state by the one saved in `path`. The file's layers, kv_heads, head_dim, value_dim
  /// and dtype must equal this cache's. Throws std::runtime_error naming the file and what is wrong (cannot be
  /// opened, not a KV cache file, truncated, checksum mismatch = corrupt, shape or dtype differs, an invariant
  /// broken); on error this cache is unchanged.
  void load(const std::string& path);

  /// Drops every entry and releases storage; next positions return to 0.
  void clear();

 private:
  struct Head {
    torch::Tensor keys, values, bias, positions;  // [capacity, ...]; undefined while capacity is 0
    int64_t length = 0;
    int64_t capacity() const { return keys.defined() ? keys.size(0) : 0; }
  };
  Head& head(int64_t layer, int64_t h);
  const Head& head(int64_t layer, int64_t h) const;
  void check_layer(int64_t layer, const char* who) const;
  void grow(Head& head, int64_t entries) const;
  void append_rows(int64_t layer, const char* k, int64_t k_token, int64_t k_head, const char* v, int64_t v_token,
                   int64_t v_head, const int64_t* positions, int64_t t);

  KvCacheSpec spec_;
  std::vector<Head> heads_;           // layer-major: heads_[layer * kv_heads + head]
  std::vector<int64_t> next_position_;  // per layer
};

}  // namespace dcp
