// Helpers shared by the planners (internal to dcp_base).
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "dcp/planners.h"

namespace dcp::planner_detail {

constexpr double kInf = std::numeric_limits<double>::infinity();

inline int64_t length_of(const std::vector<Sample>& samples, int64_t id) {
  return samples[static_cast<size_t>(id)].length;
}

/// Throws std::invalid_argument when world_size < 1.
void check_world(int64_t world_size);

/// The static (sp, recompute) of `packed` and `bucket` for the whole epoch, and the samples it cannot hold.
struct StaticSetting {
  int64_t sp_size = 0;  ///< 0: no sample fits
  int64_t recompute_layers = 0;
  int64_t capacity = 0;  ///< tokens per micro-batch
  std::vector<char> skipped;  ///< by sample id
};

/// The smallest allowed divisor of world_size (or requested_sp when > 0) at which the longest placeable sample
/// fits, with its fewest recompute layers. Throws std::invalid_argument when requested_sp is not allowed.
StaticSetting static_setting(const std::vector<Sample>& samples, int64_t world_size, const CostModel& cost,
                             const MemoryModel& memory, int64_t requested_sp);

/// The ids whose flag is set.
std::vector<int64_t> skipped_ids(const std::vector<char>& skipped);
/// The ids of all steps, in order.
std::vector<int64_t> epoch_ids(const std::vector<std::vector<int64_t>>& steps);
/// The step's ids without the skipped ones.
std::vector<int64_t> kept(const std::vector<int64_t>& ids, const std::vector<char>& skipped);
/// A group of `layout`: sp_mode kUlysses when ulysses_size is sp_size (or sp_size is 1), kRing when it is 1,
/// else kUlyssesRing with that ulysses_size.
GroupPlan group_of_layout(int64_t first_rank, const SpLayout& layout, std::vector<MicroBatch> micro_batches);
/// A StepPlan of these groups, sorted by round, then first rank, with its global token count.
StepPlan make_step(const PlannerOptions& opt, int64_t index, std::vector<GroupPlan> groups);

/// Quarter-octave length bucket of `length` tokens (positive): the smallest k with length <= 2^(k/4), so bucket
/// k holds lengths in (2^((k-1)/4), 2^(k/4)]. `bucket` and the reference planners share it.
int64_t length_bucket(int64_t length);

/// The power-of-two sizes of sp_sizes_allowed, ascending. Placed largest first, groups of these sizes are
/// aligned blocks for any world_size (every offset is a sum of larger powers of two).
std::vector<int64_t> power_of_two_sizes(int64_t world_size, const ModelShape& shape);

/// Ranks left after `used` ones, as power-of-two groups of `sizes` (ascending), largest first.
std::vector<int64_t> leftover_groups(int64_t world_size, int64_t used, const std::vector<int64_t>& sizes);

/// A deterministic random stream (SplitMix64 chained through sample_seed) for one planner step: keyed by
/// (seed, epoch, step index, purpose), never the global RNG, identical on every rank.
class StepRng {
 public:
  StepRng(uint64_t seed, int64_t epoch, int64_t step, uint64_t purpose);
  uint64_t next();
  /// Uniform in [0, 1) with 53 random bits.
  double uniform();
  /// Uniform integer in [0, n); n must be positive.
  size_t below(size_t n);
  /// Fisher-Yates shuffle.
  void shuffle(std::vector<int64_t>& v);

 private:
  uint64_t state_;
  uint64_t counter_ = 0;
};

}  // namespace dcp::planner_detail
