// Pieces of dcp-opt (dcp_opt.cpp) with a reference twin in the tests (test_planners: Planner.LoadBlocks*,
// Planner.LongestFirst*): the ordered lists of its fill and the order of its samples.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "dcp/planners.h"

namespace dcp::dcp_opt_detail {

/// A group's (load, key) entry: loads in seconds, the key names the group; ordered as pairs.
using Entry = std::pair<double, size_t>;

/// Ordered entries with unique keys, as a std::set<Entry> orders them, for fill's open groups of one size (up
/// to hundreds of groups, one update per sample placed): sorted blocks of at most kBlock entries, so a lookup is
/// two binary searches over contiguous memory and an update moves at most a block's entries, where a tree
/// allocates a node per group and chases pointers, and one sorted vector moves every entry between a group's
/// old and new load (hundreds at world 1024, where the groups fill up to similar loads). The order, and so
/// every answer, is the set's (Planner.LoadBlocksAnswersAsAnOrderedSet).
class LoadBlocks {
 public:
  /// An entry's place: block b, index j in it; valid until the next insert or update.
  struct Pos {
    size_t b = 0, j = 0;
  };
  bool empty() const { return blocks_.empty(); }
  /// The least entry; the list must not be empty.
  const Entry& front() const { return blocks_.front().front(); }
  const Entry& at(Pos p) const { return blocks_[p.b][p.j]; }
  /// The last entry for which `pred` holds, where pred holds for a prefix of the order (nothing when it holds
  /// for none).
  template <class Pred>
  std::optional<Pos> last_where(Pred pred) const {
    const auto b = std::partition_point(blocks_.begin(), blocks_.end(),
                                        [&](const std::vector<Entry>& block) { return pred(block.front()); });
    if (b == blocks_.begin()) return std::nullopt;
    const std::vector<Entry>& block = *std::prev(b);
    const auto j = std::partition_point(block.begin(), block.end(), pred);
    return Pos{static_cast<size_t>(b - blocks_.begin()) - 1, static_cast<size_t>(j - block.begin()) - 1};
  }
  /// Inserts e, whose key is not present yet, in order.
  void insert(const Entry& e) {
    if (blocks_.empty()) {
      blocks_.emplace_back().reserve(kBlock + 1);
      blocks_.back().push_back(e);
      return;
    }
    // The first block whose last entry is above e holds it (else the last block).
    auto b = std::partition_point(blocks_.begin(), blocks_.end() - 1,
                                  [&](const std::vector<Entry>& block) { return block.back() < e; });
    std::vector<Entry>& block = *b;
    block.insert(std::upper_bound(block.begin(), block.end(), e), e);
    if (block.size() > kBlock) {  // split in halves
      std::vector<Entry> upper;
      upper.reserve(kBlock + 1);
      upper.assign(block.begin() + static_cast<std::ptrdiff_t>(kBlock / 2), block.end());
      block.resize(kBlock / 2);
      blocks_.insert(b + 1, std::move(upper));
    }
  }
  /// Sets the load of the entry at p to v, which is not below its load, and moves the entry to its place.
  void update(Pos p, double v) {
    const Entry e{v, at(p).second};
    std::vector<Entry>& block = blocks_[p.b];
    if (p.b + 1 == blocks_.size() || e < blocks_[p.b + 1].front()) {  // it stays in its block: move it up there
      const auto from = block.begin() + static_cast<std::ptrdiff_t>(p.j);
      const auto to = std::upper_bound(from + 1, block.end(), e);
      std::move(from + 1, to, from);
      *(to - 1) = e;
      return;
    }
    erase(p);
    insert(e);
  }
  /// Removes the entry at p.
  void erase(Pos p) {
    std::vector<Entry>& block = blocks_[p.b];
    block.erase(block.begin() + static_cast<std::ptrdiff_t>(p.j));
    if (block.empty()) blocks_.erase(blocks_.begin() + static_cast<std::ptrdiff_t>(p.b));
  }
  /// Every entry in order (for the tests).
  std::vector<Entry> entries() const {
    std::vector<Entry> out;
    for (const auto& block : blocks_) out.insert(out.end(), block.begin(), block.end());
    return out;
  }

 private:
  static constexpr size_t kBlock = 32;
  std::vector<std::vector<Entry>> blocks_;
};

/// `ids` (sample ids, indices into `samples`, lengths positive) longest first, ties in their order: a stable
/// radix sort on (longest length - length), a byte per pass (three passes for lengths up to 2^24), the order of
/// sorting (-length, position) pairs (Planner.LongestFirstIsTheStableSortByLength).
inline std::vector<int64_t> longest_first(const std::vector<Sample>& samples, const std::vector<int64_t>& ids) {
  const size_t n = ids.size();
  auto length = [&](int64_t id) { return samples[static_cast<size_t>(id)].length; };
  int64_t longest = 0;
  for (int64_t id : ids) longest = std::max(longest, length(id));
  std::vector<uint64_t> key(n);
  uint64_t most = 0;
  for (size_t i = 0; i < n; ++i) {
    key[i] = static_cast<uint64_t>(longest - length(ids[i]));
    most = std::max(most, key[i]);
  }
  std::vector<size_t> order(n), next(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  for (unsigned shift = 0; shift < 64 && (most >> shift) > 0; shift += 8) {
    size_t start[257] = {};
    for (size_t i = 0; i < n; ++i) ++start[((key[i] >> shift) & 255) + 1];
    for (size_t d = 0; d < 256; ++d) start[d + 1] += start[d];
    for (size_t i : order) next[start[(key[i] >> shift) & 255]++] = i;
    order.swap(next);
  }
  std::vector<int64_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = ids[order[i]];
  return out;
}

}  // namespace dcp::dcp_opt_detail
