#include "dist/ring_blocks.h"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>

namespace dcp {
namespace {

using Pieces = std::vector<std::pair<int64_t, int64_t>>;

int64_t overlap(const Pieces& pieces, int64_t lo, int64_t hi) {
  int64_t n = 0;
  for (const auto& [b, e] : pieces) n += std::max<int64_t>(0, std::min(e, hi) - std::max(b, lo));
  return n;
}

}  // namespace

Pieces ring_position_pieces(int64_t padded, int64_t ring_size, int64_t p) {
  if (ring_size < 2 || p < 0 || p >= ring_size || padded < 1 || padded % (2 * ring_size) != 0) {
    throw std::invalid_argument(fmt::format(
        "ring attention: position {} of a ring of {} over a stream of {} tokens (needs ring_size >= 2 and a stream "
        "that is a multiple of 2 x ring_size)",
        p, ring_size, padded));
  }
  const int64_t c = padded / (2 * ring_size);
  return {{p * c, (p + 1) * c}, {(2 * ring_size - 1 - p) * c, (2 * ring_size - p) * c}};
}

RingBlock ring_block(const std::vector<int64_t>& cu_seqlens, int64_t ring_size, int64_t j, int64_t p) {
  if (cu_seqlens.size() < 2 || cu_seqlens.front() != 0) {
    throw std::invalid_argument("ring attention: cu_seqlens must run from 0 to the padded stream length");
  }
  const int64_t padded = cu_seqlens.back();
  const Pieces mine = ring_position_pieces(padded, ring_size, j), theirs = ring_position_pieces(padded, ring_size, p);
  const int64_t c = padded / (2 * ring_size);
  RingBlock b;
  Pieces q = mine, k = theirs;
  if (p == j) {
    b = {0, 2 * c, 0, 2 * c, true};
  } else if (p < j) {
    b = {0, 2 * c, 0, c, false};
    k = {theirs[0]};
  } else {
    b = {c, 2 * c, 0, 2 * c, false};
    q = {mine[1]};
  }
  // Samples are intervals of the stream and the pieces are in stream order, so each segment's queries (and
  // keys) are consecutive rows: cumulative counts describe them.
  b.cu_q = {0};
  b.cu_k = {0};
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    const int64_t lo = cu_seqlens[s], hi = cu_seqlens[s + 1];
    if (hi < lo) throw std::invalid_argument("ring attention: cu_seqlens must not decrease");
    const int64_t nq = overlap(q, lo, hi), nk = overlap(k, lo, hi);
    if (nq == 0 && nk == 0) continue;
    b.cu_q.push_back(b.cu_q.back() + nq);
    b.cu_k.push_back(b.cu_k.back() + nk);
    if (nq > 0 && nk > 0) b.empty = false;
  }
  return b;
}

}  // namespace dcp
