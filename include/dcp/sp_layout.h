// How a group of ranks shares one packed token stream under sequence parallelism: the SP mode and the layout
// that names the tokens each member holds. Pure data, no tensors; the model shards batches by it
// (make_shard, dcp/model.h), the planners put it in StepPlans (dcp/plan.h), dist attends by it, and the config
// checks parallel.* against it (dcp/config.h).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace dcp {

/// How the ranks of a group share attention over a micro-batch (docs/sequence_parallel.md):
/// - kUlysses: an all-to-all turns sequence shards into head shards (DeepSpeed-Ulysses, Jacobs et al. 2023);
///   sp_size must divide the heads.
/// - kRing: every rank keeps its queries and key/value blocks travel around the group with point-to-point
///   sends (Ring Self-Attention, Li et al. 2021; ring attention, Liu et al. 2023, arXiv 2310.01889), partial
///   results merged exactly by their logsumexps; the stream is sharded zigzag (rank r of P holds chunks r and
///   2P-1-r of 2P, ring-flash-attention's zigzag_ring) so that causal work is balanced. Any sp_size.
/// - kUlyssesRing: Ulysses inside subgroups of ulysses_size consecutive ranks, the ring across the subgroups
///   (USP, Fang & Zhao 2024, arXiv 2405.07719; LoongTrain's 2D attention); ulysses_size must divide the heads.
enum class SpMode { kUlysses, kRing, kUlyssesRing };

/// "ulysses", "ring" or "ulysses-ring" (config values and StepPlan JSON).
const char* sp_mode_name(SpMode mode);
/// The inverse of sp_mode_name; throws std::invalid_argument naming the value and the allowed ones.
SpMode sp_mode_from_name(const std::string& name);

/// Which tokens of a packed stream each rank of a group holds, and how attention is split: sp_size ranks as
/// ring_size() subgroups of ulysses_size consecutive ranks (ring_size 1 = Ulysses, ulysses_size 1 = ring).
struct SpLayout {
  int64_t sp_size = 1;
  int64_t ulysses_size = 1;
  int64_t ring_size() const { return sp_size / ulysses_size; }
  /// The stream is padded to a multiple of this: sp_size, or 2 x sp_size with a ring (2 x ring_size zigzag
  /// chunks, each split over a subgroup).
  int64_t pad_multiple() const { return ring_size() > 1 ? 2 * sp_size : sp_size; }
  int64_t padded_length(int64_t tokens) const { return (tokens + pad_multiple() - 1) / pad_multiple() * pad_multiple(); }
  /// The pieces [begin, end) of a padded stream of `padded` tokens that member `sp_rank` holds, in the order of
  /// its local tokens (one piece, or two with a ring); they hold padded / sp_size tokens. Ring position
  /// j = sp_rank / ulysses_size holds zigzag chunks j and 2 x ring_size - 1 - j (padded / (2 x ring_size)
  /// tokens each); member sp_rank % ulysses_size of the subgroup holds its share of their concatenation, so a
  /// Ulysses all-to-all inside the subgroup yields both chunks in stream order. Throws std::invalid_argument
  /// when padded is not a positive multiple of pad_multiple() or sp_rank is outside [0, sp_size).
  std::vector<std::pair<int64_t, int64_t>> shard(int64_t padded, int64_t sp_rank) const;
};

/// The Ulysses subgroup size of an ulysses-ring group of `sp_size` ranks over a model of `heads` heads:
/// `requested` when it divides both and lies strictly between 1 and sp_size; for requested 0 the largest such
/// divisor; 0 when there is none (or requested is not one).
int64_t ulysses_ring_size(int64_t sp_size, int64_t requested, int64_t heads);

/// Whether a group of `layout` can attend over a model of `heads` heads: the Ulysses part must divide them.
inline bool layout_fits_heads(const SpLayout& layout, int64_t heads) { return heads % layout.ulysses_size == 0; }

}  // namespace dcp
