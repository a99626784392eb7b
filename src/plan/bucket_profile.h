// Per-bucket settings of the reference planners (dcp-intra, dcp-inter, dcp-inter-pac): what the reference's
// offline profile measures per bucket (dcp-reference.md sections 2.3-2.4), computed from CostModel and
// MemoryModel instead of running the model. Internal to dcp_base.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "dcp/cost_model.h"
#include "dcp/data.h"

namespace dcp::planner_detail {

/// One (sp_size, recompute_layers) setting of a bucket whose samples are at most `length` tokens long.
struct BucketSetting {
  int64_t sp_size = 0;
  int64_t recompute_layers = 0;
  int64_t bs = 0;       ///< most samples of the bucket's length in one micro-batch within the memory budget
  double fixed_s = 0;   ///< CostModel::fixed_seconds, seconds per micro-batch
  double work_s = 0;    ///< CostModel::work_seconds of one sample of the bucket's length, seconds
  /// Predicted seconds of a micro-batch of n samples of the bucket's length (= CostModel::seconds).
  double seconds(int64_t n) const { return fixed_s + static_cast<double>(n) * work_s; }
  /// The reference's selection criterion at full bs: samples per GPU-second, bs / (sp_size * seconds(bs)).
  double throughput() const;
};

/// The setting of samples of `length` tokens on sp ranks with r recomputed layers; bs is 0 when not even one
/// sample fits the budget. Throws std::invalid_argument as CostModel::work_seconds does.
BucketSetting bucket_setting(int64_t length, int64_t sp_size, int64_t recompute_layers, const CostModel& cost,
                             const MemoryModel& memory);

/// PAC's joint choice (reference section 2.4 inside the 2.3 search): over every size of `sizes` and every
/// recompute count r in [0, L], bs = the most samples that fit, and the setting with the greatest throughput()
/// wins; ties go to the smaller size, then the fewer recomputed layers. The reference runs a grouped knapsack
/// over its two block types per probed (sp, bs); here every layer is identical, so for each (sp, r) the
/// knapsack's answer is closed-form and the largest bs is best (throughput rises with bs at fixed r), which
/// makes this enumeration exact. Returns bs 0 when the sample fits no size.
BucketSetting best_pac_setting(int64_t length, const std::vector<int64_t>& sizes, const CostModel& cost,
                               const MemoryModel& memory);

/// The profile of one bucket.
struct BucketProfile {
  int64_t key = 0;     ///< length_bucket of its samples
  int64_t length = 0;  ///< its longest placeable sample in the epoch, tokens; every setting is sized for it
  /// One setting per allowed size at which `length` fits (ascending), with the largest bs at that size:
  /// intra's detail table (reference 2.6, detail_profile). Its recompute is the epoch-wide count without PAC,
  /// the best one at that size (as best_pac_setting) with PAC.
  std::vector<BucketSetting> by_size;
  /// The profiled (sp_size, bs, recompute): the best throughput() (reference 2.3 step 5).
  BucketSetting chosen;
  /// The by_size entry of sp_size; throws std::out_of_range naming the size when the bucket does not fit it.
  const BucketSetting& at(int64_t sp_size) const;
  /// `chosen` (its bs and recompute) run on a group of sp_size >= chosen.sp_size ranks: fewer bytes per rank,
  /// so it still fits; the times are those of the larger group.
  BucketSetting chosen_on(int64_t sp_size, const CostModel& cost) const;
};

/// The profile of every bucket of the epoch.
struct ProfileTable {
  std::vector<int64_t> sizes;         ///< power_of_two_sizes, ascending
  std::vector<char> skipped;          ///< by sample id: fits no size even with every layer recomputed
  int64_t recompute_layers = 0;       ///< without PAC: the epoch-wide count used by every bucket
  std::map<int64_t, BucketProfile> buckets;
  const BucketProfile& of(int64_t key) const { return buckets.at(key); }
};

/// Profiles every bucket of `samples` (grouped by length_bucket) on world_size ranks.
///  - Without PAC, recompute is one epoch-wide count (the reference's global gradient-checkpointing switch,
///    sized like `bucket`'s): the fewest layers with which every bucket's longest sample fits at the smallest
///    size that holds it; each bucket then takes the size of best throughput at that count.
///  - With PAC, each bucket takes best_pac_setting.
/// Throws std::invalid_argument when world_size < 1.
ProfileTable profile_buckets(const std::vector<Sample>& samples, int64_t world_size, const CostModel& cost,
                             const MemoryModel& memory, bool pac);

}  // namespace dcp::planner_detail
