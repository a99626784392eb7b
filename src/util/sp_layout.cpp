// SpMode names and SpLayout's shards (include/dcp/sp_layout.h).
#include "dcp/sp_layout.h"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>

namespace dcp {

const char* sp_mode_name(SpMode mode) {
  switch (mode) {
    case SpMode::kUlysses: return "ulysses";
    case SpMode::kRing: return "ring";
    case SpMode::kUlyssesRing: return "ulysses-ring";
  }
  return "?";
}

SpMode sp_mode_from_name(const std::string& name) {
  for (SpMode m : {SpMode::kUlysses, SpMode::kRing, SpMode::kUlyssesRing}) {
    if (name == sp_mode_name(m)) return m;
  }
  throw std::invalid_argument(fmt::format("unknown sp_mode '{}' (allowed: ulysses, ring, ulysses-ring)", name));
}

std::vector<std::pair<int64_t, int64_t>> SpLayout::shard(int64_t padded, int64_t sp_rank) const {
  if (sp_size < 1 || ulysses_size < 1 || sp_size % ulysses_size != 0) {
    throw std::invalid_argument(fmt::format("SpLayout: ulysses_size {} does not divide sp_size {}", ulysses_size, sp_size));
  }
  if (padded < 1 || padded % pad_multiple() != 0) {
    throw std::invalid_argument(fmt::format("SpLayout::shard: stream of {} tokens is not a positive multiple of {}",
                                            padded, pad_multiple()));
  }
  if (sp_rank < 0 || sp_rank >= sp_size) {
    throw std::invalid_argument(fmt::format("SpLayout::shard: sp_rank {} outside [0, sp_size {})", sp_rank, sp_size));
  }
  const int64_t local = padded / sp_size;
  if (ring_size() == 1) return {{sp_rank * local, (sp_rank + 1) * local}};
  const int64_t chunk = padded / (2 * ring_size()), j = sp_rank / ulysses_size;
  // The subgroup's tokens: chunk j, then chunk 2 ring_size - 1 - j; this member's share starts at `from`.
  const int64_t from = (sp_rank % ulysses_size) * local, to = from + local;
  std::vector<std::pair<int64_t, int64_t>> out;
  const std::pair<int64_t, int64_t> chunks[2] = {{j * chunk, (j + 1) * chunk},
                                                 {(2 * ring_size() - 1 - j) * chunk, (2 * ring_size() - j) * chunk}};
  for (int c = 0; c < 2; ++c) {
    const int64_t lo = std::max(from, c * chunk), hi = std::min(to, (c + 1) * chunk);  // in the concatenation
    if (lo < hi) out.emplace_back(chunks[c].first + lo - c * chunk, chunks[c].first + hi - c * chunk);
  }
  return out;
}

int64_t ulysses_ring_size(int64_t sp_size, int64_t requested, int64_t heads) {
  auto fits = [&](int64_t u) { return u > 1 && u < sp_size && sp_size % u == 0 && heads % u == 0; };
  if (requested != 0) return fits(requested) ? requested : 0;
  // A divisor of heads > 0 is at most heads: start there (sp_layouts_allowed asks for every size up to the world,
  // so scanning from sp_size - 1 cost O(world^2), milliseconds of dcp-opt's planning at world 1024).
  for (int64_t u = heads > 0 ? std::min(sp_size - 1, heads) : sp_size - 1; u > 1; --u) {
    if (fits(u)) return u;
  }
  return 0;
}

}  // namespace dcp
