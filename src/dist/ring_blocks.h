// The partial attentions of zigzag ring attention: which local query rows meet which rows of the key/value
// block a rank holds at a ring step, under which mask (ring-flash-attention's zigzag_ring_flash_attn;
// Megatron-Core context parallelism, cp_comm_type p2p). Pure index arithmetic, tested without a group.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace dcp {

/// One partial attention: queries [q_begin, q_end) of the rank's local tokens against rows [k_begin, k_end)
/// of the key/value block it holds, segment by segment (cu_q / cu_k: cumulative per-segment counts relative
/// to q_begin / k_begin, for tiled_attention_forward), causal only on the diagonal step.
struct RingBlock {
  int64_t q_begin = 0, q_end = 0;
  int64_t k_begin = 0, k_end = 0;
  bool causal = false;
  std::vector<int64_t> cu_q, cu_k;
  bool empty = true;  ///< no segment has both queries and keys here: nothing to compute
};

/// The stream pieces ring position `p` of `ring_size` holds in a padded stream of `padded` tokens: zigzag
/// chunks p and 2 ring_size - 1 - p of padded / (2 ring_size) tokens each, in stream order. Throws
/// std::invalid_argument unless ring_size >= 2, 0 <= p < ring_size and padded is a positive multiple of
/// 2 ring_size.
std::vector<std::pair<int64_t, int64_t>> ring_position_pieces(int64_t padded, int64_t ring_size, int64_t p);

/// The partial attention of the queries of ring position `j` with the keys and values of position `p`, for a
/// stream whose segments are `cu_seqlens` (the whole padded stream, cu_seqlens.back() = padded; causal inside a
/// segment, nothing across). With c = padded / (2 ring_size) and the local tokens [chunk j | chunk 2r-1-j]:
/// - p == j: every local query with every local key, causal (the two chunks in stream order);
/// - p < j: every query with the first chunk of p's block only (chunk p precedes both of j's chunks, chunk
///   2r-1-p follows them), not causal;
/// - p > j: the second half of the queries (chunk 2r-1-j, which follows both of p's chunks) with all of p's
///   block, not causal; the first half sees nothing of p.
/// So every step but the diagonal costs c x 2c query-key pairs on every rank: the causal balance of zigzag.
/// Throws as ring_position_pieces, and for cu_seqlens that do not run from 0 to padded.
RingBlock ring_block(const std::vector<int64_t>& cu_seqlens, int64_t ring_size, int64_t j, int64_t p);

}  // namespace dcp
