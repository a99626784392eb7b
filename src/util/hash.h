// FNV-1a, 64 bit (Fowler, Noll, Vo; http://www.isthe.com/chongo/tech/comp/fnv/): the hash of dcp's stable
// fingerprints and names (KV cache file checksums, weights fingerprints, data splits, plan hashes, profile cache
// names; training checkpoints use CRC-32). Stable across platforms, builds and runs, unlike std::hash; not a defence
// against tampering.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace dcp {

/// FNV-1a 64 fed in pieces: Fnv1a64().update(a).update(b).value() equals the hash of a's bytes followed by b's
/// (fnv1a64 in dcp/data.h over their concatenation).
class Fnv1a64 {
 public:
  static constexpr uint64_t kOffsetBasis = 0xcbf29ce484222325ULL;
  static constexpr uint64_t kPrime = 0x100000001b3ULL;

  /// Feeds `bytes` bytes from `data` (nullptr allowed when bytes is 0).
  Fnv1a64& update(const void* data, size_t bytes) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < bytes; ++i) h_ = (h_ ^ p[i]) * kPrime;
    return *this;
  }
  Fnv1a64& update(std::string_view s) { return update(s.data(), s.size()); }

  /// The hash of every byte fed so far (kOffsetBasis when none).
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = kOffsetBasis;
};

}  // namespace dcp
