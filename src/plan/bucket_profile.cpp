#include "plan/bucket_profile.h"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>

#include "plan/planner_common.h"

namespace dcp::planner_detail {

double BucketSetting::throughput() const {
  return bs > 0 ? static_cast<double>(bs) / (static_cast<double>(sp_size) * seconds(bs)) : 0.0;
}

BucketSetting bucket_setting(int64_t length, int64_t sp_size, int64_t recompute_layers, const CostModel& cost,
                             const MemoryModel& memory) {
  BucketSetting st;
  st.sp_size = sp_size;
  st.recompute_layers = recompute_layers;
  st.fixed_s = cost.fixed_seconds(sp_size, recompute_layers);
  st.work_s = cost.work_seconds(length, sp_size, recompute_layers);
  st.bs = memory.max_tokens(sp_size, recompute_layers) / length;
  return st;
}

namespace {

// The best recompute count at one size (PAC), or bs 0 when the length does not fit it.
BucketSetting best_at_size(int64_t length, int64_t sp_size, const CostModel& cost, const MemoryModel& memory) {
  BucketSetting best;
  const auto r_min = memory.min_recompute_layers(length, sp_size);
  if (!r_min) return best;
  // Fewer than r_min layers hold no sample; strictly better only, so ties keep the fewer layers.
  for (int64_t r = *r_min; r <= cost.shape().layers; ++r) {
    const BucketSetting st = bucket_setting(length, sp_size, r, cost, memory);
    if (st.throughput() > best.throughput()) best = st;
  }
  return best;
}

}  // namespace

BucketSetting best_pac_setting(int64_t length, const std::vector<int64_t>& sizes, const CostModel& cost,
                               const MemoryModel& memory) {
  BucketSetting best;
  for (int64_t s : sizes) {
    const BucketSetting st = best_at_size(length, s, cost, memory);
    if (st.throughput() > best.throughput()) best = st;
  }
  return best;
}

const BucketSetting& BucketProfile::at(int64_t sp_size) const {
  for (const auto& st : by_size) {
    if (st.sp_size == sp_size) return st;
  }
  throw std::out_of_range(fmt::format("bucket {} ({} tokens) does not fit sp_size {}", key, length, sp_size));
}

BucketSetting BucketProfile::chosen_on(int64_t sp_size, const CostModel& cost) const {
  BucketSetting st = chosen;
  st.sp_size = sp_size;
  st.fixed_s = cost.fixed_seconds(sp_size, st.recompute_layers);
  st.work_s = cost.work_seconds(length, sp_size, st.recompute_layers);
  return st;
}

ProfileTable profile_buckets(const std::vector<Sample>& samples, int64_t world_size, const CostModel& cost,
                             const MemoryModel& memory, bool pac) {
  check_world(world_size);
  ProfileTable t;
  t.sizes = power_of_two_sizes(world_size, cost.shape());
  t.skipped.assign(samples.size(), 0);
  for (const auto& s : samples) {
    if (!memory.min_recompute_layers(s.length, t.sizes.back())) {
      t.skipped[static_cast<size_t>(s.id)] = 1;
      continue;
    }
    BucketProfile& b = t.buckets[length_bucket(s.length)];
    b.key = length_bucket(s.length);
    b.length = std::max(b.length, s.length);
  }
  // Without PAC: the fewest layers with which every bucket's longest sample fits its smallest size.
  t.recompute_layers = 0;
  for (const auto& [key, b] : t.buckets) {
    for (int64_t s : t.sizes) {
      if (auto r = memory.min_recompute_layers(b.length, s)) {
        t.recompute_layers = std::max(t.recompute_layers, *r);
        break;
      }
    }
  }
  for (auto& [key, b] : t.buckets) {
    for (int64_t s : t.sizes) {
      const BucketSetting st = pac ? best_at_size(b.length, s, cost, memory)
                                   : bucket_setting(b.length, s, t.recompute_layers, cost, memory);
      if (st.bs < 1) continue;
      b.by_size.push_back(st);
      // Strictly better only: ties keep the smaller size.
      if (st.throughput() > b.chosen.throughput()) b.chosen = st;
    }
  }
  return t;
}

}  // namespace dcp::planner_detail
