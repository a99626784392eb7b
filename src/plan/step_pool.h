// The samples of one step filed by bucket, and the reference's random draws over them (dcp-reference.md
// sections 3.4 step 1 and 3.5 step 1). Shared by dcp-intra and dcp-inter; internal to dcp_base.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <vector>

#include "dcp/plan.h"
#include "plan/bucket_profile.h"
#include "plan/planner_common.h"

namespace dcp::planner_detail {

/// The step's samples by bucket, each bucket's ids shuffled by the step's StepRng (the reference shuffles each
/// bucket with its seeded generator). Planners take samples from a bucket's front and give unused ones back
/// to the front, so every sample is placed exactly once.
class StepPool {
 public:
  /// `ids` must be placeable (not skipped in `profile`). by_buckets: draw weights classes by their number of
  /// non-empty buckets, as the reference does (for PlannerOptions::native_iterations).
  StepPool(const std::vector<int64_t>& ids, const std::vector<Sample>& samples, const ProfileTable& profile,
           StepRng& rng, bool by_buckets = false);

  bool empty() const { return left_ == 0; }
  int64_t remaining(int64_t key) const;
  /// Up to n ids from the front of bucket `key`.
  std::vector<int64_t> take(int64_t key, int64_t n);
  /// Puts ids back at the front of bucket `key`, in their order.
  void give_back(int64_t key, const std::vector<int64_t>& ids);

  /// The reference's fill draw, adapted and with its sampling bug fixed (section 7): among the SP classes (a
  /// bucket's profiled sp_size) <= max_sp that still have samples, a class by the cumulative distribution of
  /// the class weights, then one of its non-empty buckets uniformly. nullopt when no class fits. A class's
  /// weight is the GPU-seconds its remaining samples need at their profiled settings (samples x per-sample
  /// seconds x sp_size), not the reference's number of buckets: the reference draws a new layout every
  /// iteration while buckets drain, so over an epoch each class gets GPU time by its work; a step has one
  /// layout, which must give each class its share at once. With by_buckets the weight is the reference's.
  std::optional<int64_t> draw(int64_t max_sp, StepRng& rng) const;
  /// A non-empty bucket of the largest class <= max_sp, uniformly; nullopt when none.
  std::optional<int64_t> draw_largest(int64_t max_sp, StepRng& rng) const;

 private:
  // Non-empty buckets of each class (sp_size -> keys ascending).
  std::map<int64_t, std::vector<int64_t>> classes() const;

  const ProfileTable& profile_;
  bool by_buckets_;
  std::map<int64_t, std::deque<int64_t>> ids_;  // bucket key -> ids
  int64_t left_ = 0;
};

/// A micro-batch of these ids with `recompute_layers`.
MicroBatch make_micro_batch(const std::vector<Sample>& samples, const std::vector<int64_t>& ids,
                            int64_t recompute_layers);

/// A group of the reference planners while it is being filled: its size, the bucket it serves (-1: none yet)
/// and its micro-batches.
struct RefGroup {
  int64_t sp_size = 1;
  int64_t key = -1;
  std::vector<MicroBatch> micro_batches;
};

/// GroupPlans of these groups in their order at consecutive first ranks; the caller orders them by sp_size
/// descending, which makes every block aligned for power-of-two sizes.
std::vector<GroupPlan> place_groups(std::vector<RefGroup> groups);

}  // namespace dcp::planner_detail
